"""The names nnsight 0.8 gives a forward's call operations, so ``.source`` accepts them too.

    numbered_like_08(fdef) -> ({id(call node): name}, {assignment's name: its line},
                               {id(assignment statement): [(where in its value, name)]})

``.source`` names a call ``<dotted callee>_<n>`` with ``n`` counting that callee's calls, and a
chained call after the call it is chained to (``x.view(s).transpose(1, 2)`` ->
``x_view_0_transpose_0``): the naming nnsight's 0.5 documentation shows. nnsight 0.8 numbers
differently: an assignment ``x = ...`` is an operation too and shares its counter with calls of
the same name (``attention_interface = get(...)`` is ``attention_interface_0``, so the call
``attention_interface(...)`` after it is ``attention_interface_1``), and a chained call is named
by its trailing attributes only (``transpose_4``: the fifth ``.transpose(...)`` of the forward).
Those names are accepted as aliases of the same call operations wherever they do not name
another operation here. An assignment (``x = ...``, ``self.x = ...``, ``x[i] = ...``, each pair
of ``a, b = c, d``) is an operation too under its 0.8 name, where that is not the name of a call
here (``attention_interface_0`` stays the call); those are kept with their line, for the error
that says so.

The numbering follows execution order: a call's callee and arguments are numbered before the
call; an assignment's value before its targets, and the binding after both; ``a, b = c, d``
binds pairwise; ``a = b = v`` and tuple unpacking of one value bind nothing; an annotated
assignment binds only with a value; ``super()`` with no arguments is not an operation.
"""

from __future__ import annotations

import ast

__all__ = ["numbered_like_08"]


def numbered_like_08(fdef: ast.AST) -> tuple:
    """``{id(call node): nnsight 0.8's name}`` for every call in ``fdef`` (an unrewritten
    function definition), ``{0.8's name of an assignment: its line}``, and ``{id(assignment
    statement): [(path, 0.8 name)]}`` for what each statement binds, ``path`` the indices of
    the value's element in nested tuples (``()``: the whole value); every name in order is in
    ``_Numbering.order``, for checking."""
    numbering = _Numbering()
    numbering.visit(fdef)
    return numbering.calls, numbering.bound, numbering.statements


class _Numbering(ast.NodeVisitor):
    def __init__(self):
        self.counts: dict[str, int] = {}
        self.calls: dict[int, str] = {}
        self.bound: dict[str, int] = {}  # an assignment's name -> the line of its target
        self.statements: dict[int, list] = {}  # id(an assignment) -> [(path, name)]
        self.order: list[str] = []  # every name, calls and bindings, as numbered

    def _next(self, base: str) -> str:
        n = self.counts.get(base, 0)
        self.counts[base] = n + 1
        name = f"{base}_{n}"
        self.order.append(name)
        return name

    def visit_Call(self, node: ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id == "super" and not (node.args or node.keywords):
            return
        self.generic_visit(node)
        parts, _ = _dotted(func)
        self.calls[id(node)] = self._next("_".join(parts) or "call")

    def visit_Assign(self, node: ast.Assign):
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)
        if len(node.targets) == 1:
            self._bind(node.targets[0], node.value, node)

    def visit_AnnAssign(self, node: ast.AnnAssign):
        if node.value is not None:
            self.visit(node.value)
            self._bind(node.target, node.value, node)

    def _bind(self, target, value, statement, path=()) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            if (isinstance(value, (ast.Tuple, ast.List)) and len(target.elts) == len(value.elts)
                    and not any(isinstance(e, ast.Starred) for e in (*target.elts, *value.elts))):
                for k, (t, v) in enumerate(zip(target.elts, value.elts)):
                    self._bind(t, v, statement, (*path, k))
            return
        parts, rooted = _dotted(target)
        if rooted:
            name = self._next("_".join(parts))
            self.bound[name] = target.lineno
            self.statements.setdefault(id(statement), []).append((path, name))


def _dotted(expr) -> tuple:
    """The attribute names of ``expr`` down to its root name (subscripts skipped), and whether
    it ends at a name: ``self.a[i].b`` -> (['self', 'a', 'b'], True); ``f(x).t`` -> (['t'],
    False)."""
    parts = []
    while True:
        if isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        elif isinstance(expr, ast.Subscript):
            expr = expr.value
        elif isinstance(expr, ast.Name):
            parts.append(expr.id)
            return parts[::-1], True
        else:
            return parts[::-1], False
