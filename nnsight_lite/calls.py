"""What runs at every module call of a trace: the counters and the two wrappers.

    Slot       per-trace state of one module: call counters, who waits on it
    _Live      what the wrappers of one model read at every call: the running trace, its serial
    _entry     the call entry (an instance ``_compiled_call_impl``): counts and runs a call in one
               Python call
    _wrapper   the counting ``forward``: counts the calls that do not come through the entry

Both are made once per module and kept by the model's plan (install.py), which puts them on the
modules at a trace's start and takes them off at its end. They reach the running trace through
``_Live`` and hand waited-for values to ``Interleaver._serve_input`` / ``_serve_output``.
"""

from __future__ import annotations

import re
from threading import Lock, get_ident
from typing import TYPE_CHECKING

import torch
from torch.nn.modules import module as _torch_module

from .mediator import _MISSING
from .workers import _getcurrent

if TYPE_CHECKING:
    from .interleaver import Interleaver

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

    # (what ``enter`` reads at every call first, side by side: a forward that streams large
    # weights pushes the slots out of the caches, and each call then reads its slot again)
    __slots__ = ("live", "d", "gen", "n_in", "n_out", "wait_in", "wait_out", "orig",
                 "call_impl", "module", "parent", "attr", "prev_forward", "entered", "elsewhere")

    def __init__(self, module, parent, attr, live):
        self.module = module
        self.d = None  # the module's __dict__ (its hook tables), where it has a call entry
        self.call_impl = None  # torch's own _call_impl of the module, bound (_entry)
        self.orig = None  # the forward the wrapper calls (set at every install)
        self.prev_forward = _UNSWAPPED  # the instance ``forward`` entry the wrapper replaced
        self.entered = None  # the module's call entry (_entry) while it is installed
        self.parent = parent  # the Slot of the module that holds this one (None at the root)
        self.attr = attr  # this module's name in its parent
        self.live = live  # the plan's _Live: which trace runs now, and its serial
        self.gen = -1  # the serial of the trace the counters below count for
        self.n_in = 0  # calls whose input stage has begun
        self.n_out = 0  # calls that have produced their output
        # call -> the bodies waiting for that call's input / output, sorted by invoke; None
        # while none ever waited in this trace (Interleaver.wait_table makes them): a forward
        # then reads no table object per module call, only this slot
        self.wait_in = None
        self.wait_out = None
        self.elsewhere = -1  # the serial of the last trace that saw it called on another thread

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

    def enter(self, /, *args, **kwargs):
        """The call entry (see _entry), bound to this slot: one call of the module in a trace.
        (A bound method rather than a closure: a call reads this slot and a small method
        object, not a function object, its closure and four cells, which a forward streaming
        large weights pushes out of the caches between calls.)"""
        live = self.live
        inter = live.inter
        d = self.d
        if (inter is None or _getcurrent() is not inter.runner or d["_forward_hooks"]
                or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]
                or _GFH or _GFPH or _GBH or _GBPH):
            return self.call_impl(*args, **kwargs)
        # (_counted, in line: this runs at every module call of a trace)
        if self.gen == live.serial:
            call = self.n_in
        else:
            self.gen = live.serial
            call = self.n_out = 0
        self.n_in = call + 1
        if self.wait_in and call in self.wait_in:
            args, kwargs, out = inter._serve_input(self, call, args, kwargs)
        else:
            out = self.orig(*args, **kwargs)
        self.n_out += 1
        if self.wait_out and call in self.wait_out:
            out = inter._serve_output(self, call, out)
        return out


class _Live:
    """What the wrappers of one plan read at every call: the trace running now (or None) and
    its serial number (unique per trace; a slot counting for another serial reads 0 calls)."""

    __slots__ = ("inter", "serial")

    def __init__(self):
        self.inter = None
        self.serial = 0



def traced_slot(forward) -> "Slot | None":
    """The Slot that ``forward``, a trace's forward wrapper (or call entry), counts for; None
    for any other callable (or None)."""
    slot = getattr(forward, "__wrapped__", None)
    if isinstance(slot, Slot):  # a forward wrapper
        return slot
    slot = getattr(forward, "__self__", None)  # a call entry: Slot.enter, bound
    return slot if isinstance(slot, Slot) and forward.__func__ is _ENTER else None


_ENTER = Slot.enter


def _wrapper(slot: Slot, live: _Live):
    """The ``forward`` installed on ``slot.module`` while a trace of its model runs. It counts
    the calls that do not come through the module's call entry (see _entry): calls of a module
    with torch hooks (torch runs them around ``forward``, so bodies see the input after the
    pre-hooks and the output before the forward hooks), calls of ``module.forward(...)`` itself,
    and every call where this torch has no place for entries."""

    def forward(*args, **kwargs):
        inter = live.inter
        if inter is None or _getcurrent() is not inter.runner:
            # a body calling a module itself (not counted), or a call outside the trace: on
            # another thread (a thread pool in the forward), noted for the error of a body
            # that waits for it in vain
            if inter is not None and inter.thread != get_ident():
                slot.elsewhere = live.serial
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
    slot.d = d
    slot.call_impl = module._call_impl
    return slot.enter  # (made once, kept by the plan: install compares it by identity)


#: modules whose forward has a fused fast path that calls none of their submodules (torch's
#: TransformerEncoderLayer in eval mode without grad): torch takes it only where no module of
#: theirs has a forward hook or pre-hook, so that hooked submodules are called
_FAST_PATH_LAYERS = (torch.nn.TransformerEncoderLayer,)
_mha = getattr(torch.backends, "mha", None)  # (its flag: ``_is_fastpath_enabled``)


def has_fast_path(module) -> bool:
    """Whether ``module``'s forward may take torch's fused fast path (see _fast_path_off)."""
    return _mha is not None and hasattr(_mha, "_is_fastpath_enabled") and \
        isinstance(module, _FAST_PATH_LAYERS)


class _LayerCheckOff:
    """What torch's fast-path flag holds while guarded layer calls run (_fast_path_off), on any
    thread: false to the first truth test on each armed trace's forward greenlet after its
    guard armed it (the layer's own check at the top of its forward), and true to every later
    one (the MultiheadAttention inside the layer, whose own fast path hooks do not turn off
    either), to bodies, to other threads' plain forwards and to their traces' unguarded layers.
    One object for all threads: a flag of one trace's own would read as turned off to another
    thread's trace running meanwhile, which then let its layer run fast."""

    __slots__ = ("armed",)

    def __init__(self):
        self.armed = {}  # forward greenlet -> whether its layer's check is still to come

    def __bool__(self) -> bool:
        armed = self.armed
        runner = _getcurrent()
        if armed.get(runner):
            armed[runner] = False
            return False
        return True


_CHECK_OFF = _LayerCheckOff()
_check_lock = Lock()  # (arming and putting the flag back, across threads)


def _fast_path_off(call, slot: Slot, live: _Live):
    """``call`` (the counting wrapper or call entry of a ``TransformerEncoderLayer``) made to
    skip torch's fused fast path where a body, or a cache, waits for a value of the layer or of
    a module inside it (or reads their ``.source``), as a forward hook or pre-hook on that module
    makes torch skip it: the layer then calls its submodules, and every value is the one the
    hooks would see. Other calls take the fast path, as in the plain forward."""
    module = slot.module
    armed = _CHECK_OFF.armed

    def guarded(*args, **kwargs):
        inter = live.inter
        if inter is None or _getcurrent() is not inter.runner:
            return call(*args, **kwargs)
        flag = _mha._is_fastpath_enabled
        if flag is not True and flag is not _CHECK_OFF:  # (turned off by the user)
            return call(*args, **kwargs)
        slots = inter.slots
        sources = inter.sources.installed if inter.sources is not None else ()
        for m in module.modules():
            s = slots.get(id(m))
            if s is not None and (s.wait_in or s.wait_out or s in sources):
                break
        else:
            return call(*args, **kwargs)
        runner = inter.runner
        with _check_lock:
            if _mha._is_fastpath_enabled is True:
                _mha._is_fastpath_enabled = _CHECK_OFF
            before = armed.get(runner)  # (a guarded call inside another, on this greenlet)
            armed[runner] = True
        try:
            return call(*args, **kwargs)
        finally:
            with _check_lock:
                if before is None:
                    armed.pop(runner, None)
                elif not before:  # (an outer layer's check was made: it stays made; one still
                    armed[runner] = False  # to come is the same layer's, entry and wrapper)
                # the last guard running puts the flag back (not a setting made meanwhile)
                if not armed and _mha._is_fastpath_enabled is _CHECK_OFF:
                    _mha._is_fastpath_enabled = True

    guarded.__wrapped__ = slot  # (a traced forward, as the call it guards)
    return guarded


_module_getstate = torch.nn.Module.__getstate__


def _getstate(self):
    """``torch.nn.Module.__getstate__``, which already leaves out a module's compiled call
    (the call entry's place), leaving out a running trace's forward wrapper too: a module
    deep-copied or pickled while a trace of its model runs (``copy.deepcopy`` of a target
    network in the model's own forward, ``torch.save`` in a body) gets the forward it had
    before the trace, not the wrapper, which would run the original module."""
    state = _module_getstate(self)
    slot = traced_slot(state.get("forward"))
    if slot is not None:
        state = dict(state)
        prev = slot.prev_forward
        if prev is _MISSING or prev is _UNSWAPPED:
            del state["forward"]
        else:
            state["forward"] = prev
    return state


if getattr(_module_getstate, "__module__", None) != __name__:  # (once: importlib.reload)
    _getstate.__wrapped__ = _module_getstate
    torch.nn.Module.__getstate__ = _getstate
