"""An opt-in allow-list for the bodies a shared deployment runs (``serve(..., policy=True)``).

Example::

    from nnsight_lite.remote.policy import check_body

    check_body("h = model.layer.output.save()\\nimport os\\n", "exp.py", 10)
    # PolicyError: exp.py:11: `import os`: a body may not import modules here ...

What it refuses, before anything runs, each with the file and line of the offending statement:

- ``import`` and ``from ... import`` (the names a body may use are the allow-list's);
- any dunder name or attribute (``x.__class__``, ``__builtins__``, ``def __init__``) and any
  private attribute (``torch._C``, ``envoy._module``);
- calling or naming a builtin outside :data:`SAFE_BUILTINS` (``open``, ``eval``, ``getattr``...)
  and calling a bare name that is neither allowed nor defined in the body itself;
- ``str.format``/``format_map`` (their templates reach attributes), ``class`` statements;
- reaching torch's file, code-loading and process machinery (``torch.load``, ``torch.save``,
  ``torch.hub``, ``torch.jit``, ``torch.ops``...) through ``torch`` or any name bound to it;
- with ``values`` given (the caller's values the body reads, after unpickling): anything but
  data (tensors, numbers, strings, dtypes, devices, slices, containers of those), the allowed
  modules, and the types the server adds (its references to the served model).

This narrows mistakes and casual misuse on a shared deployment. It is not a sandbox: Python
offers many ways around an allow-list, and unpickling a request already runs code the client
chose. Who may send requests at all is decided by Ray's authentication, not here.
"""

from __future__ import annotations

import ast
import builtins
import textwrap
import types
from typing import Iterable

import torch

from ..capture.parsing import parse
from ..errors import PolicyError

SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "bool", "chr", "complex", "dict", "divmod", "enumerate", "filter",
    "float", "format", "frozenset", "int", "isinstance", "issubclass", "iter", "len", "list",
    "map", "max", "min", "next", "ord", "pow", "print", "range", "repr", "reversed", "round",
    "set", "slice", "sorted", "str", "sum", "tuple", "zip", "True", "False", "None", "Ellipsis",
    "NotImplemented", "ArithmeticError", "AssertionError", "Exception", "IndexError", "KeyError",
    "LookupError", "RuntimeError", "StopIteration", "TypeError", "ValueError", "ZeroDivisionError",
})
MODULES = frozenset({"torch", "math", "nnsight_lite"})
DEFAULT_ALLOW = SAFE_BUILTINS | MODULES

# Attributes of torch (at any depth) a policy body may not reach: files, code loading, processes.
_TORCH_DENIED = frozenset({
    "load", "save", "hub", "jit", "ops", "classes", "package", "utils", "library", "compile",
    "multiprocessing", "distributed", "from_file", "backends", "export", "onnx", "serialization",
    "storage", "UntypedStorage", "TypedStorage", "cuda", "mps", "xpu", "profiler",
})
_DATA = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), slice, range,
         torch.Tensor, torch.dtype, torch.device, torch.Size)
_CONTAINERS = (list, tuple, set, frozenset)
_BUILTIN_NAMES = frozenset(dir(builtins))


def check_body(source: str, filename: str = "<body>", first_line: int = 1,
               allow: "Iterable[str] | None" = None, values: "dict | None" = None,
               value_types: tuple = ()) -> None:
    """Raise :class:`PolicyError` if ``source`` (a body, or a whole ``with`` block; indented is
    fine) does something the allow-list refuses; return None if it passes.

    ``first_line`` is the line ``source`` starts at in ``filename``, so errors cite the user's
    file and line. A whole ``with`` block is checked, header included: the server runs it too.
    ``allow`` replaces :data:`DEFAULT_ALLOW` (names a body may call or name: builtins and
    modules). ``values`` are the caller's values the body reads; each must be data,
    an allowed module, or an instance of ``value_types``.
    """
    allow = DEFAULT_ALLOW if allow is None else frozenset(allow)
    try:
        tree = parse(textwrap.dedent(source), filename)
    except SyntaxError as err:
        raise PolicyError(f"{filename}:{first_line + (err.lineno or 1) - 1}: the body does not "
                          f"parse: {err.msg}") from None
    checker = _Checker(source, filename, first_line, allow, values or {})
    checker.visit(tree)
    if values:
        _check_values(checker, values, value_types, allow)


class _Checker(ast.NodeVisitor):
    """One pass over a body's AST; the first refusal raises."""

    def __init__(self, source, filename, first_line, allow, values):
        self.lines = source.splitlines()
        self.filename = filename
        self.first_line = first_line
        self.allow = allow
        self.values = values
        self.first_use: dict = {}  # name -> the first node that reads it
        # names the body binds (assignments, loops, defs, arguments...): calling those is fine
        self.bound = set()
        # names that mean torch here (the allowed name, or a caller's alias of it)
        self.torch_names = {"torch"} if "torch" in allow else set()
        self.torch_names |= {k for k, v in values.items() if _is_torch(v)}

    # ---- reporting

    def refuse(self, node, what: str, instead: str):
        lineno = getattr(node, "lineno", 1)
        line = self.lines[lineno - 1].strip() if 0 < lineno <= len(self.lines) else ""
        raise PolicyError(f"{self.filename}:{self.first_line + lineno - 1}: `{line}`: {what}; "
                          f"{instead} (this deployment runs bodies under an allow-list policy)")

    # ---- the walk

    def visit_Module(self, node):
        for sub in ast.walk(node):  # bound names first, so order of definition does not matter
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                self.bound.add(sub.id)
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.bound.add(sub.name)
            elif isinstance(sub, ast.arg):
                self.bound.add(sub.arg)
            elif isinstance(sub, ast.ExceptHandler) and sub.name:
                self.bound.add(sub.name)
        self.generic_visit(node)

    def visit_Import(self, node):
        self.refuse(node, "a body may not import modules here",
                    "use the allowed modules (" + ", ".join(sorted(MODULES & self.allow)) + ") "
                    "by name, or bind what you need before the trace")

    visit_ImportFrom = visit_Import

    def visit_ClassDef(self, node):
        self.refuse(node, "a body may not define classes here",
                    "define plain functions in the body instead")

    def visit_FunctionDef(self, node):
        if _dunder(node.name):
            self.refuse(node, f"`{node.name}` is a dunder name", "use an ordinary name")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node):
        attr = node.attr
        if attr.startswith("_"):
            self.refuse(node, f"`.{attr}` is a private or dunder attribute",
                        "use the public API (module values through .output/.input, tensors "
                        "through their methods)")
        if attr in ("format", "format_map"):
            self.refuse(node, f"`.{attr}(...)` templates can reach any attribute",
                        "use an f-string")
        if attr in _TORCH_DENIED and self._is_torch_chain(node.value):
            self.refuse(node, f"`torch.{attr}` reaches files, code loading or processes",
                        "keep to tensor operations")
        self.generic_visit(node)

    def visit_Name(self, node):
        name = node.id
        self.first_use.setdefault(name, node)
        if _dunder(name):
            self.refuse(node, f"`{name}` is a dunder name", "use an ordinary name")
        if (isinstance(node.ctx, ast.Load) and name in _BUILTIN_NAMES and name not in self.allow
                and name not in self.bound and name not in self.values):
            self.refuse(node, f"the builtin `{name}` is not on the allow-list",
                        "allowed builtins: " + ", ".join(sorted(SAFE_BUILTINS & self.allow)))

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Name):
            name = func.id
            if name not in self.allow and name not in self.bound and name not in self.values:
                if name in _BUILTIN_NAMES:
                    self.visit_Name(func)  # the builtin's own message
                self.refuse(node, f"`{name}(...)` calls a name that is not on the allow-list "
                                  "and not defined in the body",
                            "define the function inside the body, or call an allowed one")
        self.generic_visit(node)

    def _is_torch_chain(self, node) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in self.torch_names \
            and node.id not in self.bound


def _check_values(checker: _Checker, values: dict, value_types: tuple, allow) -> None:
    for name, value in values.items():
        why = _why_not_data(value, value_types, allow, depth=0)
        if why is not None:
            node = checker.first_use.get(name)
            where = node if node is not None else ast.Pass(lineno=1)
            checker.refuse(where, f"the caller's `{name}` is {why}",
                           "pass only data (tensors, numbers, strings, containers of those) and "
                           "define functions inside the body")


def _why_not_data(value, value_types, allow, depth):
    if isinstance(value, _DATA) or (value_types and isinstance(value, value_types)):
        return None
    if depth > 20:
        return "nested too deeply"
    if isinstance(value, _CONTAINERS):
        for item in value:
            why = _why_not_data(item, value_types, allow, depth + 1)
            if why is not None:
                return why
        return None
    if isinstance(value, dict):
        for item in (*value.keys(), *value.values()):
            why = _why_not_data(item, value_types, allow, depth + 1)
            if why is not None:
                return why
        return None
    if isinstance(value, types.ModuleType):
        if _allowed_path(value.__name__, allow):
            return None
        return f"the module {value.__name__}, which is not allowed"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        # torch.relu or nnsight_lite.save bound to a name: fine; the user's own code is not
        module = getattr(value, "__module__", None) or ""
        if _allowed_path(f"{module}.{value.__name__}", allow):
            return None
        return f"a function from {module or 'unknown code'}, which the policy cannot check"
    return f"a {type(value).__name__}, which is not data"


def _allowed_path(dotted: str, allow) -> bool:
    """``torch.nn.functional`` yes; ``torch.hub``, ``torch._C``, ``os`` no."""
    parts = dotted.split(".")
    return (parts[0] in allow and parts[0] in MODULES
            and not any(p.startswith("_") for p in parts[1:])
            and not (parts[0] == "torch" and set(parts[1:]) & _TORCH_DENIED))


def _is_torch(value) -> bool:
    return isinstance(value, types.ModuleType) and value.__name__.split(".")[0] == "torch"


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")
