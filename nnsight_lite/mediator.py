"""One invoke's side of the runtime: its body, its rows of the batch, what it waits for.

    Mediator              one per invoke: its worker greenlet, batch rows, pending request
    current_mediator()    the Mediator whose body is running now (or an OutsideTraceError)
    wait_for_name()       a body reading a name an earlier invoke has not bound yet waits for it
    (StopTrace, NameWait and Barrier are in waits.py; the errors a body gets for a value it
    cannot have, in messages.py)

The body side (``get``/``set``, called from Envoy properties) switches to the parent with a
request ``(slot, kind, call)``; the parent side (``serve``, called by the interleaver when the
model reaches that call) switches back in with the value and applies what the body left there.
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING

import torch

from . import batching, tiles
from .errors import InferenceModeSwitchError, InputError, OutOfOrderError
from .messages import after_skip_error, late_error, missed_error, no_body_error
from .tracebacks import record_reshape, record_skip, same_kind
from .waits import NameWait, StopTrace
from .workers import (
    _FINISHED,
    INFERENCE_BIT,
    _getcurrent,
    _note,
    _take_worker,
    job_ended,
    set_tls_state,
    tls_state,
    user_location,
)

if TYPE_CHECKING:
    from .interleaver import Interleaver

OUTPUT = "output"
_Tensor = torch.Tensor
INPUT = "input"
_DONE = object()
_MISSING = object()
#: ``depth`` > 0 while a trace without inputs runs its body to collect invokes (this thread)
_collecting = threading.local()


def wait_for_name(scope, name: str, around: bool = False):
    """Called when a body reads a name nobody has bound yet (``around``: one that an earlier
    invoke's body binds and the caller's scopes also hold).

    If an earlier invoke of the same trace is still running, it may bind the name later in
    this forward (``invoke 1`` using what ``invoke 0`` reads at the same module): wait for it.
    Otherwise raise ``KeyError`` (Python turns that into the usual NameError; for ``around``,
    the Scope then reads the caller's value).
    """
    med = getattr(_getcurrent(), "mediator", None)
    if med is None or med.scope is not scope or not med.interleaver.earlier_alive(med):
        raise KeyError(name)
    before = med.interleaver.position is None
    med.parent.switch(NameWait(name, around))
    if before:  # (for the error a read of a module that ran meanwhile gets: _late_error)
        med.waited = (name, user_location())
    return scope[name]


def current_mediator(envoy=None, what: str = "output", action: str = "read") -> "Mediator":
    """The Mediator of the body running now; raise OutsideTraceError where there is none.

    ``what`` names the value or operation (``output``, ``skip()``; with no ``envoy``, the whole
    name: ``tracer.next()``); ``action`` is what the body did with it (read, set, called)."""
    med = getattr(_getcurrent(), "mediator", None)
    if med is None:
        raise no_body_error(envoy, what, action)
    return med


class Mediator:
    """Runtime state of one invoke: its body greenlet, its batch rows and what it waits for."""

    __slots__ = ("interleaver", "index", "batch", "scope", "run_fn", "greenlet", "parent", "done",
                 "pending", "pending_envoy", "cur_key", "cur_value", "replaced", "skip_value",
                 "tls", "iteration", "iter_depth", "loop_bounded", "shared", "snapshot", "assigned",
                 "loop_ended", "waited", "iter_cut", "after_loop")

    inline = False  # True: the body runs in the user's own greenlet (nosource.py), never unwound
    # the errors for a value this body cannot have (messages.py)
    _after_skip_error = after_skip_error
    _late_error = late_error
    missed_error = missed_error

    switches = True  # serving it switches into its body (a cache's observer does not)

    def __init__(self, interleaver: "Interleaver", index: int, run, batch=None, scope=None):
        self.interleaver = interleaver
        self.index = index
        self.batch = batch  # (start, size) or None for the whole batch
        self.scope = scope
        self.run_fn = run
        self.greenlet = None
        self.parent = None
        self.done = False
        self.pending = None  # (slot, kind, call) this body waits for
        self.pending_envoy = None
        self.cur_key = None
        self.cur_value = None
        self.replaced = False
        self.skip_value = _MISSING
        self.tls = None
        self.iteration = 0  # the call every read addresses: a loop's step, moved by .next()
        self.iter_depth = 0
        self.loop_bounded = False  # the innermost step loop has a last step the user wrote
        self.shared = None  # the trace's scope, where this invoke publishes what it binds
        self.snapshot = None  # the trace body's names as of this invoke
        self.assigned = ()  # the names this invoke's body may bind (what publish copies)
        # (slot, call, loop_bounded): what a step loop waited for when the forward ended it
        self.loop_ended = None
        self.iter_cut = None  # (slot, call) where the forward's end cut the innermost step loop
        self.after_loop = False  # a step loop of this body has ended (its reads are at call 0)
        # (name, line): this body's last request was a wait for a name another invoke binds,
        # begun before the forward ran (every module that has run, ran while it waited)
        self.waited = None

    def label(self) -> str:
        """How messages name this body: ``invoke 2`` (counting the trace's own invokes from 0),
        or the model's persistent edit it runs (edits come first, see sessions._add_edits)."""
        edits = self.interleaver.edits
        if self.index >= len(edits):
            return f"invoke {self.index - len(edits)}"
        body = edits[self.index]
        return ("the model's persistent edit (made by `with model.edit(...)` at "
                f"{body.filename}:{body.lineno})")

    def _raised_in(self) -> str:
        """The note an exception leaving this body gets, where the trace runs several."""
        if self.index < len(self.interleaver.edits):
            return (f"nnsight_lite: raised in {self.label()}, which runs in every trace of this "
                    "model before the trace's own bodies; model.clear_edits() removes it")
        return f"nnsight_lite: raised in the body of {self.label()} of this trace"

    # ---- parent side

    def start(self, parent_state=None) -> None:
        """Start the body in a pooled worker and run it to its first request.
        ``parent_state``: the caller's ``tls_state()`` where it already has it."""
        g = self.greenlet = _take_worker()  # (before it points here: an interrupt between
        g.mediator = self  # the two must not leave a worker attached that the trace cannot see)
        g.gr_context = contextvars.copy_context()
        self.parent = g.parent
        inter = self.interleaver
        inter.register(self, self.resume(self.run_fn, None, parent_state))
        if inter.name_waiters:
            inter.wake()

    def resume(self, value, throw: BaseException | None = None, parent_state=None):
        """Switch into the body (sending ``value`` or throwing ``throw``); return its request.

        ``parent_state`` is the caller's ``tls_state()`` when it already has it.
        """
        if parent_state is None:
            parent_state = tls_state()
        if self.tls is not None and self.tls != parent_state:
            set_tls_state(self.tls, parent_state)
        g = self.greenlet
        try:
            req = g.switch(value) if throw is None else g.throw(throw)  # (workers.switch_job)
            if req is _FINISHED:  # the body ended: its worker goes back to the pool
                job_ended(g)  # (raises what the body raised)
                self.done = True
                self.pending = None
                req = _DONE
        except BaseException as exc:
            throw = None  # it is in exc's traceback through this frame: no cycle
            self.done = True
            self.pending = None
            if self.shared is not None and isinstance(exc, StopTrace):
                self.publish()  # tracer.stop() keeps what the body saved before it
            now = tls_state()
            if now != parent_state:
                set_tls_state(parent_state, now)
            if isinstance(exc, Exception):
                inter = self.interleaver
                if len(inter.mediators) > 1:
                    _note(exc, self._raised_in())
                if inter.raised is None:  # (raised again if the model's own code catches it)
                    inter.raised = exc
                inter = None  # (exc's traceback holds this frame: no cycle through it)
            raise
        if self.shared is not None:
            self.publish()
        now = tls_state()
        self.tls = now
        if now != parent_state:
            set_tls_state(parent_state, now)
            if (now ^ parent_state) & INFERENCE_BIT:
                return self.resume(None, InferenceModeSwitchError(
                    f"{self.label()} waited for {self._awaited(req)} inside its own "
                    "torch.inference_mode() block; the model's forward cannot switch inference "
                    "mode for it. Put the whole trace inside `with torch.inference_mode():` "
                    "instead, or use torch.no_grad() in the body."
                ))
        return req

    def _awaited(self, req) -> str:
        """What the request ``req`` the body just made waits for, and the body's line (for
        messages): "model.layer1.output at file:line"."""
        envoy = self.pending_envoy
        what = "a module value"
        if envoy is not None and isinstance(req, tuple) and len(req) == 3:
            what = f"{envoy._path}.{req[1]}" + (f" (call {req[2]})" if req[2] else "")
        frame = self.greenlet.gr_frame if self.greenlet is not None else None
        return f"{what} at {user_location(frame)}" if frame is not None else what

    def publish(self) -> None:
        """Copy the names this invoke has bound into the trace's shared scope, so later
        invokes (and the write-back after the trace) see them."""
        snap = self.snapshot
        shared = self.shared
        scope = self.scope
        for k in self.assigned:
            v = dict.get(scope, k, _MISSING)
            if v is not _MISSING and snap.get(k, _MISSING) is not v:
                dict.__setitem__(shared, k, v)

    def serve(self, key, full, parent_state=None):
        """Give the body its view of ``full`` at ``key``; return ``full`` with its edits applied."""
        b = self.batch
        inter = self.interleaver
        total = inter.total
        before = None
        factors = inter.row_factors
        if b is None:
            view = full
        else:
            mark = len(tiles._TILED) if factors else 0  # (copies served: see write_back)
            view = batching.narrow(full, b[0], b[1], total, factors)
            if view.__class__ is not _Tensor:  # a narrowed copy of a container (or no
                before = batching.entries(view)  # container: None)
        self.cur_key = key
        self.cur_value = view
        self.replaced = False
        try:
            req = self.resume(view, None, parent_state)
        finally:
            self.cur_key = None
            if factors and b is not None and len(tiles._TILED) > mark:
                tiles.write_back(mark)  # (before any merge: a replacement wins over them)
        if self.replaced:
            new = self.cur_value
            full = new if b is None else batching.merge(full, new, b[0], b[1], total,
                                                        inter.row_factors)
        elif before is not None:  # members the body set on its copy go back into its rows
            full = batching.merge_replaced(full, view, before, b[0], b[1], total,
                                           inter.row_factors)
        self.cur_value = None
        inter.register(self, req)
        if inter.name_waiters:
            inter.wake()
        return full

    # ---- body side

    def get(self, envoy, kind):
        """The value of ``envoy``'s ``kind`` at this body's current call; waits for it."""
        inter = self.interleaver
        slot = inter.slots.get(id(envoy._module))  # (Interleaver.slot_of's usual case, inlined)
        if slot is None:
            slot = inter.slot_of(envoy)  # an operation's slot, or the error saying why not
        call = self.iteration
        cur = self.cur_key
        if cur is not None and cur[0] is slot and cur[1] is kind and cur[2] == call:
            if self.skip_value is not _MISSING:
                raise self._after_skip_error(envoy)
            return self.cur_value
        key = (slot, kind, call)
        # (Slot.outs / Slot.calls inlined: this runs at every read)
        done = (slot.n_out if kind is OUTPUT else slot.n_in) if slot.gen == slot.live.serial else 0
        passed = done > call
        if passed:  # unless the model is handing out exactly this value right now
            now = inter.serving
            passed = now is None or now[0] is not slot or now[1] is not kind or now[2] != call
            if passed and inter.calling:  # served further out, around a hook=True call
                passed = key not in inter.calling
        if passed or inter.finished:
            raise self._late_error(envoy, key)
        self.pending_envoy = envoy
        self.waited = None
        return self.parent.switch(key)

    def set(self, envoy, kind, value) -> None:
        """Replace ``envoy``'s ``kind`` at this body's current call with ``value``."""
        cur = self.cur_key  # (get's first answer, in line: a set mostly follows the read)
        if (cur is not None and cur[1] is kind
                and cur[0] is self.interleaver.slots.get(id(envoy._module))
                and cur[2] == self.iteration):
            if self.skip_value is not _MISSING:
                raise self._after_skip_error(envoy)
            old = self.cur_value
        else:
            old = self.get(envoy, kind)
        if value is not old and (value.__class__ is not _Tensor or old.__class__ is not _Tensor
                                 or not same_kind(value, old)):
            record_reshape(self, envoy, kind, old, value)  # noted on an error it may lead to
        if old.__class__ is _Tensor and old.requires_grad and value.__class__ is _Tensor \
                and not value.requires_grad and not self.interleaver.grad_cut:
            # (a .grad read that backprop then never reaches names this: backward_errors.py)
            self.interleaver.grad_cut = (f"{envoy._path}.{kind} was replaced by {self.label()} "
                                         f"at {user_location()} with a tensor that does not "
                                         "require grad")
        self.cur_value = value
        self.replaced = True

    def move(self, step: int, envoy=None) -> None:
        """``.next(step)`` (``envoy``'s, or the tracer's where None): every later read of this
        body addresses the call ``step`` further on; there is no call before 0."""
        call = self.iteration + step
        if call < 0:
            name = f"{envoy._path}.next({step})" if envoy is not None else f"tracer.next({step})"
            raise InputError(
                f"{name} at {user_location()} steps back past the first call: this "
                f"body's reads are at call {self.iteration}, and calls count from 0. A negative "
                "step only undoes an earlier .next() (.next(-1) after .next())."
            )
        self.iteration = call

    def skip(self, envoy, value) -> None:
        """Run no ``envoy`` at this body's current call: its output is ``value``."""
        cur = self.cur_key
        if (self.skip_value is _MISSING or cur is None or cur[1] is not INPUT
                or cur[2] != self.iteration
                or cur[0] is not self.interleaver.slot_of(envoy)):  # (else a second skip at
            try:  # this call: it replaces the first)
                self.get(envoy, INPUT)
            except OutOfOrderError as exc:  # named as the body wrote it, not as .input
                path = envoy._path
                exc.args = (str(exc).replace(f"{path}.input", f"{path}.skip(...)", 1),)
                raise
        record_skip(self, envoy, value)  # noted on an error it may lead to
        self.skip_value = value
