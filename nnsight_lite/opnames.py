"""The names nnsight 0.8 gives a forward's call operations, so ``.source`` accepts them too.

    numbered_like_08(fdef) -> ({id(call node): name}, {assignment's name: its line})

``.source`` names a call ``<dotted callee>_<n>`` with ``n`` counting that callee's calls, and a
chained call after the call it is chained to (``x.view(s).transpose(1, 2)`` ->
``x_view_0_transpose_0``): the naming nnsight's 0.5 documentation shows. nnsight 0.8 numbers
differently: an assignment ``x = ...`` is an operation too and shares its counter with calls of
the same name (``attention_interface = get(...)`` is ``attention_interface_0``, so the call
``attention_interface(...)`` after it is ``attention_interface_1``), and a chained call is named
by its trailing attributes only (``transpose_4``: the fifth ``.transpose(...)`` of the forward).
Those names are accepted as aliases of the same call operations wherever they do not name
another operation here (assignments are not operations here, so ``attention_interface_0``
stays the call); an assignment's 0.8 name is kept with its line, for the error that says so.

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
    function definition), and ``{0.8's name of an assignment: its line}``; every name in
    order is in ``_Numbering.order``, for checking."""
    numbering = _Numbering()
    numbering.visit(fdef)
    return numbering.calls, numbering.bound


class _Numbering(ast.NodeVisitor):
    def __init__(self):
        self.counts: dict[str, int] = {}
        self.calls: dict[int, str] = {}
        self.bound: dict[str, int] = {}  # an assignment's name -> the line of its target
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
            self._bind(node.targets[0], node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign):
        if node.value is not None:
            self.visit(node.value)
            self._bind(node.target, node.value)

    def _bind(self, target, value) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            if (isinstance(value, (ast.Tuple, ast.List)) and len(target.elts) == len(value.elts)
                    and not any(isinstance(e, ast.Starred) for e in (*target.elts, *value.elts))):
                for t, v in zip(target.elts, value.elts):
                    self._bind(t, v)
            return
        parts, rooted = _dotted(target)
        if rooted:
            self.bound[self._next("_".join(parts))] = target.lineno


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
