"""Operations inside a module's forward: ``envoy.source.<op>.output``.

    Source          the operations of one module's forward; ``print`` it to see their names
    OpEnvoy         one operation: .output .input .inputs .next() .skip() .source
    FunctionSource  the operations of the function an operation calls (nested ``.source``)
    compiled(func)  a function's instrumented code and op names, built once per code object
    SourceRun       per trace: the forwards running instrumented and their operations' slots

How it works. ``compiled`` parses a forward's source and rewrites every call ``f(a, k=v)``
into ``__nnsight_op__(i, f, a, k=v)``, where ``i`` numbers the call site. The code is compiled
once per code object, inside a shell function whose parameters are the helper and the
original's free variables, so each use makes a function with the original globals, closure
cells and defaults plus its own helper. A forward runs instrumented only in a trace whose
bodies ask for its operations: the trace's counting wrapper calls ``slot.orig``, which is set to
the instrumented forward for that trace and put back when it ends, so nothing on the module
changes and a forward nobody asks about runs as it is.

The helper counts every call of every operation of an instrumented forward (as the counting
wrapper does for modules) and serves waiting bodies through the interleaver's own
``_serve_input``/``_serve_output``, with each operation's :class:`OpSlot`. So operations obey
the same ordering, ``.next()``/``tracer.iter`` and batch-slicing rules as modules.

Names follow nnsight: the dotted callee joined by ``_`` plus a per-name index in the order
calls are evaluated (inner calls first): ``self.c_proj(x)`` -> ``self_c_proj_0``,
``torch.matmul`` -> ``torch_matmul_0``, ``self.c_attn(x).split(...)`` -> ``self_c_attn_0_split_0``.
"""

from __future__ import annotations

import ast
import difflib
import functools
import inspect
import textwrap
import types
import weakref

import torch

from .errors import ModulePathError, OutOfOrderError, SourceUnavailableError
from .calls import Slot
from .mediator import INPUT, current_mediator
from .opnames import numbered_like_08
from .workers import _getcurrent, user_location

HELPER = "__nnsight_op__"
# Calls that read the calling frame: routed through a helper they would read the wrong one.
_FRAME_CALLS = frozenset({"super", "locals", "globals", "vars", "dir", "eval", "exec",
                          "_getframe", "currentframe"})


# --------------------------------------------------------------------------- compiling


class Compiled:
    """A function's instrumented code: op ``names`` (in call-site index order) and where each
    op is in the source (``spans``: first and last line, file numbering)."""

    __slots__ = ("code", "names", "spans", "lines", "first", "filename", "qualname", "index",
                 "aliases")

    def __init__(self, code, names, spans, lines, first, filename, qualname, aliases=None):
        self.code = code
        self.names = names
        self.spans = spans
        self.lines = lines  # the source lines, as in the file
        self.first = first  # the file line number of lines[0]
        self.filename = filename
        self.qualname = qualname
        self.index = {n: i for i, n in enumerate(names)}
        #: nnsight 0.8's names of the same operations, where they differ (opnames.py)
        self.aliases = {a: n for a, n in (aliases or {}).items() if a not in self.index}

    def resolve(self, name: str) -> str:
        """``name``, or the operation it is nnsight 0.8's name for."""
        return name if name in self.index else self.aliases.get(name, name)

    def listing(self, title: str) -> str:
        """The source with each operation's name beside the line where its call starts."""
        at = {}
        for name, (start, _) in zip(self.names, self.spans):
            at.setdefault(start, []).append(name)
        width = max([len(n) for n in self.names] + [4])
        out = [f"{title}: {self.qualname} ({self.filename}:{self.first})", ""]
        for i, text in enumerate(self.lines):
            line = self.first + i
            names = at.get(line, ())
            text = text.rstrip("\n")
            if not names:
                out.append(f"  {'':{width}}    {line:>5}  {text}")
                continue
            out.append(f"  {names[0]:{width}} -> {line:>5}  {text}")
            for extra in names[1:]:
                out.append(f"  {extra:{width}} -> {'+':>5}")
        return "\n".join(out)

    def context(self, title: str, name: str, around: int = 3) -> str:
        """The lines around operation ``name``, its own lines marked ``-->``."""
        start, end = self.spans[self.index[name]]
        lo = max(self.first, start - around)
        hi = min(self.first + len(self.lines) - 1, end + around)
        out = [f"{title}:", ""]
        for line in range(lo, hi + 1):
            text = self.lines[line - self.first].rstrip("\n")
            mark = "-->" if start <= line <= end else "   "
            out.append(f"  {mark} {line:>5}  {text}")
        return "\n".join(out)


class _Rewriter(ast.NodeTransformer):
    def __init__(self, numbered_08: dict):
        self.counts: dict[str, int] = {}
        self.names: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self.numbered_08 = numbered_08  # id(call node) -> nnsight 0.8's name (opnames.py)
        self.aliases: dict[str, str] = {}

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)  # func, then args: inner calls are numbered first
        func = node.func
        if (isinstance(func, ast.Name) and func.id in _FRAME_CALLS) or (
            isinstance(func, ast.Attribute) and func.attr in _FRAME_CALLS
        ):
            return node
        base = _callee(func) or "call"
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        name = f"{base}_{n}"
        index = len(self.names)
        self.names.append(name)
        alias = self.numbered_08.get(id(node))
        if alias is not None and alias != name:
            self.aliases[alias] = name
        self.spans.append((node.lineno, node.end_lineno or node.lineno))
        new = ast.Call(
            func=ast.Name(HELPER, ast.Load()),
            args=[ast.Constant(index), func, *node.args],
            keywords=node.keywords,
        )
        new._nnsight_op = name
        return ast.copy_location(new, node)


def _callee(node) -> str:
    """The dotted name of a callee, ``_``-joined (``self.c_attn`` -> ``self_c_attn``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _callee(node.value)
        return f"{base}_{node.attr}" if base else node.attr
    if isinstance(node, ast.Call):  # a chained call: the inner operation's name
        return getattr(node, "_nnsight_op", None) or _callee(node.func)
    if isinstance(node, ast.Subscript):
        return _callee(node.value)
    return ""


_cache: "weakref.WeakKeyDictionary[types.CodeType, Compiled]" = weakref.WeakKeyDictionary()


def compiled(func: types.FunctionType) -> Compiled:
    """The instrumented code of ``func`` (cached per code object). Raises
    SourceUnavailableError where the source cannot be found or does not match."""
    code = func.__code__
    hit = _cache.get(code)
    if hit is not None:
        return hit
    try:
        lines, first = inspect.getsourcelines(code)
    except (OSError, TypeError) as exc:
        raise SourceUnavailableError(
            f"the source of {func.__qualname__} cannot be found ({exc}), so its operations "
            "cannot be listed or traced; read the values of its submodules instead"
        ) from None
    first = max(first, 1)
    text = textwrap.dedent("".join(lines))
    tree = ast.parse(text)
    ast.increment_lineno(tree, first - 1)
    fdef = tree.body[0]
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise SourceUnavailableError(
            f"the source found for {func.__qualname__} is not a function definition "
            f"({code.co_filename}:{first}); its operations cannot be traced"
        )
    numbered_08 = numbered_like_08(fdef)
    fdef.decorator_list = []  # the rewrite replaces the function the decorators wrapped
    rw = _Rewriter(numbered_08)
    fdef = rw.visit(fdef)
    params = ", ".join((HELPER,) + code.co_freevars)
    shell = ast.parse(f"def __nnsight_shell__({params}):\n    pass").body[0]
    shell.body = [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))]
    module = ast.Module(body=[shell], type_ignores=[])
    ast.fix_missing_locations(module)
    top = compile(module, code.co_filename, "exec", dont_inherit=True)
    inner = _find_code(_find_code(top, "__nnsight_shell__"), fdef.name)
    n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS) \
        + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    if inner is None or inner.co_varnames[:n] != code.co_varnames[:n]:
        raise SourceUnavailableError(
            f"the source of {func.__qualname__} at {code.co_filename}:{first} does not match "
            "the running code (was the file edited after it was imported?); its operations "
            "cannot be traced"
        )
    result = Compiled(inner, tuple(rw.names), tuple(rw.spans), lines, first,
                      code.co_filename, func.__qualname__, rw.aliases)
    _cache[code] = result
    _cache[inner] = result  # the instrumented function lists the same operations
    return result


def _find_code(code, name):
    for c in code.co_consts:
        if isinstance(c, types.CodeType) and c.co_name == name:
            return c
    return None


def _layers(func) -> list:
    """``func`` and the functions it wraps, outermost first, as long as each wrapper holds the
    function it wraps in a closure cell (``functools.wraps`` decorators): the last is the one
    instrumented, the others are rebuilt around it so their behaviour still runs."""
    chain = [func]
    while True:
        inner = getattr(chain[-1], "__wrapped__", None)
        cells = getattr(chain[-1], "__closure__", None) or ()
        if not isinstance(inner, types.FunctionType) or not any(
            _contents(c) is inner for c in cells
        ):
            return chain
        chain.append(inner)


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _rebuild(func, closure, code=None):
    new = types.FunctionType(code or func.__code__, func.__globals__, func.__name__,
                             func.__defaults__, closure)
    new.__kwdefaults__ = func.__kwdefaults__
    new.__qualname__ = func.__qualname__
    new.__doc__ = func.__doc__
    new.__dict__.update(func.__dict__)
    return new


def instrument(func, helper):
    """``func`` (a plain function, maybe decorated) rebuilt to route its calls through
    ``helper``; returns ``(new function, Compiled of the instrumented layer)``."""
    chain = _layers(func)
    inner = chain[-1]
    comp = compiled(inner)
    own = dict(zip(inner.__code__.co_freevars, inner.__closure__ or ()))
    own[HELPER] = types.CellType(helper)
    new = _rebuild(inner, tuple(own[v] for v in comp.code.co_freevars), comp.code)
    for outer, wrapped in zip(reversed(chain[:-1]), reversed(chain[1:])):
        cells = tuple(types.CellType(new) if _contents(c) is wrapped else c
                      for c in outer.__closure__)
        inner_new = new
        new = _rebuild(outer, cells)
        new.__wrapped__ = inner_new
    return new, comp


def _function_of(callable_):
    """``(plain function, self or None)`` behind a forward, or ``(None, None)``."""
    if isinstance(callable_, types.MethodType) and isinstance(callable_.__func__, types.FunctionType):
        return callable_.__func__, callable_.__self__
    if isinstance(callable_, types.FunctionType):
        return callable_, None
    return None, None


def _accelerate_body(module: torch.nn.Module, forward):
    """The forward an accelerate hook (``device_map=...`` dispatch, ``add_hook_to_module``)
    wraps on ``module``: its ``_old_forward``, which the hook's wrapper calls between its
    pre- and post-forward; else None."""
    if getattr(module, "_hf_hook", None) is None or not isinstance(forward, functools.partial):
        return None
    old = module.__dict__.get("_old_forward")
    return old if _function_of(old)[0] is not None else None


def _module_function(module: torch.nn.Module):
    """The function a module's forward runs (an instance ``forward`` if one is set)."""
    forward = module.forward
    wrapped = getattr(forward, "__wrapped__", None)
    if isinstance(wrapped, Slot):  # the trace's counting wrapper
        forward = wrapped.orig
    forward = _accelerate_body(module, forward) or forward
    func, _ = _function_of(forward)
    if func is None:
        raise SourceUnavailableError(
            f"{type(module).__name__}.forward is {type(module.forward).__name__}, not a Python "
            "function, so its operations cannot be traced"
        )
    return _layers(func)[-1]


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
        if mslot.calls:
            raise OutOfOrderError(
                f"{path} was first used at {user_location()}, after {path[:-7]} had already "
                f"run {mslot.calls} time(s) in this trace without its operations being counted. "
                f"Touch {path} at the top of the body (before reading any value the model "
                "computes), so its operations are counted from the start of the forward."
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
    forward run instrumented for that trace; other modules run their own forward unchanged.
    """

    def __init__(self, envoy):
        d = self.__dict__
        d["_envoy"] = envoy
        d["_path"] = f"{envoy._path}.source"
        d["_ops"] = {}

    def _compiled(self) -> Compiled:
        return compiled(_module_function(self._envoy._module))

    def _enter(self) -> None:
        """Inside a body of a trace of this module's model: run its forward instrumented."""
        med = getattr(_getcurrent(), "mediator", None)
        if med is None:
            return
        inter = med.interleaver
        mslot = inter.slots.get(id(self._envoy._module))
        if mslot is not None:
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
                f"{self._path} has no operation {name!r} (at {user_location()}).{_near(name, names)} "
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
            if slot.calls:
                raise OutOfOrderError(
                    f"{self._path}.source was first used at {user_location()}, after "
                    f"{self._path} had already run {slot.calls} time(s) in this trace. Use "
                    f"{self._path}.source at the top of the body (before reading any value "
                    "the model computes), so its operations are counted from the start."
                )
            slot.drill = True
        med.get(self, INPUT)
        if slot.error is not None:
            raise SourceUnavailableError(f"{slot.error} (at {user_location()})")
        return FunctionSource(self, slot.comp)

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
                f"{self._path} has no operation {name!r} (at {user_location()}).{_near(name, names)} "
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
    """``envoy.source``: made once per Envoy; inside a body it instruments the module's forward
    for the running trace, so its operations are counted from the start."""
    src = envoy.__dict__.get("_source_view")  # (LanguageModel's "_source" is its load path)
    if src is None:
        src = envoy.__dict__["_source_view"] = Source(envoy)
    src._enter()
    return src
