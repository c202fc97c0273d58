"""The runtime: bodies as greenlets, fed real values by the model's own forward.

    Interleaver    one per trace: counts module calls, hands values to waiting bodies
    Slot           per-trace state of one module: call counters, who waits on it
    _Plan          per model wrapper: its slots and wrappers, reused by the next trace
    (Mediator, the per-invoke side, is in mediator.py; worker greenlets in workers.py)

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

import re
import threading
import weakref
from bisect import insort
from collections import deque
from itertools import compress, count, repeat
from operator import eq, is_

import torch
from torch.nn.modules import module as _torch_module

from . import batching
from .capture import IterationEnd
from .errors import NNsightError, OutsideTraceError
from .hooked import ModuleCall, run_for_body
from .mediator import (
    _DONE,
    _MISSING,
    INPUT,
    OUTPUT,
    BarrierWait,
    Mediator,
    NameWait,
    StopTrace,
)
from .tracebacks import note_reshaped
from .workers import (
    _getcurrent,
    attached,
    set_tls_state,
    tls_state,
    unwind,
    user_location,
)

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")
_UNSWAPPED = object()  # Slot.prev_forward while the wrapper is not installed
_ENTRY = "_compiled_call_impl"  # where a module's call entry goes (see _entry)
#: whether this torch's ``Module.__call__`` consults an instance ``_compiled_call_impl``
_HAS_ENTRY = getattr(torch.nn.Module, _ENTRY, _MISSING) is None and \
    getattr(torch.nn.Module, "_wrapped_call_impl", None) is torch.nn.Module.__call__
_CALL_IMPL = torch.nn.Module._call_impl
_HOOKS = frozenset(("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                    "_backward_pre_hooks"))
# torch's global module hooks (never rebound, only filled): while any is set, calls take
# torch's own path, hooks and all (see _entry)
_GFH, _GFPH, _GBH, _GBPH = (getattr(_torch_module, f"_global_{n}", {}) for n in (
    "forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks"))


class Slot:
    """Per-trace state of one module: its call counters and the bodies waiting on it.

    The counters are reset lazily: a slot whose ``gen`` is not the running trace's serial
    (``live.serial``) has not been called in this trace yet, so ``calls``/``outs`` read 0. A trace
    then costs nothing per module that it does not reach.
    """

    __slots__ = ("module", "parent", "attr", "n_in", "n_out", "gen", "live", "wait_in",
                 "wait_out", "prev_forward", "orig", "entered")

    def __init__(self, module, parent, attr, live):
        self.module = module
        self.orig = None  # the forward the wrapper calls (set at every install)
        self.prev_forward = _UNSWAPPED  # the instance ``forward`` entry the wrapper replaced
        self.entered = None  # the module's call entry (_entry) while it is installed
        self.parent = parent  # the Slot of the module that holds this one (None at the root)
        self.attr = attr  # this module's name in its parent
        self.live = live  # the plan's _Live: which trace runs now, and its serial
        self.gen = -1  # the serial of the trace the counters below count for
        self.n_in = 0  # calls whose input stage has begun
        self.n_out = 0  # calls that have produced their output
        self.wait_in = {}
        self.wait_out = {}

    @property
    def calls(self) -> int:
        """Calls of this module in the running trace whose input stage has begun."""
        return self.n_in if self.gen == self.live.serial else 0

    @property
    def outs(self) -> int:
        """Calls of this module in the running trace that have produced their output."""
        return self.n_out if self.gen == self.live.serial else 0

    @property
    def name(self) -> str:
        """The ``named_modules()`` path ("" for the root)."""
        if self.parent is None:
            return ""
        up = self.parent.name
        return f"{up}.{self.attr}" if up else self.attr

    @property
    def __wrapped__(self):
        """The wrapped forward, so ``inspect.signature(module.forward)`` during a trace sees the
        real parameters (HF ``generate`` inspects them) through ``wrapper.__wrapped__ = slot``."""
        return self.orig

    def label(self) -> str:
        """The module path as users write it: ``model.layers[1].mlp``."""
        path = "model" + ("." + self.name if self.parent is not None else "")
        return _INDEX.sub(r"[\1]", path)


# --------------------------------------------------------------------------- the interleaver


class Interleaver:
    """Runs one forward with its invoke bodies interleaved. One instance per trace."""

    #: the bodies of the model's persistent edits, run by its first mediators (for messages)
    edits: tuple = ()
    #: replacements that changed a value's shape, noted on an error the forward raises after
    reshaped: "tuple | list" = ()
    #: the values still being served while a body's ``envoy(x, hook=True)`` runs (hooked.py)
    calling: tuple = ()
    #: how many steps an open ``tracer.iter[k:]`` / ``tracer.all()`` loop has at most (generate:
    #: max_new_tokens), or None where the model's calls alone end it
    steps: "int | None" = None

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
        self.sources = None  # source.SourceRun: forwards running instrumented in this trace
        self._bulk = None  # the plan's _Bulk when this trace swapped forwards all at once
        self.held = []  # (Envoy __dict__, child name, child Envoy) put there for this trace

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

    def _hold_again(self, plan: "_Plan") -> None:
        """Hold the child Envoys the model's last traces held (its module tree is the same)."""
        held = self.held
        for parent, name, env in plan.held:
            parent, env = parent(), env()
            if parent is not None and env is not None:
                d = parent.__dict__
                if name not in d:
                    d[name] = env
                    held.append((d, name, env))

    def slot_of(self, envoy) -> Slot:
        slot = self.slots.get(id(envoy._module))
        if slot is None:
            find = getattr(type(envoy), "_slot_in", None)  # an operation (source.py)
            if find is not None:
                return find(envoy, self)
            moved = self._moved(envoy)
            if moved is not None:
                raise OutsideTraceError(moved)
            raise OutsideTraceError(
                f"{envoy._path} is not part of the model being traced here (at "
                f"{user_location()}); each model's values can only be read inside its own "
                "trace. Open a trace on that model (they can be nested)."
            )
        return slot

    def _moved(self, envoy) -> "str | None":
        """Why an Envoy of this trace's own model has no slot, when its module was replaced
        or removed (None for an Envoy of another model)."""
        d = envoy.__dict__
        if self.home is None or d.get("_tree") is not self.home.get("_tree"):
            return None
        path, module = d["_path"], d["_module"]
        try:
            now = self.root.get_submodule(d["_mpath"])
        except AttributeError:
            now = None
        where = user_location()
        if now is module:
            return (
                f"{path} ({type(module).__name__}) was put into the model after this trace "
                f"began, so the trace does not follow it (read at {where}). A trace follows the "
                "modules its model holds when it starts: replace modules before the trace, and "
                "read the new one in the next trace."
            )
        if now is not None:
            return (
                f"{path}, read at {where}, stands for the {type(module).__name__} that was at "
                f"that place before it was replaced (the model holds "
                f"{'another' if type(now) is type(module) else 'a'} {type(now).__name__} "
                f"there now). An Envoy kept from before the replacement keeps the old module: "
                f"read it through the model again ({path}) to reach the one there now."
            )
        return (
            f"{path} ({type(module).__name__}), read at {where}, is no longer part of the "
            "model: it was removed (or moved) after this Envoy was taken. Read the modules "
            "the model holds now, print(model) shows them."
        )

    # ---- running

    def run(self, forward):
        """Install wrappers, start the bodies, run ``forward()``, finish the bodies; clean up."""
        saved = tls_state()
        self.runner = _getcurrent()
        try:
            self._install()
            try:
                for med in self.mediators:
                    med.start(saved)  # (each start puts the state back as it found it)
                output = forward()
            except StopTrace as exc:
                if exc.tracer is not None and exc.tracer._inter is not self:
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

    def _finish(self) -> None:
        """The forward is over: every body still waiting gets an error (or ends its iter loop)."""
        for med in self.mediators:
            while not med.done and med.pending is not None:
                if isinstance(med.pending, NameWait):
                    self.name_waiters.remove(med)
                    self.register(med, med.resume(None, med.missed_error()))
                    continue
                slot, kind, call = med.pending
                if med.iter_depth and call > 0 and slot.calls > 0:
                    exc = IterationEnd()
                    med.loop_ended = slot
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
                self.register(med, med.resume(None, IterationEnd()))

    def _end(self) -> None:
        """Remove the wrappers, then unwind the bodies still suspended (each step idempotent:
        ``run`` runs it again when an interrupt stops it part way)."""
        self._uninstall()
        self._kill_all()

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
        table = slot.wait_out if kind is OUTPUT else slot.wait_in
        waiting = table.get(call)
        if waiting is None:
            table[call] = [med]
        elif waiting[-1].index < med.index:  # the usual case: invokes ask in their order
            waiting.append(med)
        else:
            insort(waiting, med, key=_med_index)

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
                if not self.earlier_alive(med):
                    exc = med.missed_error()
                    break
            else:
                return
            self.name_waiters.remove(med)
            try:
                self.register(med, med.resume(None, exc))
            finally:
                exc = None

    # ---- wrappers

    def _install(self) -> None:
        """Wrap ``forward`` of every module of the model (each module once, pre-order).

        Slots and their wrappers are kept per model between traces (``_Plan``) and reused
        when the same module sits at the same place: a trace then takes a new serial (which
        zeroes every counter at once, see Slot) and swaps ``forward`` entries. When every
        module still has exactly the children (names and objects) it had, the last walk is
        reused; any change to the tree (a child replaced, added, removed or renamed) makes a
        new walk, so it is always seen.
        """
        key = id(self.root)
        other = _active.setdefault(key, self)  # one step: two threads cannot both get None
        if other is self:
            other = None
        elif other.thread != self.thread:
            raise NNsightError(
                f"this model ({type(self.root).__name__}) is being traced by another thread right "
                "now; traces of one model cannot overlap across threads (its modules' forward "
                "methods are swapped for the trace). Trace separate model objects per thread, "
                "or take turns with a lock."
            )
        home = self.home
        plan = home.get("_plan") if home is not None else None
        if plan is None or plan.inter is not None:  # first trace, or one nested in another
            plan = _Plan()
            if home is not None and home.get("_plan") is None:
                home["_plan"] = plan
        if plan.flat is None:
            _traced.add(self.root)
        plan.inter = self
        plan.live.serial = next(_serials)  # every slot's counters now read 0 (see Slot)
        self._plan = plan
        self.slots = plan.slots
        # (torch.jit tracing calls modules its own way: the forward wrappers alone count then)
        jit = _jit_tracing()
        entries = _HAS_ENTRY and not jit
        if plan.bulk is not None and plan.flat[0][0] is self.root and not jit:
            self._bulk = plan.bulk  # (set first: an interrupt after the swap still undoes it)
            if _bulk_install(plan.bulk):
                if plan.held:
                    self._hold_again(plan)
                return
            self._bulk = None
        flat = plan.flat
        if flat is None or flat[0][0] is not self.root or not _same_tree(flat):
            flat = self._walk(plan)
        elif plan.held:
            self._hold_again(plan)
        self.slots = plan.slots
        for module, slot, _, wrapper, entry in flat:
            d = module.__dict__
            prev = d.get("forward", _MISSING)
            if prev is not _MISSING:
                self._check_not_shared(slot, prev)
            slot.prev_forward = prev
            slot.orig = module.forward
            d["forward"] = wrapper
            if (entries and entry is not None and _ENTRY not in d
                    and type(module)._call_impl is _CALL_IMPL):
                d[_ENTRY] = slot.entered = entry
            else:
                slot.entered = None
        # the next trace can swap them all at once, unless a module has a forward (or a compiled
        # call) of its own
        own = any(s.prev_forward is not _MISSING or (entries and not s.entered)
                  for _, s, _, _, _ in flat)
        plan.bulk = None if own or jit else _Bulk.of(flat)

    def _check_not_shared(self, slot: Slot, prev) -> None:
        """Refuse a module whose ``forward`` is another thread's running trace's wrapper: a
        module shared by two models (``NNsight(net)`` and ``NNsight(net[0])``), traced in two
        threads at once. (Nested traces in one thread take their turns and may share.)"""
        owner = getattr(prev, "__wrapped__", None)
        inter = owner.live.inter if owner.__class__ is Slot else None
        if inter is not None and inter.thread != self.thread:
            raise NNsightError(
                f"{slot.label()} ({type(slot.module).__name__}) is also part of "
                f"another model ({type(inter.root).__name__}) that another thread is tracing "
                "right now; a module's forward is swapped for the trace of its model, so two "
                "models that share modules cannot be traced from two threads at once. Take "
                "turns with a lock, or give each thread its own copy of the model."
            )

    def _walk(self, plan: "_Plan") -> list:
        """Walk the module tree (pre-order, each module once): make or reuse each module's Slot
        and record the walk in ``plan`` (``plan.slots``, ``plan.flat``)."""
        old = plan.slots
        old_wrappers = plan.wrappers
        slots = {}
        wrappers = {}
        flat = []
        stack = [(self.root, None, "")]
        pop, push = stack.pop, stack.extend
        while stack:
            module, parent, attr = pop()
            key = id(module)
            if key in slots:
                continue
            slot = old.get(key)
            if slot is None or slot.module is not module:
                slot = Slot(module, parent, attr, plan.live)
                made = _wrapper(slot, plan.live), _entry(slot, plan.live)
            else:
                slot.parent = parent
                slot.attr = attr
                made = old_wrappers[key]
            slots[key] = slot
            wrappers[key] = made
            children = module._modules
            flat.append((module, slot, tuple(children.items()), *made))
            if children:
                push([(c, slot, n) for n, c in reversed(children.items()) if c is not None])
        plan.slots = slots
        plan.wrappers = wrappers
        plan.flat = flat
        plan.held = []  # (the Envoys held before may hold modules that have left the tree)
        return flat

    def _uninstall(self) -> None:
        held, self.held = self.held, None
        if held:
            for d, name, env in held:
                if d.get(name) is env:
                    del d[name]
        if self.sources is not None:  # instrumented forwards (source.py) go first
            self.sources.close()
            self.sources = None
        if self._bulk is not None:
            _bulk_uninstall(self._bulk)
            self._bulk = None
        else:
            for slot in self.slots.values():
                prev = slot.prev_forward
                if prev is not _UNSWAPPED:  # (install may have been interrupted part way)
                    d = slot.module.__dict__
                    if prev is _MISSING:
                        d.pop("forward", None)
                    else:
                        d["forward"] = prev
                    slot.prev_forward = _UNSWAPPED
                if slot.entered is not None:
                    d = slot.module.__dict__
                    if d.get(_ENTRY) is slot.entered:  # (not a compile a body made since)
                        del d[_ENTRY]
                    slot.entered = None
                slot.wait_in.clear()
                slot.wait_out.clear()
        plan = getattr(self, "_plan", None)
        if plan is not None:
            plan.inter = None
        if _active.get(id(self.root)) is self:
            del _active[id(self.root)]

    def _serve_output(self, slot: Slot, call: int, out):
        key = (slot, OUTPUT, call)
        self.position = self.serving = key
        waiting = slot.wait_out
        state = tls_state()  # the forward's; every resume puts it back
        try:
            while call in waiting:  # bodies woken while serving may ask for this same value
                for med in waiting.pop(call):
                    out = med.serve(key, out, state)
        finally:
            self.serving = None
        return out

    def _serve_input(self, slot: Slot, call: int, args, kwargs):
        """Serve the input stage, run the module (unless a body skipped it), return its output."""
        key = (slot, INPUT, call)
        self.position = self.serving = key
        value = (args, kwargs)
        whole = _MISSING
        partial = []
        waiting = slot.wait_in
        state = tls_state()
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
        args, kwargs = value
        if whole is _MISSING:
            out = slot.orig(*args, **kwargs)
        else:
            out = whole
            self.skipped = (*self.skipped, slot)
        for (start, size), part in partial:
            out = batching.merge(out, part, start, size, self.total)
        return args, kwargs, out


class _Live:
    """What the wrappers of one plan read at every call: the trace running now (or None) and
    its serial number (unique per trace; a slot counting for another serial reads 0 calls)."""

    __slots__ = ("inter", "serial")

    def __init__(self):
        self.inter = None
        self.serial = 0


class _Plan:
    """A model's slots and wrappers, reused by its next trace. ``inter`` is the running trace.

    Nothing here points back at the plan (the wrappers reach the running trace through
    ``live``), so a plan, and the modules its slots hold, go by reference counting with the
    wrapper that keeps it.
    """

    __slots__ = ("slots", "wrappers", "live", "flat", "bulk", "held", "__weakref__")

    def __init__(self):
        self.slots = {}
        self.wrappers = {}  # id(module) -> (its forward wrapper, its call entry or None)
        self.live = _Live()
        # (module, slot, its children as (name, module) pairs, wrapper, entry) in walk order,
        # from the last full walk: when every module still has exactly those children, the walk
        # is the same
        self.flat = None
        self.bulk = None  # a _Bulk of ``flat`` once a trace found no instance forward on it
        # (parent Envoy, child name, child Envoy), weakly: the children bodies read, held as
        # attributes again by the next trace when the tree is unchanged (Interleaver.hold)
        self.held = []

    @property
    def inter(self):
        return self.live.inter

    @inter.setter
    def inter(self, value):
        self.live.inter = value


class _Bulk:
    """One walk of a model as parallel lists, so a trace swaps every module's ``forward`` with a
    few C-level loops (``map``) instead of a Python loop over the modules (SmolLM2's 397
    modules: about half the time).

    Valid while the tree is the same (every module's children, names and objects, compared with
    a copy of its ``_modules`` from the walk), no module has a ``forward`` of its own in its
    ``__dict__``, each module's class is the one it had, and each of those classes' ``forward``
    is still the function the slots' ``orig`` are bound to (all checked); else the per-module
    path runs.
    """

    __slots__ = ("dicts", "wrappers", "entries", "slots", "modules", "types", "classes", "funcs",
                 "leaves", "inner", "inner_dicts", "snaps", "waits")

    def __init__(self, flat):
        self.modules = [m for m, _, _, _, _ in flat]
        self.dicts = [m.__dict__ for m in self.modules]
        self.wrappers = [w for _, _, _, w, _ in flat]
        # every module's call entry, or None where this torch has no place for them
        self.entries = [e for _, _, _, _, e in flat] if _HAS_ENTRY else None
        self.slots = [s for _, s, _, _, _ in flat]
        self.types = [type(m) for m in self.modules]
        self.classes = list(dict.fromkeys(self.types))
        self.funcs = [getattr(c, "forward", None) for c in self.classes]
        self.leaves = [m._modules for m, _, c, _, _ in flat if not c]
        self.inner = [m._modules for m, _, c, _, _ in flat if c]
        self.inner_dicts = [m.__dict__ for m, _, c, _, _ in flat if c]  # (where ``inner`` is)
        self.snaps = [dict(c) for _, _, c, _, _ in flat if c]
        self.waits = [s.wait_in for s in self.slots] + [s.wait_out for s in self.slots]

    @classmethod
    def of(cls, flat) -> "_Bulk | None":
        """A _Bulk of ``flat``, or None where a slot does not run its class's ``forward``."""
        bulk = cls(flat)
        funcs = dict(zip(bulk.classes, bulk.funcs))
        for t, s in zip(bulk.types, bulk.slots):
            if funcs[t] is None or getattr(s.orig, "__func__", None) is not funcs[t]:
                return None
        if bulk.entries is not None and None in bulk.entries:
            return None
        return bulk


_FORWARD = repeat("forward")
_MODULES = repeat("_modules")
_ENTRIES = repeat(_ENTRY)
_jit_tracing = torch._C._get_tracing_state
_drain = deque(maxlen=0).extend  # runs an iterator to its end at C speed, keeping nothing
_serials = count(1)  # trace serial numbers (_Live.serial)
_HELD_MAX = 256  # child Envoys a plan remembers for the next trace to hold (Interleaver.hold)


def _bulk_install(b: _Bulk) -> bool:
    """Swap in every wrapper of ``b`` at once; False (and nothing swapped) where ``b`` no
    longer describes the model."""
    # (each check and swap is a C-level loop that builds no list: a list of a few hundred
    # pointers is a block of glibc's, whose first allocation after a forward pays for sorting
    # everything the forward freed)
    if (any(b.leaves)  # a leaf got children
            # (a container's ``_modules`` rebound to a new dict: ``del seq[0:0]`` does that)
            or not all(map(is_, map(dict.get, b.inner_dicts, _MODULES), b.inner))
            or not all(map(eq, b.inner, b.snaps))  # a child added, removed, replaced, renamed
            or not all(map(is_, map(type, b.modules), b.types))  # (``module.__class__ = ...``)
            or list(map(getattr, b.classes, _FORWARD)) != b.funcs):  # a class's forward replaced
        return False
    dicts, wrappers, entries = b.dicts, b.wrappers, b.entries
    # one pass puts every wrapper in and says whether a module has a forward of its own now
    # (and one more the call entries: whether a module has a compiled call of its own); a
    # pass stops at the first such module, and the loop below takes out what went in
    if not all(map(is_, map(dict.setdefault, dicts, _FORWARD, wrappers), wrappers)) or (
            entries is not None
            and not all(map(is_, map(dict.setdefault, dicts, _ENTRIES, entries), entries))):
        for d, w, e in zip(dicts, wrappers, entries or repeat(None)):
            if d.get("forward") is w:
                del d["forward"]
            if e is not None and d.get(_ENTRY) is e:
                del d[_ENTRY]
        return False
    return True


def _bulk_uninstall(b: _Bulk) -> None:
    _drain(map(dict.pop, b.dicts, _FORWARD, repeat(None)))
    entries = b.entries
    if entries is not None:  # (only the modules whose entry is still ours: a module a body
        dicts = b.dicts  # compiled, module.compile(), keeps its compiled call)
        _drain(map(dict.pop, compress(dicts, map(is_, map(dict.get, dicts, _ENTRIES), entries)),
                   _ENTRIES))
    if any(b.waits):
        _drain(map(dict.clear, b.waits))


def _same_tree(flat) -> bool:
    for module, _, children, _, _ in flat:
        if tuple(module._modules.items()) != children:
            return False
    return True


#: id(root module) -> the Interleaver tracing it now (outermost trace), to refuse other threads
_active: "dict[int, Interleaver]" = {}
#: every root module traced so far, held weakly (the test suite checks them for leftovers)
_traced: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _wrapper(slot: Slot, live: _Live):
    """The ``forward`` installed on ``slot.module`` while a trace of its model runs. It counts
    the calls that do not come through the module's call entry (see _entry): calls of a module
    with torch hooks (torch runs them around ``forward``, so bodies see the input after the
    pre-hooks and the output before the forward hooks), calls of ``module.forward(...)`` itself,
    and every call where this torch has no place for entries."""

    def forward(*args, **kwargs):
        inter = live.inter
        if inter is None or _getcurrent() is not inter.runner:
            # a body calling a module itself (not counted), or a call outside the trace
            return slot.orig(*args, **kwargs)
        return _counted(inter, slot, live, args, kwargs)

    forward.__wrapped__ = slot  # marks a traced forward (the test suite looks for leftovers)
    return forward


def _counted(inter: Interleaver, slot: Slot, live: _Live, args, kwargs):
    """One call of ``slot.module`` in the trace: count it, serve the bodies waiting for its
    input and output, run it (what _entry does in line)."""
    if slot.gen == live.serial:
        call = slot.n_in
    else:  # the first call in this trace
        slot.gen = live.serial
        call = slot.n_out = 0
    slot.n_in = call + 1
    if slot.wait_in and call in slot.wait_in:
        args, kwargs, out = inter._serve_input(slot, call, args, kwargs)
    else:
        out = slot.orig(*args, **kwargs)
    slot.n_out += 1
    if slot.wait_out and call in slot.wait_out:
        out = inter._serve_output(slot, call, out)
    return out


def _entry(slot: Slot, live: _Live):
    """The call entry installed on ``slot.module`` while a trace of its model runs, or None.

    ``Module.__call__`` hands every call to an instance's ``_compiled_call_impl`` where one is
    set (``module.compile()`` puts torch.compile's there). The entry counts the call and runs
    ``forward`` itself: one Python call in all, where the forward wrapper alone is one more call
    on top of torch's own ``_call_impl``, with the arguments packed and unpacked once more
    (~0.3 µs per module call on tiny GPT-2 against ~1.6). A call the entry cannot take the short
    way (a module or global torch hook is set, the call comes from a body or from outside the
    trace) goes to torch's ``_call_impl``, which calls ``forward``, the counting wrapper: every
    call is counted exactly once either way."""
    module = slot.module
    d = module.__dict__  # (its hook tables are read from here: Module's __getattr__ makes
    # attribute reads of a module several times slower than a dict's)
    if type(module)._call_impl is not _CALL_IMPL or not _HOOKS.issubset(d):
        return None  # a class that calls in its own way, or a module torch did not set up
    call_impl = module._call_impl

    def entry(*args, **kwargs):
        inter = live.inter
        if (inter is None or _getcurrent() is not inter.runner or d["_forward_hooks"]
                or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]
                or _GFH or _GFPH or _GBH or _GBPH):
            return call_impl(*args, **kwargs)
        # (_counted, in line: this runs at every module call of a trace)
        if slot.gen == live.serial:
            call = slot.n_in
        else:
            slot.gen = live.serial
            call = slot.n_out = 0
        slot.n_in = call + 1
        if slot.wait_in and call in slot.wait_in:
            args, kwargs, out = inter._serve_input(slot, call, args, kwargs)
        else:
            out = slot.orig(*args, **kwargs)
        slot.n_out += 1
        if slot.wait_out and call in slot.wait_out:
            out = inter._serve_output(slot, call, out)
        return out

    entry.__wrapped__ = slot  # (as the forward wrapper's: the test suite looks for leftovers)
    return entry


def _med_index(med: Mediator) -> int:
    return med.index
