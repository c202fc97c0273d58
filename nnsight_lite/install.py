"""What a trace puts on its model's modules, and takes off again at its end.

    _Plan      per model wrapper: its slots and wrappers (calls.py), reused by the next trace
    _Bulk      one walk of the model as parallel lists, swapped in a few C-level passes
    put_on     Interleaver._install: the counting ``forward`` wrapper and the call entry on every
               module of the model (the walk is reused while the module tree is the same)
    take_off   Interleaver._uninstall: every module back as it was, also after an interrupt

Both wrappers are instance attributes of the modules for the duration of the trace only, and
both count, so every call is counted exactly once whichever way it comes (calls.py).
"""

from __future__ import annotations

import weakref
from collections import deque
from itertools import compress, count, repeat
from operator import eq, is_
from typing import TYPE_CHECKING

import torch

from .calls import (
    _CALL_IMPL,
    _ENTRY,
    _HAS_ENTRY,
    _UNSWAPPED,
    Slot,
    _entry,
    _fast_path_off,
    _Live,
    _wrapper,
    has_fast_path,
    traced_slot,
)
from .compiled import is_compiled
from .errors import NNsightError
from .mediator import _MISSING

if TYPE_CHECKING:
    from .interleaver import Interleaver

class _Plan:
    """A model's slots and wrappers, reused by its next trace. ``inter`` is the running trace.

    Nothing here points back at the plan (the wrappers reach the running trace through
    ``live``), so a plan, and the modules its slots hold, go by reference counting with the
    wrapper that keeps it.
    """

    __slots__ = ("slots", "wrappers", "live", "flat", "bulk", "held", "sourced", "instrumented",
                 "__weakref__")

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
        # id(module) -> (weakref to it, names of its operations whose .source a body used):
        # the forwards earlier traces ran instrumented, instrumented from the start of later
        # ones too (source_run.keep_instrumented), as nnsight keeps them
        self.sourced = {}
        # id(module) -> its forward instrumented for the model's traces (source_run.py), while
        # the module keeps its slot: a new walk drops the others
        self.instrumented = {}

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
                 "leaves", "inner", "inner_dicts", "snaps")

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


def _same_tree(flat) -> bool:
    for module, _, children, _, _ in flat:
        if tuple(module._modules.items()) != children:
            return False
    return True


#: id(root module) -> the Interleaver tracing it now (outermost trace), to refuse other threads
_active: "dict[int, Interleaver]" = {}
#: every root module traced so far, held weakly (the test suite checks them for leftovers)
_traced: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _hold_again(inter: "Interleaver", plan: "_Plan") -> None:
    """Hold the child Envoys the model's last traces held (its module tree is the same)."""
    held = inter.held
    for parent, name, env in plan.held:
        parent, env = parent(), env()
        if parent is not None and env is not None:
            d = parent.__dict__
            if name not in d:
                d[name] = env
                held.append((d, name, env))


def put_on(inter: "Interleaver") -> None:
    """Wrap ``forward`` of every module of the model (each module once, pre-order).

    Slots and their wrappers are kept per model between traces (``_Plan``) and reused
    when the same module sits at the same place: a trace then takes a new serial (which
    zeroes every counter at once, see Slot) and swaps ``forward`` entries. When every
    module still has exactly the children (names and objects) it had, the last walk is
    reused; any change to the tree (a child replaced, added, removed or renamed) makes a
    new walk, so it is always seen.
    """
    key = id(inter.root)
    other = _active.setdefault(key, inter)  # one step: two threads cannot both get None
    if other is inter:
        other = None
    elif other.thread != inter.thread:
        raise NNsightError(
            f"this model ({type(inter.root).__name__}) is being traced by another thread right "
            "now; traces of one model cannot overlap across threads (its modules' forward "
            "methods are swapped for the trace). Trace separate model objects per thread, "
            "or take turns with a lock."
        )
    home = inter.home
    plan = home.get("_plan") if home is not None else None
    if plan is None or plan.inter is not None:  # first trace, or one nested in another
        plan = _Plan()
        if home is not None and home.get("_plan") is None:
            home["_plan"] = plan
    if plan.flat is None:
        _traced.add(inter.root)
    plan.inter = inter
    plan.live.serial = next(_serials)  # every slot's counters now read 0 (see Slot)
    inter._plan = plan
    inter.slots = plan.slots
    # (torch.jit tracing calls modules its own way: the forward wrappers alone count then)
    jit = _jit_tracing()
    entries = _HAS_ENTRY and not jit
    if plan.bulk is not None and plan.flat[0][0] is inter.root and not jit:
        inter._bulk = plan.bulk  # (set first: an interrupt after the swap still undoes it)
        if _bulk_install(plan.bulk):
            if plan.held:
                _hold_again(inter, plan)
            return
        inter._bulk = None
    flat = plan.flat
    if flat is None or flat[0][0] is not inter.root or not _same_tree(flat):
        flat = _walk(inter, plan)
    elif plan.held:
        _hold_again(inter, plan)
    inter.slots = plan.slots
    for module, slot, _, wrapper, entry in flat:
        d = module.__dict__
        if not inter.compiled and is_compiled(module):
            inter.compiled = True
        prev = d.get("forward", _MISSING)
        if prev is not _MISSING:
            _check_not_shared(inter, slot, prev)
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


def _check_not_shared(inter: "Interleaver", slot: Slot, prev) -> None:
    """Refuse a module whose ``forward`` is another thread's running trace's wrapper: a
    module shared by two models (``NNsight(net)`` and ``NNsight(net[0])``), traced in two
    threads at once. (Nested traces in one thread take their turns and may share.)"""
    owner = traced_slot(prev)
    other = owner.live.inter if owner is not None else None
    if other is not None and other.thread != inter.thread:
        raise NNsightError(
            f"{slot.label()} ({type(slot.module).__name__}) is also part of "
            f"another model ({type(other.root).__name__}) that another thread is tracing "
            "right now; a module's forward is swapped for the trace of its model, so two "
            "models that share modules cannot be traced from two threads at once. Take "
            "turns with a lock, or give each thread its own copy of the model."
        )


def _walk(inter: "Interleaver", plan: "_Plan") -> list:
    """Walk the module tree (pre-order, each module once): make or reuse each module's Slot
    and record the walk in ``plan`` (``plan.slots``, ``plan.flat``)."""
    old = plan.slots
    old_wrappers = plan.wrappers
    slots = {}
    wrappers = {}
    flat = []
    stack = [(inter.root, None, "")]
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
            if has_fast_path(module):
                made = tuple(None if c is None else _fast_path_off(c, slot, plan.live)
                             for c in made)
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
    if plan.instrumented:
        plan.instrumented = {k: v for k, v in plan.instrumented.items()
                             if slots.get(k) is v.mslot}
    plan.held = []  # (the Envoys held before may hold modules that have left the tree)
    return flat


def take_off(inter: "Interleaver") -> None:
    held, inter.held = inter.held, None
    if held:
        for d, name, env in held:
            if d.get(name) is env:
                del d[name]
    if inter.sources is not None:  # instrumented forwards (source_run.py) go first
        inter.sources.close()
        inter.sources = None
    if inter._bulk is not None:
        _bulk_uninstall(inter._bulk)
        inter._bulk = None
    else:
        for slot in inter.slots.values():
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
    for slot in inter.waited:  # (the bodies that waited there are done or unwound next)
        slot.wait_in = slot.wait_out = None
    inter.waited.clear()
    plan = getattr(inter, "_plan", None)
    if plan is not None:
        plan.inter = None
    if _active.get(id(inter.root)) is inter:
        del _active[id(inter.root)]
