"""One invoke's side of the runtime: its body, its rows of the batch, what it waits for.

    Mediator              one per invoke: its worker greenlet, batch rows, pending request
    current_mediator()    the Mediator whose body is running now (or an OutsideTraceError)
    wait_for_name()       a body reading a name an earlier invoke has not bound yet waits for it
    StopTrace             raised by ``tracer.stop()``; ends the forward, not an error

The body side (``get``/``set``, called from Envoy properties) switches to the parent with a
request ``(slot, kind, call)``; the parent side (``serve``, called by the interleaver when the
model reaches that call) switches back in with the value and applies what the body left there.
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING

import torch

from . import batching
from .errors import (
    InferenceModeSwitchError,
    InputError,
    MissedModuleError,
    NNsightError,
    OutOfOrderError,
    OutsideTraceError,
)
from .tracebacks import record_reshape, record_skip
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
_CONTAINERS = (dict, list)  # narrowed values whose members a body may set (see serve)
_MISSING = object()
#: ``depth`` > 0 while a trace without inputs runs its body to collect invokes (this thread)
_collecting = threading.local()


def _skipped_above(slot, skipped):
    """The skipped slot among ``slot``'s ancestors, or None."""
    while skipped and slot is not None:
        slot = slot.parent
        if slot in skipped:
            return slot
    return None


class StopTrace(BaseException):
    """Raised by ``tracer.stop()`` to end the forward early. Not an error; never escapes a trace.

    It derives from BaseException so that a model's own ``except Exception`` does not swallow it.
    ``tracer`` is the Tracer whose forward it ends (None: the innermost), so that ``outer.stop()``
    in the body of a trace nested in ``outer``'s passes through the inner trace.
    """

    def __init__(self, tracer=None, where: str = "<unknown>"):
        super().__init__()
        self.tracer = tracer
        self.where = where  # the user's line that called stop()

    def ends(self, tracer) -> bool:
        """Whether this stop is ``tracer``'s to take."""
        return self.tracer is None or self.tracer is tracer


class NameWait:
    """A body's request to wait until an earlier invoke binds ``name`` in the shared scope."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


class BarrierWait(NameWait):
    """A body's wait at a ``tracer.barrier(n)`` until ``n`` bodies have called it this round."""

    __slots__ = ("barrier", "round", "where")

    def __init__(self, barrier: "Barrier", where: str):
        self.name = None
        self.barrier = barrier
        self.round = barrier.round
        self.where = where


class Barrier:
    """What ``tracer.barrier(n)`` returns: each call from an invoke body waits until ``n``
    bodies have called it, then all of them go on (and the next call starts a new round).

    Invokes run in order at every module, so an earlier invoke's value reaches a later one by
    name without it; a barrier matters when a name is rebound round by round::

        b = tracer.barrier(2)
        with tracer.invoke(clean):
            for layer in model.model.layers:
                h = layer.output
                b()                           # round i: h is layer i's output ...
        with tracer.invoke(corrupt):
            for layer in model.model.layers:
                b()                           # ... here, in the same round
                layer.output[:] = h
    """

    def __init__(self, n: int):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InputError(f"tracer.barrier(n) takes the number of invokes that call it, a "
                             f"positive int; got {n!r}")
        self.n = n
        self.round = 0
        self.arrived: list = []  # the mediators waiting in this round

    def __call__(self) -> None:
        med = getattr(_getcurrent(), "mediator", None)
        if med is None:
            if in_backward_block():
                raise backward_block_error(
                    "tracer.barrier()", "call it in the invoke body, before or after the "
                    "`with loss.backward():` block")
            raise OutsideTraceError(
                f"a tracer.barrier() was called outside an invoke body (at {user_location()}); "
                "call it inside the `with tracer.invoke(...):` blocks it synchronises")
        self.arrived.append(med)
        if len(self.arrived) >= self.n:  # the last to arrive: everyone goes on
            self.round += 1
            self.arrived = []
            return
        med.parent.switch(BarrierWait(self, user_location()))

    def fillable(self, inter) -> bool:
        """Whether bodies enough to fill this round may still arrive."""
        if inter.finished:
            return False
        waiting = self.arrived
        others = sum(1 for m in inter.mediators if not m.done and m not in waiting)
        return len(waiting) + others >= self.n

    def short_error(self, med: "Mediator", wait: BarrierWait) -> NNsightError:
        others = [m for m in med.interleaver.mediators if m is not med and not m.done
                  and isinstance(m.pending, NameWait) and m not in self.arrived]
        if others:  # the bodies that could come are waiting themselves: a deadlock
            fix = []
            if any(isinstance(m.pending, BarrierWait) for m in others):
                fix.append("call the barriers in the same order in every invoke")
            if any(not isinstance(m.pending, BarrierWait) for m in others):
                fix.append("a name another invoke reads before its barrier call must be bound "
                           "before this invoke's barrier call, not after it")
            return MissedModuleError(
                f"{med.label()} waited at tracer.barrier({self.n}) at {wait.where}, but only "
                f"{len(self.arrived)} invoke body(ies) reached it in this round, and the "
                f"others are blocked: {'; '.join(_waiting_on(m) for m in others)}. The invokes "
                f"wait on each other: {' and '.join(fix)}.")
        return MissedModuleError(
            f"{med.label()} waited at tracer.barrier({self.n}) at {wait.where}, but only "
            f"{len(self.arrived)} invoke body(ies) reached it in this round and no other can any "
            "more (the rest have ended, or the forward is over). Pass tracer.barrier(n) the "
            "number of invokes that call it, and call it the same number of times in each.")


def _waiting_on(med: "Mediator") -> str:
    """What ``med``, suspended at a name or a barrier, waits for, and where (for messages)."""
    g = med.greenlet
    where = user_location(g.gr_frame) if g is not None and g.gr_frame is not None else "<unknown>"
    req = med.pending
    if isinstance(req, BarrierWait):
        return f"{med.label()} waits at another tracer.barrier({req.barrier.n}) at {req.where}"
    return f"{med.label()} waits at {where} for the name {req.name!r}, which no invoke has bound"


def wait_for_name(scope, name: str):
    """Called when a body reads a name nobody has bound yet.

    If an earlier invoke of the same trace is still running, it may bind the name later in
    this forward (``invoke 1`` using what ``invoke 0`` reads at the same module): wait for it.
    Otherwise raise ``KeyError`` (Python turns that into the usual NameError).
    """
    med = getattr(_getcurrent(), "mediator", None)
    if med is None or med.scope is not scope or not med.interleaver.earlier_alive(med):
        raise KeyError(name)
    before = med.interleaver.position is None
    med.parent.switch(NameWait(name))
    if before:  # (for the error a read of a module that ran meanwhile gets: _late_error)
        med.waited = (name, user_location())
    return scope[name]


def current_mediator(envoy=None, what: str = "output", action: str = "read") -> "Mediator":
    """The Mediator of the body running now; raise OutsideTraceError where there is none.

    ``what`` names the value or operation (``output``, ``skip()``; with no ``envoy``, the whole
    name: ``tracer.next()``); ``action`` is what the body did with it (read, set, called)."""
    med = getattr(_getcurrent(), "mediator", None)
    if med is None:
        raise _no_body_error(envoy, what, action)
    return med


def in_backward_block() -> bool:
    """Whether the code running now is the body of a ``with loss.backward():`` block."""
    return getattr(_getcurrent(), "grads", None) is not None


def backward_block_error(what: str, instead: str | None = None) -> OutsideTraceError:
    """The error for ``what`` (an operation on the model's forward: ``tracer.next()``,
    ``model[0].skip()``) used inside a ``with loss.backward():`` block."""
    instead = instead or (f"use {what} in the trace body, before the `with loss.backward():` "
                          "line")
    return OutsideTraceError(
        f"{what} cannot be used inside a `with loss.backward():` block (at {user_location()}): "
        "the forward is over when backprop runs, and a backward block only reads and sets "
        f"gradients (.grad). Instead, {instead}."
    )


def _no_body_error(envoy, what: str, action: str) -> OutsideTraceError:
    """Why ``what`` cannot be used here, where no invoke body is running (the failure path of
    current_mediator)."""
    name = f"{envoy._path}.{what}" if envoy is not None else what
    where = user_location()
    if getattr(_collecting, "depth", 0):
        return OutsideTraceError(
            f"{name} was {action} at {where}, in the body of a trace that was given no inputs. "
            "Such a body only sets up invokes: use module values inside a `with "
            "tracer.invoke(...):` block, or pass the inputs to model.trace(...)."
        )
    if in_backward_block():
        if action == "set":
            return backward_block_error(name, f"set {name} in the trace body, before the "
                                        "`with loss.backward():` line")
        if action != "read":
            return backward_block_error(name)
        return OutsideTraceError(
            f"{name} was read inside a `with loss.backward():` block (at {where}). The forward "
            "is over when backprop runs, so only gradients are readable there: bind "
            f"`h = {name}` before the backward block and read `h.grad` inside it."
        )
    if action == "read":
        return OutsideTraceError(
            f"{name} was read outside a trace body (at {where}). Module values exist only while "
            "the model runs: read them inside `with model.trace(...):` (or a `with "
            "tracer.invoke(...):` block) and call .save() on what you want to keep."
        )
    if action == "set":
        return OutsideTraceError(
            f"{name} was set outside a trace body (at {where}). Module values exist only while "
            "the model runs: set them inside `with model.trace(...):` (or a `with "
            "tracer.invoke(...):` block), or in `with model.edit(...):` for an edit that every "
            "trace applies."
        )
    return OutsideTraceError(
        f"{name} was {action} outside a trace body (at {where}); it acts on the model while it "
        "runs: call it inside `with model.trace(...):` (or a `with tracer.invoke(...):` block)."
    )


def _never_ran(path: str, envoy, kind: str) -> str:
    """Why ``path`` (a module or an operation) has no call in this forward, and where to look."""
    from .source import OpEnvoy

    if isinstance(envoy, OpEnvoy):
        parent = envoy._parent
        comp = parent._compiled()
        line = comp.spans[comp.index[envoy._name]][0]
        return (
            f"{path} never ran in this forward: the line it is on ({comp.filename}:{line}) "
            "did not run (a branch the forward did not take, or code after a return). "
            f"print({parent._path}) shows each operation beside its line: pick one on a line "
            "that runs"
        )
    module = envoy._module if envoy is not None else None
    if module is not None and type(module).forward is torch.nn.Module.forward:
        kids = list(module._modules)
        child = (f"{path}[{kids[0]!r}]" if isinstance(module, torch.nn.ModuleDict) else
                 f"{path}[-1]" if isinstance(module, torch.nn.ModuleList) else
                 f"{path}.{kids[0]}") if kids else None
        return (
            f"{path} is a {type(module).__name__}, a container that is never called itself "
            f"(it has no forward), so it has no .{kind} of its own. Read one of the modules it "
            "holds instead" + (f", e.g. {child}.{kind}" if child else "")
        )
    return (
        f"{path} never ran in this forward: the model's forward does not call it (it may be "
        "defined but unused, or called on another path). Check print(model) for the module "
        "that computes the value you want"
    )


class Mediator:
    """Runtime state of one invoke: its body greenlet, its batch rows and what it waits for."""

    __slots__ = ("interleaver", "index", "batch", "scope", "run_fn", "greenlet", "parent", "done",
                 "pending", "pending_envoy", "cur_key", "cur_value", "replaced", "skip_value",
                 "tls", "iteration", "iter_depth", "shared", "snapshot", "assigned",
                 "loop_ended", "waited")

    inline = False  # True: the body runs in the user's own greenlet (nosource.py), never unwound

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
        self.shared = None  # the trace's scope, where this invoke publishes what it binds
        self.snapshot = None  # the trace body's names as of this invoke
        self.assigned = ()  # the names this invoke's body may bind (what publish copies)
        self.loop_ended = None  # the slot an open step loop waited on when the forward ended it
        # (name, line): this body's last request was a wait for a name another invoke binds,
        # begun before the forward ran (every module that has run, ran while it waited)
        self.waited = None

    def label(self) -> str:
        """How messages name this body: ``invoke 2`` (counting the trace's own invokes from 0),
        or the model's persistent edit it runs (edits come first, see tracing._add_edits)."""
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
            if isinstance(exc, Exception) and len(self.interleaver.mediators) > 1:
                _note(exc, self._raised_in())
            raise
        if self.shared is not None:
            self.publish()
        now = tls_state()
        self.tls = now
        if now != parent_state:
            set_tls_state(parent_state, now)
            if (now ^ parent_state) & INFERENCE_BIT:
                return self.resume(None, InferenceModeSwitchError(
                    f"{self.label()} waited for a module value inside its own "
                    "torch.inference_mode() block; the model's forward cannot switch inference "
                    "mode for it. Put the whole trace inside `with torch.inference_mode():` "
                    "instead, or use torch.no_grad() in the body."
                ))
        return req

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
        total = self.interleaver.total
        before = None
        if b is None:
            view = full
        else:
            view = batching.narrow(full, b[0], b[1], total)
            if isinstance(view, _CONTAINERS):  # a narrowed copy of a dict or list
                before = batching.entries(view)
        self.cur_key = key
        self.cur_value = view
        self.replaced = False
        try:
            req = self.resume(view, None, parent_state)
        finally:
            self.cur_key = None
        if self.replaced:
            new = self.cur_value
            full = new if b is None else batching.merge(full, new, b[0], b[1], total)
        elif before is not None:  # members the body set on its copy go back into its rows
            full = batching.merge_replaced(full, view, before, b[0], b[1], total)
        self.cur_value = None
        inter = self.interleaver
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
                                 or value.shape != old.shape):
            record_reshape(self, envoy, kind, old, value)  # noted on an error it may lead to
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

    def _after_skip_error(self, envoy) -> OutOfOrderError:
        """The error for reading or setting a module's input after ``.skip()`` at that call."""
        path = envoy._path
        call = self.iteration
        return OutOfOrderError(
            f"{self.label()} used {path}.input (or .inputs) at {user_location()}" + (
                f" (call {call})" if call else "") + f" after {path}.skip(...) for the same "
            f"call: a skipped module does not run, so its input is no longer used (and it may "
            f"be the very tensor given to skip). Read or edit {path}.input before calling "
            ".skip()."
        )

    def _late_error(self, envoy, key):
        slot, kind, call = key
        where = user_location()
        what = f"{envoy._path}.{kind}" + (f" (call {call})" if call else "")
        if self.interleaver.finished:
            ended = self.loop_ended
            if ended is not None:
                return MissedModuleError(
                    f"{self.label()} asked for {what} at {where}, after the model's forward "
                    f"had finished: the open step loop before it (tracer.iter[k:] or "
                    f"tracer.all()) waited for one more call of {ended.label()}, and such a "
                    "loop ends only when the forward does. Read it inside the loop, at the "
                    "step it runs in, or give the loop its number of steps "
                    "(tracer.iter[k:n])."
                )
            return MissedModuleError(
                f"{self.label()} asked for {what} at {where}, after the model's forward "
                "had already finished. Read module values while the model runs, before the end "
                "of the body's last model access."
            )
        pos = self.interleaver.position
        now = f" (the forward is now at {pos[0].label()}.{pos[1]}" + (
            f", call {pos[2]})" if pos[2] else ")") if pos else ""
        if self.waited is not None:
            name, line = self.waited
            return OutOfOrderError(
                f"{self.label()} asked for {what} at {where}, but {envoy._path} had already "
                f"run that call{now}: before it, the body waited at {line} for `{name}`, "
                "which an earlier invoke bound only after that, so the model ran on while it "
                f"waited. An invoke cannot use at {envoy._path} a value another invoke makes "
                "later in the same forward (as when it reads later modules): compute "
                f"`{name}` in a trace of its own first, then use it in a second trace "
                "(`with model.session():` holds both), or bind it in the earlier invoke "
                f"before {envoy._path} runs."
            )
        if pos and pos[0] is slot and pos[2] > call:  # the same module, at a later call
            return OutOfOrderError(
                f"{self.label()} asked for {envoy._path}.{kind} (call {call}) at {where}, but "
                f"{envoy._path} has already run that call (the forward is now at its call "
                f"{pos[2]}). A body reads a module's calls in the order the model makes them: "
                f"read call {call} before a later one" + (
                    " (after a tracer.iter loop, reads are at call 0 again: read it inside the "
                    "loop, at its step)" if not call else "") +
                ", or address the call you want with .next() or tracer.iter[k]."
            )
        return OutOfOrderError(
            f"{self.label()} asked for {what} at {where}, but {envoy._path} has already "
            f"run that call{now}. A body must read module values in the order the model "
            "computes them: move this line above the access to the later module, or read it "
            "in a separate trace."
        )

    def missed_error(self):
        if isinstance(self.pending, BarrierWait):
            return self.pending.barrier.short_error(self, self.pending)
        if isinstance(self.pending, NameWait):
            return NameError(f"name {self.pending.name!r} is not defined")
        slot, kind, call = self.pending
        envoy = self.pending_envoy
        path = envoy._path if envoy is not None else slot.label()
        where = "<unknown>"
        if self.greenlet is not None and self.greenlet.gr_frame is not None:
            where = user_location(self.greenlet.gr_frame)
        what = f"{path}.{kind}" + (f" (call {call})" if call else "")
        if self.interleaver.stopped_early:
            reason = (f"tracer.stop() at {self.interleaver.stopped_early} ended the forward "
                      "before it ran. Read it before the stop, or stop after the last read "
                      "of every invoke")
        elif slot.calls == 0 and (above := _skipped_above(slot, self.interleaver.skipped)):
            reason = (
                f"{path} is inside {above.label()}, which a body skipped with .skip() in this "
                "forward, so it never ran. Read it in a trace that does not skip "
                f"{above.label()}"
            )
        elif slot.calls == 0:
            reason = _never_ran(path, envoy, kind)
        elif call and not self.iter_depth:
            reason = (
                f"{path} ran only {slot.calls} time(s) in this forward, so call {call} never "
                "happened. After .next() (or tracer.next()) every later read of the body is at "
                "the next call: read this before the .next(), or step back with "
                "tracer.next(-1)"
            )
        else:
            reason = (
                f"{path} ran only {slot.calls} time(s) in this forward, so call {call} never "
                "happened (check tracer.iter indices)"
            )
        return MissedModuleError(f"{self.label()} waited for {what} at {where}, but {reason}.")
