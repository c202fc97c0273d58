"""Operations inside a module's forward: ``envoy.source.<op>.output``.

    Source          the operations of one module's forward; ``print`` it to see their names
    OpEnvoy         one operation: .output .input .inputs .next() .skip() .source
    FunctionSource  the operations of the function an operation calls (nested ``.source``)
    source_of       ``envoy.source``: the Envoy's view, instrumenting its forward inside a body
    (compiling a forward into operations, ``compiled(func)``: instrument.py; running them
    instrumented in a trace and counting their calls, ``OpSlot``/``SourceRun``: source_run.py)

These are views: they name operations and hand the interleaver each one's slot in the
running trace (``OpEnvoy._slot_in``); source_run.py counts the calls and serves the bodies.
``keep_instrumented``, which the interleaver calls at a trace's start, is source_run.py's.
"""

from __future__ import annotations

import difflib
import weakref

from .errors import (
    ModulePathError,
    OutOfOrderError,
    OutsideTraceError,
    SourceUnavailableError,
)
from .instrument import Compiled, _module_function, compiled
from .mediator import INPUT, current_mediator
from .source_run import OpSlot, run_of
from .workers import _getcurrent, user_location


def _near(name: str, names) -> str:
    near = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f" Did you mean {', '.join(repr(n) for n in near)}?" if near else ""


def _held(ops: dict, name: str) -> "OpEnvoy | None":
    """The OpEnvoy a view's table (``name`` -> weak reference) still holds for ``name``."""
    ref = ops.get(name)
    return ref() if ref is not None else None


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
        self._attach(envoy)

    def _attach(self, envoy) -> None:
        d = self.__dict__
        # (the module, and its Envoy weakly: the Envoy keeps this view, see source_of)
        d["_module"] = envoy._module
        d["_envoy_ref"] = weakref.ref(envoy)
        d["_path"] = f"{envoy._path}.source"
        # name -> a weak reference to its OpEnvoy (weakly: each OpEnvoy holds this view, so a
        # strong table would be a reference cycle; an alias name still gives the very OpEnvoy
        # its canonical name gave while it is held). Plain references, not a
        # WeakValueDictionary, whose every store and removal runs Python code: a dead one
        # stays until its name is asked for again (one per operation name at most).
        d["_ops"] = {}

    @property
    def _envoy(self):
        """The Envoy of the module (None once nothing else holds it)."""
        return self.__dict__["_envoy_ref"]()

    def _compiled(self) -> Compiled:
        return compiled(_module_function(self._module))

    def __getstate__(self):  # (a remote body may hold a view: pickled as its Envoy's view)
        envoy = self._envoy
        if envoy is None:
            raise TypeError(f"{self._path} cannot be pickled: the model it belongs to is gone")
        return {"_envoy": envoy}

    def __setstate__(self, state):
        self._attach(state["_envoy"])

    def _enter(self) -> None:
        """Inside a body of a trace of this module's model: run its forward instrumented."""
        d = self.__dict__
        d["_running"] = None
        med = getattr(_getcurrent(), "mediator", None)
        if med is None:
            return
        inter = med.interleaver
        mslot = inter.slots.get(id(self._module))
        # A module that already ran uninstrumented cannot count its operations any more, but
        # touching its .source to print it or name an op is no mistake: only a request for an
        # operation's value (OpEnvoy._slot_in) raises then, as nnsight's out-of-order read does.
        if mslot is not None and not mslot.calls:
            # (the operations of the forward running now, by name: __getattr__ takes a name
            # found there as it is, without compiling the forward's listing again)
            d["_running"] = run_of(inter).ops_of(mslot, self._path)

    def __getattr__(self, name: str) -> "OpEnvoy":
        ops = self.__dict__.get("_ops")
        if ops is None or name.startswith("__"):
            raise AttributeError(name)
        hit = _held(ops, name)
        if hit is not None:
            return hit
        running = self.__dict__.get("_running")
        if running is None or name not in running:  # (not an op of the forward running now)
            comp = self._compiled()
            names = comp.index
            if name not in names:
                name = comp.resolve(name)
                hit = _held(ops, name)
                if hit is not None:
                    return hit
            if name not in names:
                raise ModulePathError(
                    f"{self._path} has no operation {name!r} (at {user_location()})."
                    f"{comp.unknown(name)}{_near(name, names)} "
                    f"print({self._path}) lists the operations of "
                    f"{type(self._module).__name__}.forward by name."
                )
        env = OpEnvoy(self, name)
        ops[name] = weakref.ref(env)
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
            mslot = inter.slots.get(id(parent._module))
            if mslot is None:  # (not a module of the traced model: the Envoy's own message)
                envoy = parent._envoy
                if envoy is None:
                    raise OutsideTraceError(
                        f"{self._path} belongs to a model that is gone (at {user_location()}); "
                        "take .source from the model being traced")
                mslot = inter.slot_of(envoy)
            ops = run_of(inter).ops_of(mslot, parent._path)
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
                hit = med.interleaver._plan.sourced.get(id(parent._module))
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

    The Envoy keeps its view (its table of operations, and the names of the operations of the
    forward running in the trace), and the view holds the Envoy weakly: a strong reference back would be a cycle that
    kept the module (and its weights) alive after the model was dropped, until the garbage
    collector ran."""
    src = envoy.__dict__.get("_source_view")  # (LanguageModel's "_source" is its load path)
    if src is None:
        src = envoy.__dict__["_source_view"] = Source(envoy)
    src._enter()
    return src


__all__ = ["Source", "OpEnvoy", "FunctionSource", "source_of"]
