"""The proof that a with-statement's source is the code that is running (see source.py).

    compiled_variants(tree, ...)   code objects compiled from that source in each way it may
                                   have been compiled (in place, alone, in a function, ...)
    code_signature(code, lo, hi)   what the code on lines lo..hi does, independent of scope kind

Two signatures that agree prove the text is the running code: they record every operation,
name, attribute and constant, and leave out only what the enclosing scope or the layout decides.
"""

from __future__ import annotations

import ast
import copy
import dis
import sys
import warnings
from collections import OrderedDict
from types import CodeType

from .parsing import fix_locations
from .rewrite import rewrite_body

_WHOLE = 32  # whole sources kept compiled (as source.py keeps parsed trees)


def compiled_variants(tree, source: str, node: ast.With, filename: str, flags: int,
                       rewritten: bool, frame_globals):
    """Code objects compiled from the source that hold the with-statement ``node``: first in
    its place in the whole source (the scope it sits in decides how names are loaded), then on
    its own at module level and inside a function (code compiled from a template, such as
    ``%%timeit``'s), in its place after pytest's assert rewriting (a test module), then with the body rewrites (a with-block inside a compiled body). Each is
    the same source text, so a match with any of them proves the running code is that text."""
    yield _in_place(tree, source, node, filename, flags)
    if "_pytest.assertion.rewrite" in sys.modules and "@pytest_ar" in frame_globals:
        yield _in_place(tree, source, node, filename, flags, _pytest_rewrite)
    yield _compile([node], filename, flags)
    yield _compile([_function_around(node)], filename, flags, inner=True)
    if rewritten:
        yield _compile(rewrite_body(copy.deepcopy([node])), filename, flags)
        # in its place in the body it runs in, compiled as body.py compiles it: 3.10 lays out
        # a with-statement's exits differently when it ends the code (alone) or not
        for outer in _withs_around(tree, node):
            yield _in_body(outer, node, tree, filename, flags)


def _compile(stmts, filename: str, flags: int, inner: bool = False):
    module = fix_locations(ast.Module(body=stmts, type_ignores=[]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = compile(module, filename, "exec", flags=flags, dont_inherit=True)
    return next(c for c in code.co_consts if isinstance(c, CodeType)) if inner else code


def _function_around(node: ast.With) -> ast.FunctionDef:
    args = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[],
                         kwarg=None, defaults=[])
    func = ast.FunctionDef(name="_", args=args, body=[node], decorator_list=[], returns=None)
    if sys.version_info >= (3, 12):
        func.type_params = []
    return ast.copy_location(func, node)


_whole: OrderedDict = OrderedDict()  # (filename, source, flags) -> the source compiled whole


def _in_place(tree, source: str, node: ast.With, filename: str, flags: int, transform=None):
    """The code object that holds ``node`` when the whole source is compiled (after
    ``transform(tree)``, if given); None if it does not compile whole (top-level ``await``)."""
    key = (filename, source, flags, transform)
    whole = _whole.get(key)
    if whole is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                whole = compile(tree if transform is None else transform(tree, source, filename),
                                filename, "exec", flags=flags, dont_inherit=True)
        except Exception:  # SyntaxError, or pytest's rewriting failing: no such variant
            whole = False
        _whole[key] = whole
        if len(_whole) > _WHOLE:
            _whole.popitem(last=False)
    if whole is False:
        return None
    scope = _enclosing_scope(tree, node)
    return whole if scope is None else _scope_code(whole, scope)


def _scope_code(code: CodeType, scope):
    """The code object compiled from the function or class statement ``scope``, in ``code``."""
    firsts = {scope.lineno, *(d.lineno for d in scope.decorator_list)}
    stack = [code]
    while stack:
        c = stack.pop()
        if c.co_name == scope.name and c.co_firstlineno in firsts:
            return c
        stack.extend(k for k in c.co_consts if isinstance(k, CodeType))
    return None


def _withs_around(tree, node):
    """The with-statements whose body holds ``node``, innermost first."""
    around = [n for n in ast.walk(tree) if isinstance(n, (ast.With, ast.AsyncWith))
              and n is not node and any(child is node for s in n.body for child in ast.walk(s))]
    return sorted(around, key=lambda n: n.lineno, reverse=True)


def _in_body(outer, node, tree, filename: str, flags: int):
    """The code object that holds ``node`` when ``outer``'s body is compiled as a body
    (rewritten, as a module: body.py); None if it does not compile."""
    try:
        code = _compile(rewrite_body(copy.deepcopy(outer.body)), filename, flags)
    except SyntaxError:
        return None
    scope = _enclosing_scope(tree, node)
    if scope is None or scope.lineno < outer.lineno:  # at the body's own level
        return code
    return _scope_code(code, scope)


def _pytest_rewrite(tree, source: str, filename: str):
    """``tree`` as pytest's assertion rewriting compiles a test module (asserts expanded)."""
    from _pytest.assertion.rewrite import rewrite_asserts

    tree = copy.deepcopy(tree)
    rewrite_asserts(tree, source.encode(), filename)
    return tree


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _enclosing_scope(tree, node):
    """The innermost function or class statement around ``node`` (None: module level)."""
    best = None
    for n in ast.walk(tree):
        if (isinstance(n, _SCOPES) and n.lineno <= node.lineno
                and (n.end_lineno or n.lineno) >= (node.end_lineno or node.lineno)
                and n is not node and (best is None or n.lineno >= best.lineno)):
            if any(child is node for child in ast.walk(n)):
                best = n
    return best


# --------------------------------------------------------------------------- signatures

_NAME_OPS = {
    "LOAD_NAME": "load", "LOAD_GLOBAL": "load", "LOAD_FAST": "load", "LOAD_FAST_CHECK": "load",
    "LOAD_DEREF": "load", "LOAD_CLASSDEREF": "load", "LOAD_FROM_DICT_OR_DEREF": "load",
    "LOAD_FROM_DICT_OR_GLOBALS": "load", "LOAD_FAST_AND_CLEAR": "load", "LOAD_FAST_BORROW": "load",
    "LOAD_FAST_LOAD_FAST": "load", "LOAD_FAST_BORROW_LOAD_FAST_BORROW": "load",
    "STORE_NAME": "store", "STORE_GLOBAL": "store", "STORE_FAST": "store", "STORE_DEREF": "store",
    "STORE_FAST_STORE_FAST": "store", "STORE_FAST_MAYBE_NULL": "store",
    "DELETE_NAME": "del", "DELETE_GLOBAL": "del", "DELETE_FAST": "del", "DELETE_DEREF": "del",
}
#: what the enclosing scope or the code's layout decides, not what the statement does
_IGNORED = frozenset({
    "NOP", "EXTENDED_ARG", "RESUME", "CACHE", "PUSH_NULL", "LOAD_CLOSURE", "COPY_FREE_VARS",
    "MAKE_CELL", "RETURN_VALUE", "RETURN_CONST", "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP",
    "JUMP_NO_INTERRUPT", "JUMP_ABSOLUTE", "JUMP_BACKWARD_NO_INTERRUPT", "NOT_TAKEN",
    "POP_ITER", "SETUP_ANNOTATIONS",
})
_CLOSURE_FLAG = 0x08


def code_signature(code: CodeType, lo: int = 0, hi: int = sys.maxsize) -> tuple:
    """What the instructions of ``code`` on lines ``lo``..``hi`` do, as a comparable tuple.

    A name is recorded as loaded, stored or deleted, not how (global, local, cell); nested code
    objects by their own full signature; jumps, the implicit ``return None`` and the building of
    closures (which depend on the enclosing scope) are left out."""
    line_of = {}
    for start, stop, line in code.co_lines():
        for off in range(start, stop, 2):
            line_of[off] = line
    out = []
    closure = False
    for ins in dis.get_instructions(code):
        line = line_of.get(ins.offset)
        if line is None or not lo <= line <= hi:
            continue
        op = ins.opname
        if op == "LOAD_CLOSURE":
            closure = True
            continue
        if op in _IGNORED:
            if op == "RETURN_VALUE" and out and out[-1] == ("const", "NoneType", "None"):
                out.pop()
            continue
        if op == "BUILD_TUPLE" and closure:  # the tuple of a nested function's closure cells
            closure = False
            continue
        closure = False
        kind = _NAME_OPS.get(op)
        if kind is not None:
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if names == ("__qualname__",) and kind == "store" and out and out[-1][0] == "const":
                out[-1] = ("qualname",)  # a class body's qualified name: the scope decides it
            out.extend((kind, n) for n in names)
        elif op == "MAKE_FUNCTION":
            if len(out) > 1 and out[-2][0] == "code" and out[-1][1] == "str":
                out[-1] = ("qualname",)  # 3.10 loads the qualified name, which the scope decides
            flags = ins.arg or 0
            out.append((op, flags & ~_CLOSURE_FLAG))
        elif op == "LOAD_METHOD":  # 3.11 uses LOAD_ATTR on names bound by a module's imports
            out.append(("LOAD_ATTR", ins.argval))
        elif op == "SET_FUNCTION_ATTRIBUTE":
            if ins.arg != _CLOSURE_FLAG:
                out.append((op, ins.arg))
        elif op in ("LOAD_CONST", "LOAD_SMALL_INT", "RETURN_CONST"):
            out.append(_const(ins.argval))
        elif op in ("PRINT_EXPR",):  # an expression statement compiled in 'single' mode
            out.append(("POP_TOP", None))
        elif op == "CALL_INTRINSIC_1" and ins.argrepr == "INTRINSIC_PRINT":
            out.append(("POP_TOP", None))
        elif ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs:
            out.append((op, None))
        else:
            out.append((op, ins.argval if isinstance(ins.argval, (str, int, tuple)) else
                        ins.argrepr))
    return tuple(out)


def _const(value) -> tuple:
    if isinstance(value, CodeType):
        return ("code", value.co_name, code_signature(value))
    return ("const", type(value).__name__, repr(value))
