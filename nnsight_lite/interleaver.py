"""The runtime: bodies as greenlets, fed real values by the model's own forward.

    Interleaver    one per trace: counts module calls, hands values to waiting bodies
    (Slot and the wrappers that count calls are in calls.py; putting them on the model and
    taking them off, in install.py; Mediator, the per-invoke side, in mediator.py; worker
    greenlets in workers.py)

How a value reaches a body: the body asks for ``(slot, kind, call)`` and switches to the parent
greenlet, which runs the model. Every module of the traced model has its ``forward`` replaced
for the duration of the trace by a thin counting wrapper (an instance attribute, removed in
``finally``); it costs one Python call per module call and is what makes call indices exact,
so a module that already ran is always recognised. When a wrapper reaches a call somebody is
waiting for, it switches into each waiting body in invoke order, with that body's rows; the
body reads or edits the value, then switches back with its next request. Calls that nobody
waits for pass straight through.

Thread-local torch state (grad mode, autocast) is not carried by greenlets: every switch saves
the body's state and restores the parent's, so a body waiting inside ``torch.no_grad()`` does
not run the rest of the model without grad.
"""

from __future__ import annotations

import threading
import weakref
from bisect import insort

import torch

from . import batching, checkpointing
from .capture import IterationEnd
from .compiled import eager
from .calls import Slot
from .checkpointing import _top_hooks
from .errors import OutsideTraceError
from .hooked import ModuleCall, run_for_body
from .install import _HELD_MAX, put_on, take_off
from .source_run import keep_instrumented
from .mediator import _DONE, _MISSING, INPUT, OUTPUT, Mediator
from .messages import moved_message, other_model_message
from .tracebacks import note_reshaped
from .waits import BarrierWait, NameWait, StopTrace
from .workers import (
    _getcurrent,
    _note,
    attached,
    set_tls_state,
    tls_state,
    unwind,
)



class Interleaver:
    """Runs one forward with its invoke bodies interleaved. One instance per trace."""

    #: the bodies of the model's persistent edits, run by its first mediators (for messages)
    edits: tuple = ()
    #: replacements that changed a value's shape, noted on an error the forward raises after
    reshaped: "tuple | list" = ()
    #: a body's replacement of a value that required grad with one that does not (for messages)
    grad_cut: str = ""
    #: the values still being served while a body's ``envoy(x, hook=True)`` runs (hooked.py)
    calling: tuple = ()
    #: the first error a body raised into the forward (an ``except`` in the model may catch it)
    raised = None
    #: how many steps an open ``tracer.iter[k:]`` / ``tracer.all()`` loop has at most (generate:
    #: max_new_tokens), or None where the model's calls alone end it
    steps: "int | None" = None
    #: what runs the model without gradients, for errors about a loss that has none (generate)
    no_grad_by: "str | None" = None
    #: whether the model holds modules torch.compile wrapped (their code runs eagerly: install)
    compiled = False
    #: grad mode when the forward began (1/0): edits in checkpointed regions matter only then
    grad_on = 0
    #: slot -> how a reentrant checkpoint wraps its calls (None: not), found once per trace
    no_grad_regions: "dict | None" = None
    #: factors by which values' rows may be the batch's expanded (a generate's beams or returned
    #: sequences: each row becomes that many adjacent ones); invokes get their rows' share
    row_factors: tuple = ()

    def __init__(self, root: torch.nn.Module, total: int = 1, home: "dict | None" = None):
        self.root = root
        # where the model's _Plan is kept between traces: the wrapper's __dict__. Keeping it on
        # the wrapper (not in a table keyed by the module) lets the module go with the wrapper.
        self.home = home
        self.total = total
        self.mediators: list[Mediator] = []
        self.slots: dict[int, Slot] = {}
        self.runner = None
        self.thread = threading.get_ident()
        self.position = None
        self.serving = None
        self.name_waiters: list[Mediator] = []
        self.finished = False
        self.stopped_early = None  # where tracer.stop() ended the forward ("file:line")
        self.skipped = ()  # the slots a body's .skip() kept from running (for messages)
        self.sources = None  # source_run.SourceRun: forwards running instrumented in this trace
        self._bulk = None  # the plan's _Bulk when this trace swapped forwards all at once
        self.held = []  # (Envoy __dict__, child name, child Envoy) put there for this trace
        self.waited: list[Slot] = []  # the slots wait_table gave wait tables in this trace

    def add(self, run, batch=None, scope=None) -> Mediator:
        med = Mediator(self, len(self.mediators), run, batch, scope)
        self.mediators.append(med)
        return med

    def hold(self, parent, name: str, env) -> None:
        """Keep child Envoy ``env`` as attribute ``name`` of Envoy ``parent`` until this trace
        ends, so the body's next reads of it skip ``__getattr__`` (Envoy.__getattr__ checked
        it against the module just now). Only Envoys of the traced model's modules: the model
        stays as the trace found it. The plan remembers the pair (weakly), and the model's
        next trace holds it from the start when the module tree is still the same."""
        held = self.held
        d = parent.__dict__
        if held is None or name in d or id(d["_module"]) not in self.slots:
            return  # (None: the trace is over)
        d[name] = env
        held.append((d, name, env))
        plan = self._plan
        if len(plan.held) < _HELD_MAX:
            plan.held.append((weakref.ref(parent), name, weakref.ref(env)))

    def slot_of(self, envoy) -> Slot:
        slot = self.slots.get(id(envoy._module))
        if slot is None:
            find = getattr(type(envoy), "_slot_in", None)  # an operation (source.py)
            if find is not None:
                return find(envoy, self)
            raise OutsideTraceError(moved_message(self, envoy) or other_model_message(envoy))
        return slot

    # ---- running

    def run(self, forward):
        """Install wrappers, start the bodies, run ``forward()``, finish the bodies; clean up."""
        saved = tls_state()
        self.grad_on = saved & 1 if self.no_grad_by is None else 0
        self.runner = _getcurrent()
        try:
            self._install()
            if self._plan.sourced:  # forwards an earlier trace's bodies asked .source of
                keep_instrumented(self)
            try:
                for med in self.mediators:
                    try:
                        med.start(saved)  # (each start puts the state back as it found it)
                    except StopTrace as exc:  # a stop before the forward: it does not run,
                        if not self._stops(exc):
                            raise  # (an enclosing trace's tracer.stop(): it ends that one)
                        if self.stopped_early is None:  # and the later bodies still start:
                            self.stopped_early = exc.where  # their reads get MissedModuleError
                if self.stopped_early is not None:
                    output = None
                elif self.compiled:
                    output = eager(forward)
                else:
                    output = forward()
                if self.raised is not None:  # a body's error that the model's code caught
                    _note(self.raised, "nnsight_lite: the model's own code caught this error "
                          "(an `except` around the module call that served the body) and went "
                          "on; it is raised here, where the forward ended")
                    raise self.raised
            except StopTrace as exc:
                if not self._stops(exc):
                    raise  # an enclosing trace's tracer.stop(), called in a body of this one
                self.stopped_early = exc.where
                output = None
            except Exception as exc:
                if self.reshaped:
                    note_reshaped(exc, self.reshaped)
                raise
            self.finished = True
            self._finish()  # (after a stop too: a body still waiting is told why)
            return output
        finally:
            self.finished = True
            # Ctrl-C part way must not leave wrappers or bodies. (In line, not a helper's call:
            # Python delivers an interrupt at a function's entry, before the helper's `try`.)
            try:
                self._end()
            except BaseException:  # (an interrupt part way: finish, then let it through)
                self._end()
                raise
            now = tls_state()
            if now != saved:
                set_tls_state(saved, now)

    def _stops(self, exc: StopTrace) -> bool:
        """Whether ``exc``, a ``tracer.stop()``, ends this trace's forward."""
        return exc.tracer is None or exc.tracer._inter is self

    def _finish(self) -> None:
        """The forward is over: every body still waiting gets an error (or ends its iter loop)."""
        for med in self.mediators:
            while not med.done and med.pending is not None:
                if med.pending.__class__ is ModuleCall:  # tracer.stop() ended the forward
                    break  # inside the call this body made (hook=True): _end unwinds it, as
                    # nnsight drops such a body, silently (its later reads are cut too)
                if isinstance(med.pending, NameWait):
                    self.name_waiters.remove(med)
                    self.register(med, med.resume(None, med.missed_error()))
                    continue
                slot, kind, call = med.pending
                if med.iter_depth and call > 0 and slot.calls > 0:
                    exc = IterationEnd()
                    med.loop_ended = (slot, call, med.loop_bounded)
                    med.iter_cut = (slot, call)
                else:
                    exc = med.missed_error()
                try:
                    self.register(med, med.resume(None, exc))
                finally:
                    exc = None

    def end_iterations(self) -> None:
        """End the open ``tracer.iter``/``tracer.all()`` loops of waiting bodies now.

        For wrappers whose forward goes on after the model's last module call (generate serves
        ``model.generator.output`` last): code after such a loop can then still read it.
        """
        for med in self.mediators:
            while not med.done and type(med.pending) is tuple:
                slot, kind, call = med.pending
                if not (med.iter_depth and call > 0 and slot.calls > 0):
                    break
                table = slot.wait_out if kind is OUTPUT else slot.wait_in
                table[call].remove(med)
                if not table[call]:
                    del table[call]
                med.iter_cut = (slot, call)
                self.register(med, med.resume(None, IterationEnd()))

    def _end(self) -> None:
        """Remove the wrappers, then unwind the bodies still suspended (each step idempotent:
        ``run`` runs it again when an interrupt stops it part way)."""
        self._uninstall()
        self._kill_all()
        self.raised = None  # (its traceback holds the bodies' frames)

    def _kill_all(self) -> None:
        """Unwind every body still suspended (its ``finally`` blocks run) and free its worker."""
        for med in self.mediators:
            if not med.inline and attached(med.greenlet, med):
                unwind(med.greenlet)
            med.done = True
            med.scope = med.shared = med.snapshot = med.run_fn = med.greenlet = None
        # Mediators point back here: without this the trace's objects (its bodies' scopes and
        # the activations they hold) would form a cycle, freed only when the garbage collector
        # next runs, which for GPU memory can be far too late.
        self.mediators = []
        self.position = self.serving = None

    def register(self, med: Mediator, req) -> None:
        if req is _DONE or med.done:
            med.done = True
            med.pending = None
            return
        med.pending = req
        if req.__class__ is not tuple:  # a NameWait or BarrierWait (a module value is a key)
            if req.__class__ is ModuleCall:  # or envoy(x, hook=True): make the call (hooked.py)
                return self.register(med, run_for_body(self, med, req))
            self.name_waiters.append(med)
            return
        slot, kind, call = req
        table = self.wait_table(slot, kind)
        waiting = table.get(call)
        if waiting is None:
            table[call] = [med]
        elif waiting[-1].index < med.index:  # the usual case: invokes ask in their order
            waiting.append(med)
        else:
            insort(waiting, med, key=_med_index)

    def wait_table(self, slot: Slot, kind) -> dict:
        """``slot``'s table of bodies waiting for its input or output (``kind``), made here on
        first use in this trace; take_off sets the tables made back to None."""
        table = slot.wait_out if kind is OUTPUT else slot.wait_in
        if table is None:
            table = {}
            if kind is OUTPUT:
                slot.wait_out = table
            else:
                slot.wait_in = table
            self.waited.append(slot)
        return table

    def earlier_alive(self, med: Mediator) -> bool:
        """Whether an invoke before ``med`` may still run (and bind names ``med`` waits for)."""
        if self.finished:
            return False
        return any(not m.done for m in self.mediators[: med.index])

    def wake(self) -> None:
        """Resume bodies waiting for a name that is now bound (or that can no longer be)."""
        while self.name_waiters:
            for med in self.name_waiters:
                req = med.pending
                if req.__class__ is BarrierWait:  # (tracer.barrier: its round is full, or
                    if req.barrier.round > req.round:  # can no longer be)
                        exc = None
                        break
                    if not req.barrier.fillable(self):
                        exc = med.missed_error()
                        break
                    continue
                if med.scope.knows(req.name):
                    exc = None
                    break
                if not self.earlier_alive(med):  # (a name around the trace: that value)
                    exc = None if req.around else med.missed_error()
                    break
            else:
                return
            self.name_waiters.remove(med)
            try:
                self.register(med, med.resume(None, exc))
            finally:
                exc = None

    # ---- wrappers (install.py puts them on and takes them off; calls.py's run at each call)

    _install = put_on
    _uninstall = take_off

    def _serve_output(self, slot: Slot, call: int, out):
        key = (slot, OUTPUT, call)
        self.position = self.serving = key
        waiting = slot.wait_out
        # the forward's grad/autocast state (every resume puts it back), for the bodies served
        # here; none when only caches wait (they sort last and switch to no body)
        state = tls_state() if waiting[call][0].switches else None
        # inside activation checkpointing a body's edit is lost to the backward: warn (rare)
        watch = (state is not None and self.grad_on
                 and (not state & 1 or _top_hooks(False) is not None)
                 and checkpointing.region(self, slot, state))
        if watch:
            served, before = list(waiting[call]), checkpointing.versions(out)
        try:
            while call in waiting:  # bodies woken while serving may ask for this same value
                for med in waiting.pop(call):
                    out = med.serve(key, out, state)
        finally:
            self.serving = None
        if watch and checkpointing.versions(out) != before:
            checkpointing.warn_edited(served, slot, "output", watch)
        return out

    def _serve_input(self, slot: Slot, call: int, args, kwargs):
        """Serve the input stage, run the module (unless a body skipped it), return its output."""
        key = (slot, INPUT, call)
        self.position = self.serving = key
        value = (args, kwargs)
        whole = _MISSING
        partial = []
        waiting = slot.wait_in
        state = tls_state() if waiting[call][0].switches else None  # (as in _serve_output)
        watch = (state is not None and self.grad_on
                 and (not state & 1 or _top_hooks(False) is not None)
                 and checkpointing.region(self, slot, state))
        if watch:
            served, before = list(waiting[call]), checkpointing.versions(value)
        try:
            while call in waiting:
                for med in waiting.pop(call):
                    value = med.serve(key, value, state)
                    if med.skip_value is not _MISSING:
                        if med.batch is None:
                            whole = med.skip_value
                        else:
                            partial.append((med.batch, med.skip_value))
                        med.skip_value = _MISSING
        finally:
            self.serving = None
        if watch and (whole is not _MISSING or partial or checkpointing.versions(value) != before):
            checkpointing.warn_edited(served, slot, "input", watch)
        args, kwargs = value
        if whole is _MISSING:
            out = slot.orig(*args, **kwargs)
        else:
            out = whole
            self.skipped = (*self.skipped, slot)
        for (start, size), part in partial:
            out = batching.merge(out, part, start, size, self.total, self.row_factors)
        return args, kwargs, out


def _med_index(med: Mediator) -> int:
    return med.index
