"""Operations counted and served in one trace: the machinery behind ``envoy.source``.

    OpSlot              per trace, one operation's call counters and waiting bodies
    SourceRun           per trace: the forwards running instrumented and their operations' slots
    run_of(inter)       the trace's SourceRun, made at its first use
    keep_instrumented   at a trace's start: the forwards the model's earlier traces instrumented
    (what users touch, ``Source``/``OpEnvoy``/``FunctionSource``: source.py; compiling a
    forward into operations, ``compiled(func)``: instrument.py)

How it works. ``compiled`` (instrument.py) parses a forward's source and rewrites every call ``f(a, k=v)``
into ``__nnsight_op__(i, f, a, k=v)``, where ``i`` numbers the call site. The code is compiled
once per code object, inside a shell function whose parameters are the helper and the
original's free variables, so each use makes a function with the original globals, closure
cells and defaults plus its own helper. A forward runs instrumented only in a trace whose
bodies ask for its operations, and in the model's later traces (from their start: the model's
plan remembers it, ``keep_instrumented``, as nnsight keeps a forward it instrumented): the
trace's counting wrapper calls ``slot.orig``, which is set to the instrumented forward for that
trace and put back when it ends, so nothing on the module changes, a plain call runs it as it
is, and a forward nobody asked about runs as it is.

The helper counts every call of every operation of an instrumented forward (as the counting
wrapper does for modules) and serves waiting bodies through the interleaver's own
``_serve_input``/``_serve_output``, with each operation's :class:`OpSlot`. So operations obey
the same ordering, ``.next()``/``tracer.iter`` and batch-slicing rules as modules.
"""

from __future__ import annotations

import types
import weakref

import torch

from .calls import Slot
from .errors import OutOfOrderError, SourceUnavailableError
from .instrument import _accelerate_body, _function_of, instrument
from .workers import _getcurrent, user_location


class OpSlot(Slot):
    """Per-trace state of one operation: call counters and waiting bodies, like a module's.

    ``children`` hold the slots of a called function's operations (nested ``.source``).
    """

    __slots__ = ("path", "drill", "children", "fn", "made", "comp", "error")

    def __init__(self, owner: Slot, path: str):
        super().__init__(owner.module, owner, path, owner.live)
        self.gen = owner.live.serial  # (counting for the running trace; the helper zeroes the
        # counters of a later trace at its first call, as the module call entry does)
        self.path = path
        self.drill = False  # a body asked for .source of this operation
        self.children = {}
        self.fn = self.made = self.comp = self.error = None

    @property
    def name(self) -> str:
        return self.path

    def label(self) -> str:
        return self.path


class SourceRun:
    """The instrumented forwards of one trace (``interleaver.sources``); closed at its end."""

    def __init__(self, inter):
        self.inter = inter
        self.installed: dict[Slot, tuple] = {}  # module slot -> (previous orig, {name: OpSlot})

    def ops_of(self, mslot: Slot, path: "str | None" = None) -> dict:
        """The operations of ``mslot``'s forward, instrumenting it for this trace if needed
        (``path``: how the user named them, ``model.layer.source``)."""
        hit = self.installed.get(mslot)
        if hit is not None:
            return hit[1]
        plan = self.inter._plan
        key = id(mslot.module)
        if key not in plan.sourced:  # later traces instrument it from their start
            plan.sourced[key] = (weakref.ref(mslot.module), set())
        if mslot.calls:
            path = _path_of(mslot, path)
            raise OutOfOrderError(
                f"an operation of {path} was asked for at {user_location()}, after "
                f"{path[:-7]} had already run {mslot.calls} time(s) in this trace without its "
                f"operations being counted (they are counted from the first use of .source in "
                f"a trace). Touch {path} at the top of the body (before reading any value the "
                "model computes), so its operations are counted from the start of the forward. "
                "(The model's later traces count them from their start, so there a body may "
                "read them after values computed inside the module's own call.)"
            )
        body = _accelerate_body(mslot.module, mslot.orig)  # the hook stays, its body swaps
        func, owner = _function_of(mslot.orig if body is None else body)
        if func is None:
            raise SourceUnavailableError(
                f"{_path_of(mslot, path)[:-7]}.forward is {type(mslot.orig).__name__}, not a "
                "Python function, so its operations cannot be traced"
            )
        made = plan.instrumented.get(key)
        if made is None or made.mslot is not mslot or made.func is not func \
                or made.owner is not owner:  # (first asked for, or its forward replaced)
            made = plan.instrumented[key] = _Instrumented(mslot, func, owner,
                                                          _path_of(mslot, path))
        elif path is not None and made.path != path:  # (reached by another name now)
            made.name_slots(path)
        new, slots = made.new, made.slots
        if body is None:
            self.installed[mslot] = (mslot.orig, slots)
            mslot.orig = new
        else:
            self.installed[mslot] = (body, slots)
            mslot.module.__dict__["_old_forward"] = new
        return slots

    def close(self) -> None:
        """Put every forward back as it was and forget this trace's operation slots."""
        for mslot, (prev, _) in self.installed.items():
            if _accelerate_body(mslot.module, mslot.orig) is not None:
                mslot.module.__dict__["_old_forward"] = prev
            else:
                mslot.orig = prev
        self.installed.clear()
        self.inter = None


def _path_of(mslot: Slot, path: "str | None") -> str:
    """How messages name the operations of ``mslot``'s forward: ``model.layer.source``."""
    return path if path is not None else f"{mslot.label()}.source"


def _value(value, /):
    """An assignment operation's "call" (``fn`` None in the helper): the value assigned."""
    return value


class _Instrumented:
    """A module's forward instrumented once for its model's traces (kept by the model's plan,
    ``_Plan.instrumented``, while the module keeps its slot and its forward): the function, the
    helper it calls and the operations' slots, which count for the running trace (``live``)
    as module slots do. A trace that asks for the same forward's operations again swaps it in
    instead of compiling a function and making a slot per operation anew."""

    __slots__ = ("mslot", "func", "owner", "new", "slots", "path")

    def __init__(self, mslot: Slot, func, owner, path: str):
        self.mslot = mslot
        self.func = func  # the plain function instrumented, and the ``self`` it is bound to
        self.owner = owner
        helper, table = _make_helper(mslot.live)
        new, comp = instrument(func, helper)
        self.slots = {n: OpSlot(mslot, n) for n in comp.names}
        self.name_slots(path)
        table[:] = self.slots.values()
        self.new = new if owner is None else types.MethodType(new, owner)

    def name_slots(self, path: str) -> None:
        """Name the operations' slots under ``path`` (``model.layer.source``), for messages."""
        self.path = path
        for n, slot in self.slots.items():
            slot.path = f"{path}.{n}"


def _make_helper(live):
    """The ``__nnsight_op__`` of one instrumented function, and its table of operation slots
    (filled once the operations are named): counts each call of each operation in the running
    trace (``live.inter``) and serves the bodies waiting for it, as the module call entry
    does."""
    table = []

    def op(index, fn, /, *args, **kwargs):
        if fn is None:  # an assignment (instrument._Rewriter._assignment)
            fn = _value
        inter = live.inter
        if inter is None or _getcurrent() is not inter.runner:  # a body calling the module
            return fn(*args, **kwargs)  # itself (or a call after the trace, by a reference)
        slot = table[index]
        if slot.drill:
            fn = _drilled(inter, slot, fn)
        if slot.gen == live.serial:
            call = slot.n_in
        else:  # its first call in this trace
            slot.gen = live.serial
            call = slot.n_out = 0
        slot.n_in = call + 1
        if slot.wait_in and call in slot.wait_in:
            slot.orig = fn  # what _serve_input runs (unless a body skips it)
            try:
                args, kwargs, out = inter._serve_input(slot, call, args, kwargs)
            finally:
                slot.orig = None
        else:
            out = fn(*args, **kwargs)
        slot.n_out += 1
        if slot.wait_out and call in slot.wait_out:
            out = inter._serve_output(slot, call, out)
        return out

    return op, table


def _drilled(inter, slot: OpSlot, fn):
    """``fn`` instrumented so that its own operations count under ``slot.children``."""
    if slot.fn is fn:
        return slot.made
    slot.fn = fn
    slot.made = fn
    slot.error = None
    if isinstance(fn, torch.nn.Module):
        slot.error = (f"{slot.path} calls a module ({type(fn).__name__}): use that module's own "
                      ".source (for example model.<path to it>.source) instead")
        return fn
    func, owner = _function_of(fn)
    if func is None and isinstance(getattr(type(fn), "__call__", None), types.FunctionType):
        func, owner = type(fn).__call__, fn  # a callable object: its __call__'s operations
    if func is None:
        slot.error = (f"{slot.path} calls {type(fn).__name__} {getattr(fn, '__name__', '')!r}, "
                      "which is not a Python function, so it has no operations to trace")
        return fn
    helper, table = _make_helper(slot.live)
    try:
        new, comp = instrument(func, helper)
    except SourceUnavailableError as exc:
        slot.error = str(exc)
        return fn
    kids = slot.children
    for n in comp.names:
        if n not in kids:
            kids[n] = OpSlot(slot, f"{slot.path}.source.{n}")
    table[:] = [kids[n] for n in comp.names]
    slot.comp = comp
    slot.made = new if owner is None else types.MethodType(new, owner)
    return slot.made


def keep_instrumented(inter) -> None:
    """Run instrumented, from the start of this trace, the forwards whose operations bodies of
    the model's earlier traces asked for (and drill the operations whose ``.source`` they
    used), as nnsight keeps a forward instrumented once a trace touched its ``.source``. So a
    body may read such an operation after a value computed inside the module's own call (its
    ``attn.c_attn.output``, then ``attn.source.<op>``): a first trace that touches the
    operation alone makes that work, as nnsight's tutorials do."""
    plan = inter._plan
    for key, (ref, drilled) in list(plan.sourced.items()):
        module = ref()
        if module is None:
            del plan.sourced[key]
            continue
        mslot = inter.slots.get(key)
        if mslot is None or mslot.module is not module:
            continue  # (no longer in the model: it may come back)
        try:
            ops = run_of(inter).ops_of(mslot)
        except SourceUnavailableError:  # (its forward was replaced by one with no source)
            del plan.sourced[key]
            continue
        for name in drilled:
            slot = ops.get(name)
            if slot is not None:
                slot.drill = True


def run_of(inter) -> SourceRun:
    """The running trace's :class:`SourceRun` (``inter.sources``), made at its first use."""
    run = inter.sources
    if run is None:
        run = inter.sources = SourceRun(inter)
    return run
