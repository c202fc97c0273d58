"""Turn the body of a ``with`` statement into code that runs later, and write results back.

    find_body(frame)      the compiled body of the with-statement the frame is entering (cached)
    skip_body(frame, sk)  arrange for the frame to jump over that body (returns a restore token)
    restore_tracing(tok)  undo skip_body's tracing changes
    Scope                 the namespace a body runs in: its own names, falling back to the caller's
    write_back(frame, d)  put saved names back into the caller's scope

How the body is skipped: ``__enter__`` sets a line-trace function on the caller's frame that
raises ``SkipBody`` on the first line of the body; the context manager's ``__exit__`` receives it,
runs the compiled body in its place and suppresses it. Any tracer that was active before
(a debugger, coverage) is put back in ``__exit__``.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import linecache
import sys
from collections import ChainMap, OrderedDict
from types import CodeType, FrameType

from .errors import BodySyntaxError, SourceUnavailableError

_CACHE_SIZE = 1024
_PY313 = sys.version_info >= (3, 13)
_CO_OPTIMIZED = 0x0001

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
#: A name read in a class body inside a body becomes ``NAME_NAME("name")``: class bodies look up
#: globals in a plain dict, which would never reach the caller's names (see _ClassNames).
NAME_NAME = "__nnsight_lite_name__"


class SkipBody(BaseException):
    """Raised by the line tracer on the first line of a captured body; never reaches users.

    A BaseException, so that ``except Exception`` in the body or ``contextlib.suppress(Exception)``
    beside the context cannot swallow it."""


class IterationEnd(Exception):
    """Thrown into a body waiting inside ``tracer.iter``/``tracer.all()`` when the model is done."""


class Body:
    """A compiled with-block body and where it came from."""

    __slots__ = ("code", "filename", "lineno", "end_lineno", "trivial", "body_line", "assigned",
                 "skipper", "skip_error")

    def __init__(self, code: CodeType, filename: str, lineno: int, end_lineno: int, trivial: bool,
                 body_line: int):
        self.code = code
        self.body_line = body_line  # the first line of the body (the header may span several)
        self.assigned: tuple = ()  # every name the body may bind (a superset is fine)
        # A body of only `pass`/`...`/strings: harmless to run inline, and CPython may emit
        # its line outside the with-block's handler, so it is not skipped.
        self.trivial = trivial
        self.filename = filename
        self.lineno = lineno
        self.end_lineno = end_lineno
        self.skipper = _Skipper(body_line)  # the line tracer that skips this body
        self.skip_error: "str | None" = None  # why the line tracer cannot skip it (see _skip_line)


_bodies: OrderedDict = OrderedDict()


def find_body(frame: FrameType, what: str = "trace") -> Body:
    """Return the compiled body of the ``with`` statement ``frame`` is executing now."""
    code = frame.f_code
    # Keyed by identity: equal code objects from different files or cells compare equal.
    key = (id(code), frame.f_lasti)
    hit = _bodies.get(key)
    if hit is not None and hit[0] is code:
        return hit[1]
    body = _compile_body(frame, what)
    _bodies[key] = (code, body)
    if len(_bodies) > _CACHE_SIZE:
        _bodies.popitem(last=False)
    return body


def _compile_body(frame: FrameType, what: str) -> Body:
    filename = frame.f_code.co_filename
    lineno = frame.f_lineno
    lines = linecache.getlines(filename, frame.f_globals)
    if not lines:
        raise SourceUnavailableError(
            f"cannot run this `with ...{what}(...)` block: there is no source for {filename!r} "
            f"(line {lineno}). nnsight_lite reads the block's source to run it interleaved with "
            "the model, and code typed into a bare Python REPL, piped through stdin or passed "
            "to exec() as a plain string leaves none. Put the code in a file, a Jupyter/IPython "
            "cell, or compile it with a filename registered in linecache."
        )
    source = "".join(lines)
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as exc:  # e.g. a linecache entry that is not the running code
        raise SourceUnavailableError(
            f"the source found for {filename!r} does not parse ({exc.msg}, line {exc.lineno}); "
            "it is probably not the code that is running. Re-run the cell or reload the module."
        ) from None
    node = _with_at(tree, lineno)
    if node is None:
        raise SourceUnavailableError(
            f"no `with` statement found at {filename}:{lineno}; the source on disk may have "
            "changed since the code was loaded. Reload the module or re-run the cell."
        )
    if node.body[0].lineno == node.lineno:
        raise BodySyntaxError(
            f"the body of the `with ...{what}(...)` block at {filename}:{lineno} starts on the "
            "`with` line itself; put it on its own indented lines",
            (filename, lineno, 1, lines[lineno - 1] if lineno <= len(lines) else ""),
        )
    stmts = [_ClassNames().visit(_Rewrite().visit(_IterLoopGuard().visit(stmt)))
             for stmt in node.body]
    module = ast.Module(body=stmts, type_ignores=[])
    ast.fix_missing_locations(module)
    try:
        code = compile(module, filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise _body_syntax_error(exc, what, filename, lineno) from None
    trivial = all(
        isinstance(st, ast.Pass) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))
        for st in node.body
    )
    skip_line, skip_error = _skip_line(node, what, filename)
    body = Body(code, filename, node.lineno, node.end_lineno or node.lineno, trivial, skip_line)
    body.skip_error = skip_error
    body.assigned = _assigned_names(node.body)
    return body


_TRY_NODES = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)


def _skip_line(node: ast.With, what: str, filename: str):
    """The line on which the line tracer raises ``SkipBody``, and an error message when it
    cannot skip this body.

    Python 3.11+ compiles the ``try:`` line of a with-body's first statement to an instruction
    no exception handler covers, so ``SkipBody`` raised there would escape the with-statement.
    It is raised on the first line inside the ``try`` instead, where it passes through the try's
    handlers (``SkipBody`` is a BaseException) to the with-statement. A ``finally:`` or a bare
    ``except:`` / ``except BaseException:`` would run (or stop) there, so such a body is refused
    with a clear error. Only bodies skipped by the line tracer (in user code) are affected.
    """
    first = node.body[0]
    if sys.version_info < (3, 11):
        return first.lineno, None
    while isinstance(first, _TRY_NODES):
        catches_all = any(
            h.type is None or (isinstance(h.type, ast.Name) and h.type.id == "BaseException")
            for h in first.handlers
        )
        if first.finalbody or catches_all:
            return first.lineno, (
                f"the body of the `with ...{what}(...)` block at {filename}:{node.lineno} starts "
                "with a `try:` that has a `finally:` or catches BaseException, which nnsight_lite "
                "cannot skip cleanly on Python 3.11+; put any statement (`pass` will do) before "
                "the `try:`"
            )
        first = first.body[0]
    return first.lineno, None


def _assigned_names(stmts) -> tuple:
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


def _with_at(tree: ast.AST, lineno: int):
    """The innermost ``with`` statement whose header spans ``lineno``."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and node.lineno <= lineno:
            header_end = max(node.lineno, node.body[0].lineno - 1)
            if lineno <= header_end and (best is None or node.lineno >= best.lineno):
                best = node
    return best


def _body_syntax_error(exc: SyntaxError, what: str, filename: str, lineno: int):
    msg = exc.msg or ""
    if "return" in msg or "yield" in msg or "await" in msg:
        stmt = "return" if "return" in msg else ("yield" if "yield" in msg else "await")
        hint = (
            f"`{stmt}` cannot appear in a `with ...{what}(...)` body, which runs as its own block "
            "of code: save the values you need with .save() and return after the block "
            "(use tracer.stop() to end the model's forward early)"
        )
    elif "loop" in msg:
        hint = (
            f"`break`/`continue` cannot cross a `with ...{what}(...)` body; finish the block "
            "and break after it"
        )
    else:
        hint = f"the body of the `with ...{what}(...)` block does not compile: {msg}"
    err = BodySyntaxError(
        f"{hint} ({filename}, line {exc.lineno}; the block starts at line {lineno})",
        (filename, exc.lineno, exc.offset, exc.text),
    )
    return err


class _IterLoopGuard(ast.NodeTransformer):
    """Wrap ``for ... in tracer.iter[...]`` / ``tracer.all()`` loops so the end of the model's
    calls ends the loop cleanly and the code after it still runs."""

    def visit_For(self, node: ast.For):
        self.generic_visit(node)
        it = node.iter
        is_iter = (isinstance(it, ast.Subscript) and isinstance(it.value, ast.Attribute)
                   and it.value.attr == "iter")
        is_all = (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
                  and it.func.attr == "all")
        if not (is_iter or is_all):
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
        self.bound = self.bound + (frozenset(_assigned_names(node.body)),)
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


# --------------------------------------------------------------------------- skipping the body


def _no_global_trace(frame, event, arg):
    return None


class _Skipper:
    """The local trace function that raises ``SkipBody`` on a body's first line.

    One per Body, made once: a closure returning itself would be a reference cycle per
    ``with`` statement, left for the garbage collector.
    """

    __slots__ = ("body_line",)

    def __init__(self, body_line: int):
        self.body_line = body_line

    def __call__(self, frame, event, arg):
        # A header spanning several lines (`with model.trace(x,\n) as tracer:`) has line events
        # of its own before the `as` name is bound: wait for the body's first line.
        if event == "line" and frame.f_lineno >= self.body_line:
            raise SkipBody
        return self


def skip_body(frame: FrameType, skipper: _Skipper):
    """Make ``frame`` raise ``SkipBody`` when it reaches the body ``skipper`` belongs to.
    Returns what ``restore_tracing`` needs."""
    token = (sys.gettrace(), frame, frame.f_trace)
    frame.f_trace = skipper
    sys.settrace(token[0] or _no_global_trace)
    return token


#: frame -> the context entered in it whose with-block that frame's next ``INLINE_NAME()`` check
#: skips. Keyed by frame, so greenlets and threads cannot take or overwrite each other's.
_inline_pending: dict = {}


def skip_inline(ctx) -> None:
    """Make the next ``INLINE_NAME()`` check in ``ctx._frame`` skip its block: for a context
    entered from a compiled body, right before that check runs."""
    _inline_pending[ctx._frame] = ctx


def cancel_inline_skip(ctx) -> None:
    if _inline_pending.get(ctx._frame) is ctx:
        del _inline_pending[ctx._frame]


def body_runs_inline() -> bool:
    """``INLINE_NAME()``: whether the ``with`` block about to start runs now (False: the
    context just entered runs it later, itself).

    Only the block of the frame that entered the context is skipped: in ``with trace, cm:``
    the ``__enter__`` of ``cm`` may run with-blocks of its own (in code compiled from a body)
    before this frame's check, and those must run."""
    if not _inline_pending:
        return True
    return _inline_pending.pop(sys._getframe(1), None) is None


def restore_tracing(token) -> None:
    prev_global, frame, prev_local = token
    sys.settrace(prev_global)
    frame.f_trace = prev_local


# --------------------------------------------------------------------------- namespaces


class Scope(dict):
    """The namespace a body runs in.

    The body's own assignments live in this dict; names it does not define are looked up, at
    the moment they are read, in the caller's locals, then its globals, then builtins. Each
    invoke of a trace runs in a ``child`` of the trace's Scope, so it sees the trace body's
    names and what other invokes publish there, while its own bindings stay its own.
    """

    __slots__ = ("_locals", "_globals", "_builtins", "_on_missing", "keep_all", "_base")

    def __init__(self, caller_locals, caller_globals, runtime: dict, on_missing):
        super().__init__()
        self.keep_all = False  # a session's scope: traces inside it bind back every name
        self._on_missing = on_missing
        self._locals = caller_locals
        self._globals = caller_globals
        b = caller_globals.get("__builtins__", builtins)
        self._builtins = b if isinstance(b, dict) else vars(b)
        # the entries every body needs: builtins, and what the body rewrites call
        self._base = {"__builtins__": b, ITER_END_NAME: IterationEnd, **runtime}
        dict.update(self, self._base)

    def __missing__(self, name):
        try:
            return self._locals[name]
        except KeyError:
            pass
        if self._globals is not self._locals:
            try:
                return self._globals[name]
            except KeyError:
                pass
        try:
            return self._builtins[name]
        except KeyError:
            pass
        return self._on_missing(self, name)  # an earlier invoke may still bind it

    def child(self, names: dict) -> "Scope":
        """A Scope holding ``names`` whose lookups fall back to this one."""
        c = Scope.__new__(Scope)
        c.keep_all = False
        c._on_missing = self._on_missing
        c._locals = self
        c._globals = self._globals
        c._builtins = self._builtins
        c._base = self._base
        dict.update(c, self._base)
        dict.update(c, names)
        return c

    def reset(self) -> None:
        """Drop every name the body bound (and the tensors they hold); keep the base entries,
        so functions defined in the body still find builtins and the runtime names."""
        dict.clear(self)
        dict.update(self, self._base)

    def knows(self, name: str) -> bool:
        """Whether ``name`` is bound here or in an enclosing Scope (another body's names)."""
        scope = self
        while isinstance(scope, Scope):
            if dict.__contains__(scope, name):
                return True
            scope = scope._locals
        return False

    def own_items(self):
        """The names the body itself bound (not the two internal entries)."""
        for k, v in dict.items(self):
            if k not in _INTERNAL:
                yield k, v


_INTERNAL = frozenset({"__builtins__", ITER_END_NAME, SAVE_NAME, GRAD_NAME, SET_GRAD_NAME,
                       INLINE_NAME, NAME_NAME})


def caller_scope(frame: FrameType, runtime: dict, on_missing) -> Scope:
    """A fresh Scope for a body whose ``with`` statement sits in ``frame``.

    ``runtime`` maps the names the body rewrites use (SAVE_NAME, GRAD_NAME, SET_GRAD_NAME) to
    their functions; ``on_missing(scope, name)`` is asked for names found nowhere.
    """
    f_locals = frame.f_locals
    code = frame.f_code
    if code.co_freevars and not (code.co_flags & _CO_OPTIMIZED) and frame.f_back is not None:
        # A class body: its free variables (the enclosing function's locals) are not in
        # f_locals, but the frame that runs the class statement holds them.
        outer = frame.f_back.f_locals
        free = {n: outer[n] for n in code.co_freevars if n in outer}
        f_locals = ChainMap(f_locals, free)
    return Scope(f_locals, frame.f_globals, runtime, on_missing)


_locals_to_fast = None
if not _PY313:  # pragma: no cover - exercised on 3.10-3.12
    _locals_to_fast = ctypes.pythonapi.PyFrame_LocalsToFast
    _locals_to_fast.argtypes = (ctypes.py_object, ctypes.c_int)
    _locals_to_fast.restype = None


def write_back(frame: FrameType, values: dict) -> None:
    """Bind ``values`` in the scope of ``frame`` (module, class body, function, or a Scope)."""
    f_locals = frame.f_locals
    if isinstance(f_locals, Scope) or not (frame.f_code.co_flags & _CO_OPTIMIZED):
        f_locals.update(values)
        return
    if _PY313:  # PEP 667: f_locals is a write-through proxy
        for name, value in values.items():
            f_locals[name] = value
        return
    if values:
        f_locals.update(values)
        _locals_to_fast(frame, 0)
    # Before 3.13, f_locals of a function frame is a snapshot dict cached on the frame: left
    # filled it would keep every local (saved tensors included) alive after the user deletes
    # them. Emptying it is safe; the next f_locals access fills it again.
    f_locals.clear()
