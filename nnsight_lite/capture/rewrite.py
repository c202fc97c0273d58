"""Body rewrites: what a captured with-block body is compiled into.

    rewrite_body(stmts)   the body's statements with the rewrites below applied
    assigned_names(stmts) every name a block may bind (a superset is fine)
    scope_names(stmts)    the names a block binds in its own scope (not in the functions,
                          classes and comprehensions it defines)
    body_syntax_error     a BodySyntaxError that says why a body does not compile
    class_body_name       ``NAME_NAME(name)`` at run time
    IterationEnd          thrown into a body waiting in ``tracer.iter`` when the model is done

The ``*_NAME`` constants are the names the rewritten code calls; a body's Scope maps them to
the runtime's functions (see context.RUNTIME).
"""

from __future__ import annotations

import ast
import sys

from ..errors import BodySyntaxError

#: Name under which compiled bodies find the exception that ends an open-ended ``tracer.iter``.
ITER_END_NAME = "__nnsight_lite_iter_end__"
#: Name under which compiled bodies find ``save``: ``x.save()`` in a body becomes ``save(x)``,
#: so tuples, dicts and model-output objects can be saved like tensors.
SAVE_NAME = "__nnsight_lite_save__"
#: ``x.grad`` in a body becomes ``GRAD_NAME(x)`` and ``x.grad = g`` becomes ``SET_GRAD_NAME(x, g)``,
#: so gradients can be answered as backprop reaches them (see backward.py).
GRAD_NAME = "__nnsight_lite_grad__"
SET_GRAD_NAME = "__nnsight_lite_set_grad__"
#: Every ``with`` block inside a compiled body becomes ``with ...: if INLINE_NAME(): <body>``, so a
#: trace, invoke or backward context opened *inside* a body skips its block with a flag
#: (see ``skip_inline``) instead of a line tracer and an exception: cheaper by about a
#: microsecond per block. Any other context manager's block runs as written.
INLINE_NAME = "__nnsight_lite_inline__"
#: ``with tracer.iter[...] as step:`` / ``with tracer.all():`` (nnsight's older block form) in a
#: body becomes ``for step in ITER_BLOCK_NAME(tracer.iter[...]):`` (see _IterLoopGuard).
ITER_BLOCK_NAME = "__nnsight_lite_iter_block__"
#: A name read in a class body inside a body becomes ``NAME_NAME("name")``: class bodies look up
#: globals in a plain dict, which would never reach the caller's names (see _ClassNames).
NAME_NAME = "__nnsight_lite_name__"


class IterationEnd(Exception):
    """Thrown into a body waiting inside ``tracer.iter``/``tracer.all()`` when the model is done."""


def rewrite_body(stmts: list) -> list:
    """``stmts`` (a with-block's body; rewritten in place, pass a copy) with every rewrite applied."""
    return [_ClassNames().visit(_Rewrite().visit(_IterLoopGuard().visit(stmt))) for stmt in stmts]


def assigned_names(stmts) -> tuple:
    """Names a block may bind: assignment targets, imports, defs, classes (nested ones too)."""
    names = set()
    for stmt in stmts:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.ExceptHandler) and n.name:
                names.add(n.name)
    return tuple(sorted(names))


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def scope_names(stmts) -> frozenset:
    """The names a block binds in the scope it runs in: ``assigned_names`` without those bound
    only inside the functions, classes, lambdas and comprehensions it defines (their own
    scopes), so that a later invoke waits only for names an earlier one really binds."""
    names = set()
    todo = list(stmts)
    while todo:
        n = todo.pop()
        if isinstance(n, _DEFS):
            names.add(n.name)
            continue
        if isinstance(n, ast.Lambda):
            continue
        if isinstance(n, _COMPREHENSIONS):  # (a walrus in one binds in the enclosing scope)
            names.update(w.target.id for w in ast.walk(n) if isinstance(w, ast.NamedExpr))
            continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
        todo.extend(ast.iter_child_nodes(n))
    return frozenset(names)



def body_syntax_error(exc: SyntaxError, what: str, filename: str, lineno: int):
    msg = exc.msg or ""
    if "return" in msg or "yield" in msg or "await" in msg:
        stmt = "return" if "return" in msg else ("yield" if "yield" in msg else "await")
        hint = (
            f"`{stmt}` cannot appear in a `with ...{what}(...)` body, which runs as its own block "
            "of code: save the values you need with .save() and return after the block "
            "(use tracer.stop() to end the model's forward early)"
        )
    elif msg.startswith("no binding for nonlocal"):
        name = msg.split("'")[1] if msg.count("'") >= 2 else "the name"
        hint = (
            f"`nonlocal {name}` in a function defined in a `with ...{what}(...)` body finds no "
            f"variable to bind: the body runs as its own block of code, so its names (and the "
            f"enclosing function's) are not local variables a nested function can rebind. Keep "
            f"the value in a mutable object instead ({name} = [0] ... {name}[0] += 1) or pass it "
            "in and return it"
        )
    elif "loop" in msg:
        hint = (
            f"`break`/`continue` cannot cross a `with ...{what}(...)` body; finish the block "
            "and break after it"
        )
    else:
        hint = f"the body of the `with ...{what}(...)` block does not compile: {msg}"
    err = BodySyntaxError(  # (SyntaxError's str() adds the file's name and line: not here)
        f"{hint}; the `with` block starts at line {lineno}",
        (filename, exc.lineno, exc.offset, exc.text),
    )
    return err


def _names_steps(it) -> bool:
    """Whether expression ``it`` reads like ``<x>.iter[...]`` or ``<x>.all()``."""
    if isinstance(it, ast.Subscript):
        return isinstance(it.value, ast.Attribute) and it.value.attr == "iter"
    return (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
            and it.func.attr == "all" and not it.args and not it.keywords)


class _IterLoopGuard(ast.NodeTransformer):
    """Wrap ``for ... in tracer.iter[...]`` / ``tracer.all()`` loops so the end of the model's
    calls ends the loop cleanly and the code after it still runs.

    The block form ``with tracer.iter[...] as step: ...`` becomes the same loop over
    ``ITER_BLOCK_NAME(tracer.iter[...])``, which runs a ``with`` of anything else once, as a
    ``with`` would; with no ``as`` the loop binds nothing (``for () in ...``)."""

    def visit_With(self, node: ast.With):
        if len(node.items) != 1 or not _names_steps(node.items[0].context_expr):
            self.generic_visit(node)
            return node
        item = node.items[0]
        target = item.optional_vars
        wants = target is not None
        if not wants:
            target = ast.Tuple(elts=[], ctx=ast.Store())
        it = _call(ITER_BLOCK_NAME, item.context_expr, ast.Constant(wants))
        loop = ast.copy_location(ast.For(target=target, iter=it, body=node.body, orelse=[]), node)
        return self.visit_For(loop)

    def visit_For(self, node: ast.For):
        self.generic_visit(node)
        it = node.iter
        block = (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                 and it.func.id == ITER_BLOCK_NAME)
        if not (block or _names_steps(it)):
            return node
        handler = ast.ExceptHandler(
            type=ast.Name(id=ITER_END_NAME, ctx=ast.Load()), name=None, body=[ast.Pass()]
        )
        guard = ast.Try(body=[node], handlers=[handler], orelse=[], finalbody=[])
        return ast.copy_location(guard, node)

    # Loops inside functions defined in the body are left alone: they run whenever called.
    def visit_FunctionDef(self, node):
        return node

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef


def _call(name: str, *args) -> ast.Call:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


class _Rewrite(ast.NodeTransformer):
    """Body rewrites, anywhere in the body (nested functions included):

    ``expr.save()`` -> ``save(expr)``   (tuples, dicts and model outputs can be saved too)
    ``expr.grad``   -> ``grad(expr)``   ``expr.grad = v`` -> ``set_grad(expr, v)``
    ``expr.grad op= v`` -> ``set_grad(expr, grad(expr) op v)``
    ``with cm: block`` -> ``with cm: if inline(): block``   (see INLINE_NAME)
    """

    def visit_With(self, node: ast.With):
        self.generic_visit(node)
        guard = ast.If(test=_call(INLINE_NAME), body=node.body, orelse=[])
        node.body = [ast.copy_location(guard, node.body[0])]
        return node

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "save" and not node.args and not node.keywords:
            return ast.copy_location(_call(SAVE_NAME, f.value), node)
        return node

    def visit_Attribute(self, node: ast.Attribute):
        self.generic_visit(node)
        if node.attr == "grad" and isinstance(node.ctx, ast.Load):
            return ast.copy_location(_call(GRAD_NAME, node.value), node)
        return node

    def visit_Assign(self, node: ast.Assign):
        t = node.targets[0]
        if len(node.targets) == 1 and isinstance(t, ast.Attribute) and t.attr == "grad":
            value = self.visit(node.value)
            obj = self.visit(t.value)
            return ast.copy_location(ast.Expr(_call(SET_GRAD_NAME, obj, value)), node)
        self.generic_visit(node)
        return node

    def visit_AugAssign(self, node: ast.AugAssign):
        t = node.target
        if isinstance(t, ast.Attribute) and t.attr == "grad":
            obj = self.visit(t.value)
            new = ast.BinOp(left=_call(GRAD_NAME, obj), op=node.op, right=self.visit(node.value))
            return ast.copy_location(ast.Expr(_call(SET_GRAD_NAME, obj, new)), node)
        self.generic_visit(node)
        return node


class _ClassNames(ast.NodeTransformer):
    """In a class statement of a body (not one inside a function), a name the class body reads
    but never binds becomes ``NAME_NAME("name")``.

    A class body finds its globals with a plain dict lookup, which does not fall back to the
    caller's names the way a body's Scope does; ``NAME_NAME`` looks the name up in the Scope.
    Method bodies, lambdas and comprehensions (past their first iterable) look names up the
    ordinary way and are left alone; decorators, defaults and annotations run in the class body
    and are rewritten.
    """

    def __init__(self):
        self.bound: "tuple[frozenset, ...]" = ()  # names bound by each enclosing class body

    def visit_FunctionDef(self, node):
        if not self.bound:  # a function of the body: classes in it see its scope normally
            return node
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        self._visit_args(node.args)
        if node.returns is not None:
            node.returns = self.visit(node.returns)
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        if self.bound:
            self._visit_args(node.args)
        return node

    def _visit_args(self, args: ast.arguments) -> None:
        args.defaults = [self.visit(d) for d in args.defaults]
        args.kw_defaults = [d if d is None else self.visit(d) for d in args.kw_defaults]

    def _visit_comprehension(self, node):
        if self.bound:
            node.generators[0].iter = self.visit(node.generators[0].iter)
        return node

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _visit_comprehension

    def visit_ClassDef(self, node):
        # bases, keywords and decorators run in the enclosing scope
        node.bases = [self.visit(b) for b in node.bases]
        node.keywords = [self.visit(k) for k in node.keywords]
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        self.bound = self.bound + (frozenset(assigned_names(node.body)),)
        try:
            node.body = [self.visit(st) for st in node.body]
        finally:
            self.bound = self.bound[:-1]
        return node

    def visit_Name(self, node):
        if (self.bound and isinstance(node.ctx, ast.Load) and node.id not in self.bound[-1]
                and not node.id.startswith("__nnsight_lite")):
            return ast.copy_location(_call(NAME_NAME, ast.Constant(node.id)), node)
        return node


def class_body_name(name: str):
    """``NAME_NAME(name)``: a name read in a class body, looked up in the body's Scope."""
    scope = sys._getframe(1).f_globals
    try:
        return scope[name]
    except KeyError:
        raise NameError(f"name {name!r} is not defined") from None

