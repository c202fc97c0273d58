"""Compiling a forward with its calls as operations (what ``.source`` runs).

``compiled(func)`` parses a function's source and rewrites every call ``f(a, k=v)`` into
``__nnsight_op__(i, f, a, k=v)``, where ``i`` numbers the call site; ``instrument(func, helper)``
makes a function that runs that code with the original's globals, closure cells and defaults
and ``helper`` for ``__nnsight_op__``. The code is compiled once per code object, inside a shell
function whose parameters are the helper and the original's free variables. The helper and the
operations' slots are in source_run.py, the user-facing objects in source.py.

Names follow nnsight: the dotted callee joined by ``_`` plus a per-name index in the order
calls are evaluated (inner calls first): ``self.c_proj(x)`` -> ``self_c_proj_0``,
``torch.matmul`` -> ``torch_matmul_0``, ``self.c_attn(x).split(...)`` -> ``self_c_attn_0_split_0``.
An assignment is an operation too (each pair of ``a, b = c, d``), under nnsight 0.8's name for
it (``h = h * 2`` -> ``h_1`` after an earlier ``h = ...``, see opnames.py), unless a call has
that name here: its value is routed through the helper (``__nnsight_op__(i, None, value)``).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
import types
import weakref

import torch

from .capture.parsing import fix_locations, parse
from .capture.weak import keep_weakly
from .calls import traced_slot
from .errors import SourceUnavailableError
from .opnames import numbered_like_08

HELPER = "__nnsight_op__"
# Calls that read the calling frame: routed through a helper they would read the wrong one.
_FRAME_CALLS = frozenset({"super", "locals", "globals", "vars", "dir", "eval", "exec",
                          "_getframe", "currentframe"})


class Compiled:
    """A function's instrumented code: op ``names`` (in call-site index order) and where each
    op is in the source (``spans``: first and last line, file numbering)."""

    __slots__ = ("code", "names", "spans", "lines", "first", "filename", "qualname", "index",
                 "aliases", "assigned", "__weakref__")

    def __init__(self, code, names, spans, lines, first, filename, qualname, aliases=None,
                 assigned=None):
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
        #: nnsight 0.8's names of assignments that are no operations here (where a call has
        #: the name, the call is meant): name -> line, for the error that says so (``unknown``)
        self.assigned = {a: line for a, line in (assigned or {}).items()
                         if a not in self.index and a not in self.aliases}

    def resolve(self, name: str) -> str:
        """``name``, or the operation it is nnsight 0.8's name for."""
        return name if name in self.index else self.aliases.get(name, name)

    def unknown(self, name: str) -> str:
        """Why ``name`` names no operation of this function, where it is nnsight 0.8's name of
        an assignment (else "")."""
        line = self.assigned.get(name)
        if line is None:
            return ""
        text = self.lines[line - self.first].strip() if 0 <= line - self.first < len(
            self.lines) else ""
        calls = [n for n, (start, end) in zip(self.names, self.spans) if start <= line <= end]
        there = (f" the calls on that line are {', '.join(calls)}: the last one's .output is "
                 "usually the value assigned;" if calls else "")
        return (f" nnsight 0.8 names the assignment on line {line} ({text!r}) {name}, which is "
                f"no operation here:{there} the operation that uses the value next has it as "
                "its .input.")

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
    def __init__(self, numbered_08: dict, statements_08: "dict | None" = None,
                 calls: frozenset = frozenset()):
        self.counts: dict[str, int] = {}
        self.names: list[str] = []
        self.spans: list[tuple[int, int]] = []
        self.numbered_08 = numbered_08  # id(call node) -> nnsight 0.8's name (opnames.py)
        self.aliases: dict[str, str] = {}
        # id(one-target assignment) -> its 0.8 name, made an operation unless ``calls`` (the
        # names of the calls here) has that name
        self.statements_08 = statements_08 or {}
        self.calls = calls

    def visit_Assign(self, node):
        self.generic_visit(node)  # (its calls first: they run before the value is bound)
        for path, name in self.statements_08.get(id(node), ()):
            if name in self.calls:
                continue
            if not path:
                node.value = self._assignment(name, node.value, node)
                continue
            seq = node.value  # (a pairwise ``a, b = c, d``: each element its own operation)
            for k in path[:-1]:
                seq = seq.elts[k]
            seq.elts[path[-1]] = self._assignment(name, seq.elts[path[-1]], node)
        return node

    visit_AnnAssign = visit_Assign  # (only those with a value are in statements_08)

    def _assignment(self, name: str, value, node) -> ast.Call:
        """``value`` (of assignment ``node``) routed through the helper as operation ``name``,
        whose "call" is the value itself (``fn`` None): its .input and .output are the value
        assigned, and a body's replacement of the output is what gets bound."""
        index = len(self.names)
        self.names.append(name)
        self.spans.append((node.lineno, node.lineno))
        new = ast.Call(func=ast.Name(HELPER, ast.Load()),
                       args=[ast.Constant(index), ast.Constant(None), value], keywords=[])
        return ast.copy_location(new, value)

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


#: id(code object) -> (weak reference to it, its Compiled): a function's code gives its Compiled
#: (held while that code lives), the instrumented code the same Compiled (held weakly: the
#: Compiled holds that code, so a strong entry would keep both for good). Keyed by identity:
#: code objects compare equal without their file, so a class a notebook cell defines again
#: (or the same class in two files) would find, and replace, another code object's entry.
_cache: "dict[int, tuple]" = {}


def _remember(code: types.CodeType, comp, weak: bool = False) -> None:
    keep_weakly(_cache, id(code), code, weakref.ref(comp) if weak else comp)


def _cached(code: types.CodeType) -> "Compiled | None":
    entry = _cache.get(id(code))
    if entry is None or entry[0]() is not code:
        return None
    comp = entry[1]
    return comp() if isinstance(comp, weakref.ref) else comp


def compiled(func: types.FunctionType) -> Compiled:
    """The instrumented code of ``func`` (cached per code object). Raises
    SourceUnavailableError where the source cannot be found or does not match."""
    code = func.__code__
    hit = _cached(code)
    if hit is not None:
        return hit
    if HELPER in code.co_freevars:  # (its Compiled is held while its original code lives)
        raise SourceUnavailableError(
            f"{func.__qualname__} is an instrumented forward whose original function is gone; "
            "its operations cannot be listed again"
        )
    try:
        lines, first = inspect.getsourcelines(code)
    except (OSError, TypeError) as exc:
        raise SourceUnavailableError(
            f"the source of {func.__qualname__} cannot be found ({exc}), so its operations "
            "cannot be listed or traced; read the values of its submodules instead"
        ) from None
    first = max(first, 1)
    text = textwrap.dedent("".join(lines))
    tree = parse(text)
    ast.increment_lineno(tree, first - 1)
    fdef = tree.body[0]
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise SourceUnavailableError(
            f"the source found for {func.__qualname__} is not a function definition "
            f"({code.co_filename}:{first}); its operations cannot be traced"
        )
    numbered_08, assigned_08, statements_08 = numbered_like_08(fdef)
    fdef.decorator_list = []  # the rewrite replaces the function the decorators wrapped
    calls = _Rewriter({})  # (the calls' names first: an assignment named like one is not an op)
    calls.visit(copy.deepcopy(fdef))
    rw = _Rewriter(numbered_08, statements_08, frozenset(calls.names))
    fdef = rw.visit(fdef)
    params = ", ".join((HELPER,) + code.co_freevars)
    shell = parse(f"def __nnsight_shell__({params}):\n    pass").body[0]
    shell.body = [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))]
    module = ast.Module(body=[shell], type_ignores=[])
    fix_locations(module)
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
                      code.co_filename, func.__qualname__, rw.aliases, assigned_08)
    _remember(code, result)
    _remember(inner, result, weak=True)  # the instrumented function lists the same operations
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
    # (the partial first, then the instance dict, where accelerate sets ``_hf_hook``: a miss
    # through Module.__getattr__ builds and drops an AttributeError, ~7K instructions)
    if not isinstance(forward, functools.partial) or module.__dict__.get("_hf_hook") is None:
        return None
    old = module.__dict__.get("_old_forward")
    return old if _function_of(old)[0] is not None else None


def _module_function(module: torch.nn.Module):
    """The function a module's forward runs (an instance ``forward`` if one is set)."""
    forward = module.forward
    wrapped = traced_slot(forward)
    if wrapped is not None:  # the trace's counting wrapper
        forward = wrapped.orig
    forward = _accelerate_body(module, forward) or forward
    func, _ = _function_of(forward)
    if func is None:
        raise SourceUnavailableError(
            f"{type(module).__name__}.forward is {type(module.forward).__name__}, not a Python "
            "function, so its operations cannot be traced"
        )
    return _layers(func)[-1]


def code_qualname(code: types.CodeType, globs: dict) -> str:
    """``code``'s qualified name: ``co_qualname`` (3.11+); on 3.10, which has none, the same
    name found from the functions and classes of ``globs`` whose code nests it (a decorator's
    wrapper: ``dispatch.<locals>.wrapper``), else its plain name."""
    name = getattr(code, "co_qualname", None)
    return name if name is not None else _nested_name(code, globs)


def _nested_name(code: types.CodeType, globs: dict) -> str:
    """``code_qualname`` without ``co_qualname``: found through the code nesting it."""

    def find(outer: types.CodeType, prefix: str):
        sep = ".<locals>." if outer.co_flags & inspect.CO_OPTIMIZED else "."
        for const in outer.co_consts:
            if isinstance(const, types.CodeType):
                here = prefix + sep + const.co_name
                found = here if const is code else find(const, here)
                if found is not None:
                    return found
        return None

    todo, seen = list(globs.values()), set()
    while todo:  # the module's functions, and those of its classes (nested ones too)
        value = todo.pop()
        if isinstance(value, type):
            if value.__module__ == globs.get("__name__") and id(value) not in seen:
                seen.add(id(value))
                todo.extend(vars(value).values())
            continue
        inner = getattr(value, "__code__", None)  # (a wraps wrapper's __qualname__ is the
        if isinstance(inner, types.CodeType) and not hasattr(value, "__wrapped__"):  # other's)
            qual = getattr(value, "__qualname__", inner.co_name)
            found = qual if inner is code else find(inner, qual)
            if found is not None:
                return found
    return code.co_name
