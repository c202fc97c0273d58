"""Operations inside a module's forward: ``envoy.source.<op>.output``.

    Source          the operations of one module's forward; ``print`` it to see their names
    OpEnvoy         one operation: .output .input .inputs .next() .skip() .source
    FunctionSource  the operations of the function an operation calls (nested ``.source``)
    (compiling a forward into operations, ``compiled(func)``: instrument.py)
    SourceRun       per trace: the forwards running instrumented and their operations' slots

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

import difflib
import types
import weakref

import torch

from .calls import Slot
from .errors import ModulePathError, OutOfOrderError, SourceUnavailableError
from .instrument import (
    Compiled,
    _accelerate_body,
    _function_of,
    _module_function,
    compiled,
    instrument,
)
from .mediator import INPUT, current_mediator
from .workers import _getcurrent, user_location


# --------------------------------------------------------------------------- per trace


class OpSlot(Slot):
    """Per-trace state of one operation: call counters and waiting bodies, like a module's.

    ``children`` hold the slots of a called function's operations (nested ``.source``).
    """

    __slots__ = ("path", "drill", "children", "fn", "made", "comp", "error")

    def __init__(self, owner: Slot, path: str):
        super().__init__(owner.module, owner, path, owner.live)
        self.gen = owner.live.serial  # made in the running trace, for it alone
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

    def ops_of(self, mslot: Slot, envoy=None) -> dict:
        """The operations of ``mslot``'s forward, instrumenting it for this trace if needed."""
        hit = self.installed.get(mslot)
        if hit is not None:
            return hit[1]
        path = f"{envoy._path if envoy is not None else mslot.label()}.source"
        sourced = self.inter._plan.sourced  # later traces instrument it from their start
        if id(mslot.module) not in sourced:
            sourced[id(mslot.module)] = (weakref.ref(mslot.module), set())
        if mslot.calls:
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
                f"{path[:-7]}.forward is {type(mslot.orig).__name__}, not a Python function, "
                "so its operations cannot be traced"
            )
        helper, table = _make_helper(self.inter)
        new, comp = instrument(func, helper)
        slots = {n: OpSlot(mslot, f"{path}.{n}") for n in comp.names}
        table[:] = slots.values()
        new = new if owner is None else types.MethodType(new, owner)
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


def _make_helper(inter):
    """The ``__nnsight_op__`` of one instrumented function in one trace, and its table of
    operation slots (filled once the operations are named): counts each call of each
    operation and serves the bodies waiting for it, as the module wrapper does."""
    table = []

    def op(index, fn, /, *args, **kwargs):
        if _getcurrent() is not inter.runner:  # a body calling the module itself
            return fn(*args, **kwargs)
        slot = table[index]
        if slot.drill:
            fn = _drilled(inter, slot, fn)
        call = slot.n_in
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
    helper, table = _make_helper(inter)
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
    run = inter.sources
    if run is None:
        run = inter.sources = SourceRun(inter)
    return run


# --------------------------------------------------------------------------- what users touch


def _near(name: str, names) -> str:
    near = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""


class Source:
    """The operations of a module's forward (``envoy.source``), addressable by name.

    Example::

        print(model.transformer.h[0].attn.source)     # the forward, each op named beside it
        with model.trace("Hello"):
            w = model.transformer.h[0].attn.source.attention_interface_0.output.save()
            model.transformer.h[0].attn.source.self_c_proj_0.output[:] = 0

    Each operation is an :class:`OpEnvoy` (``.output``, ``.input``, ``.inputs``, ``.next()``,
    ``.skip()``, nested ``.source``). Touching ``.source`` inside a body makes the module's
    forward run instrumented for that trace and the model's later ones; other modules run
    their own forward unchanged.
    """

    def __init__(self, envoy):
        d = self.__dict__
        d["_envoy"] = envoy
        d["_path"] = f"{envoy._path}.source"
        # (weakly: each OpEnvoy holds this view, so a strong table would be a reference cycle;
        # an alias name still gives the very OpEnvoy its canonical name gave while it is held)
        d["_ops"] = weakref.WeakValueDictionary()

    def _compiled(self) -> Compiled:
        return compiled(_module_function(self._envoy._module))

    def __getstate__(self):  # (a remote body may hold a view: its table of ops is weak)
        return {"_envoy": self._envoy, "_path": self._path}

    def __setstate__(self, state):
        self.__dict__.update(state, _ops=weakref.WeakValueDictionary())

    def _enter(self) -> None:
        """Inside a body of a trace of this module's model: run its forward instrumented."""
        med = getattr(_getcurrent(), "mediator", None)
        if med is None:
            return
        inter = med.interleaver
        mslot = inter.slots.get(id(self._envoy._module))
        # A module that already ran uninstrumented cannot count its operations any more, but
        # touching its .source to print it or name an op is no mistake: only a request for an
        # operation's value (OpEnvoy._slot_in) raises then, as nnsight's out-of-order read does.
        if mslot is not None and not mslot.calls:
            run_of(inter).ops_of(mslot, self._envoy)

    def __getattr__(self, name: str) -> "OpEnvoy":
        ops = self.__dict__.get("_ops")
        if ops is None or name.startswith("__"):
            raise AttributeError(name)
        hit = ops.get(name)
        if hit is not None:
            return hit
        comp = self._compiled()
        names = comp.index
        if name not in names:
            name = comp.resolve(name)
            hit = ops.get(name)
            if hit is not None:
                return hit
        if name not in names:
            raise ModulePathError(
                f"{self._path} has no operation {name!r} (at {user_location()})."
                f"{comp.unknown(name)}{_near(name, names)} "
                f"print({self._path}) lists the operations of "
                f"{type(self._envoy._module).__name__}.forward by name."
            )
        env = ops[name] = OpEnvoy(self, name)
        return env

    def __setattr__(self, name, value):
        raise AttributeError(f"{self._path}.{name} cannot be set; set .output or .input of an "
                             "operation instead")

    @property
    def names(self) -> list:
        """The operation names, in the order the forward's code has them (nnsight's
        ``.source.names``): ``[n for n in model.layer.source.names if "matmul" in n]``."""
        return list(self._compiled().names)

    def __iter__(self):
        return (getattr(self, n) for n in self._compiled().names)

    def __dir__(self):
        return list(self._compiled().names)

    def __repr__(self) -> str:
        return self._compiled().listing(self._path)


class OpEnvoy:
    """One operation inside a forward: ``model.layer.source.torch_matmul_0``.

    Example::

        with model.trace(x):
            args, kwargs = model.layer.source.torch_matmul_0.inputs
            y = model.layer.source.torch_matmul_0.output.save()
            model.layer.source.torch_relu_0.output[:] = 0

    ``.output``, ``.input``, ``.inputs``, ``.next()`` and ``.skip()`` behave as they do for a
    module; ``.source`` (inside a body) gives the operations of the function this one calls.
    """

    _OWN = frozenset({"output", "input", "inputs"})

    def __init__(self, parent, name: str):
        d = self.__dict__
        d["_parent"] = parent  # a Source or a FunctionSource
        d["_name"] = name
        d["_path"] = f"{parent._path}.{name}"
        d["_module"] = None  # no module: the interleaver asks _slot_in for the slot

    def _slot_in(self, inter) -> OpSlot:
        """This operation's slot in ``inter``'s trace (instrumenting its forward if needed)."""
        parent = self._parent
        if isinstance(parent, Source):
            ops = run_of(inter).ops_of(inter.slot_of(parent._envoy), parent._envoy)
        else:
            ops = inter.slot_of(parent._op).children
        slot = ops.get(self._name)
        if slot is None:
            raise ModulePathError(
                f"{parent._path} has no operation {self._name!r} in the function running in this "
                f"trace (at {user_location()}).{_near(self._name, ops)} Print it to see its "
                "operations."
            )
        return slot

    @property
    def name(self) -> str:
        """The operation's name (``torch_matmul_0``)."""
        return self._name

    @property
    def source(self) -> "FunctionSource":
        """The operations of the function this operation calls (at its current call).

        Inside a body only: it waits for this operation's call, since what it calls is often
        a local variable (an attention function chosen at run time).
        """
        med = current_mediator(self, "source")
        slot = med.interleaver.slot_of(self)
        if not slot.drill:
            parent = self._parent
            if isinstance(parent, Source):  # later traces drill it from their start
                hit = med.interleaver._plan.sourced.get(id(parent._envoy._module))
                if hit is not None:
                    hit[1].add(self._name)
            if slot.calls:
                raise OutOfOrderError(
                    f"{self._path}.source was first used at {user_location()}, after "
                    f"{self._path} had already run {slot.calls} time(s) in this trace. Use "
                    f"{self._path}.source at the top of the body (before reading any value "
                    "the model computes), so its operations are counted from the start. (The "
                    "model's later traces count them from their start.)"
                )
            slot.drill = True
        call = med.iteration
        if not slot.drill or not slot.outs <= call < slot.calls or slot.fn is None:
            med.get(self, INPUT)  # (else this call runs now: a body read an op inside it)
        if slot.error is not None:
            raise SourceUnavailableError(f"{slot.error} (at {user_location()})")
        return FunctionSource(self, slot.comp)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # (copy / pickle protocol probes, private names)
            raise AttributeError(name)
        own = [a for a in dir(type(self)) if not a.startswith("_")]
        raise ModulePathError(
            f"{self._path} (an operation) has no attribute {name!r} (at {user_location()})."
            f"{_near(name, own)} An operation has {', '.join('.' + a for a in own)}."
        )

    def __repr__(self) -> str:
        parent = self._parent
        comp = parent._compiled() if isinstance(parent, Source) else parent._comp
        return comp.context(self._path, self._name)


# the value properties are the module Envoy's own: they only need _path and the slot
def _borrow():
    from .envoy import Envoy

    for name in ("output", "input", "inputs", "next", "skip", "__setattr__"):
        setattr(OpEnvoy, name, Envoy.__dict__[name])


_borrow()


class FunctionSource:
    """The operations of a function called by an operation (``op.source``, inside a body).

    Example::

        with model.trace("Hello"):
            inner = model.transformer.h[0].attn.source.attention_interface_0.source
            scores = inner.torch_matmul_0.output.save()
    """

    def __init__(self, op: OpEnvoy, comp: Compiled):
        d = self.__dict__
        d["_op"] = op
        d["_comp"] = comp
        d["_path"] = f"{op._path}.source"

    def _compiled(self) -> Compiled:
        return self._comp

    def __getattr__(self, name: str) -> OpEnvoy:
        if name.startswith("__") or "_comp" not in self.__dict__:
            raise AttributeError(name)
        names = self._comp.index
        name = self._comp.resolve(name)
        if name not in names:
            raise ModulePathError(
                f"{self._path} has no operation {name!r} (at {user_location()})."
                f"{self._comp.unknown(name)}{_near(name, names)} "
                f"print({self._path}) lists the operations of {self._comp.qualname}."
            )
        return OpEnvoy(self, name)

    @property
    def names(self) -> list:
        """The operation names of the called function (as ``Source.names``)."""
        return list(self._comp.names)

    def __iter__(self):
        return (getattr(self, n) for n in self._comp.names)

    def __dir__(self):
        return list(self._comp.names)

    def __repr__(self) -> str:
        return self._comp.listing(self._path)


def source_of(envoy) -> Source:
    """``envoy.source``: one view per Envoy while it is held; inside a body it instruments the
    module's forward for the running trace, so its operations are counted from the start.

    The Envoy keeps its view weakly: the view holds the Envoy, so a strong reference back
    would be a cycle that kept the module (and its weights) alive after the model was dropped,
    until the garbage collector ran."""
    d = envoy.__dict__
    ref = d.get("_source_view")  # (LanguageModel's "_source" is its load path)
    src = ref() if ref is not None else None
    if src is None:
        src = Source(envoy)
        d["_source_view"] = weakref.ref(src)
    src._enter()
    return src
