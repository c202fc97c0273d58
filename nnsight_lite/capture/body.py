"""A with-statement's body, compiled once per call site.

    find_body(frame, what)   the compiled body of the with-statement ``frame`` is entering (cached)
    Body                     that compiled body and where it came from
"""

from __future__ import annotations

import ast
import copy
from collections import OrderedDict
from types import CodeType, FrameType

from ..errors import BodySyntaxError
from .parsing import fix_locations
from .rewrite import INLINE_NAME, assigned_names, body_syntax_error, rewrite_body, scope_names
from .skip import Skipper, skip_line
from .source import find_with, remember_source
from .weak import keep_weakly

_CACHE_SIZE = 1024


class Body:
    """A compiled with-block body and where it came from."""

    __slots__ = ("code", "filename", "lineno", "end_lineno", "trivial", "body_line", "assigned",
                 "binds", "skipper", "skip_error", "namespace", "kept")

    def __init__(self, code: CodeType, filename: str, lineno: int, end_lineno: int, trivial: bool,
                 body_line: int):
        self.code = code
        self.body_line = body_line  # the first line of the body (the header may span several)
        self.assigned: tuple = ()  # every name the body may bind (a superset is fine)
        self.binds: frozenset = frozenset()  # the names it binds in its own scope (exactly)
        # A body of only `pass`/`...`/strings: harmless to run inline, and CPython may emit
        # its line outside the with-block's handler, so it is not skipped.
        self.trivial = trivial
        self.filename = filename
        self.lineno = lineno
        self.end_lineno = end_lineno
        self.skipper = Skipper(body_line)  # the line tracer that skips this body
        self.skip_error: "str | None" = None  # why the line tracer cannot skip it (see skip_line)
        # id() of the globals of the top-level code it sits in (None inside a function): the
        # cells of a notebook share one (messages look for a name another cell's block bound)
        self.namespace: "int | None" = None
        # the names its last run as the outermost block bound back (saved), or None where that
        # run raised or none has ended yet: a name it binds and did not keep was dropped unsaved
        self.kept: "frozenset | None" = None


#: (id(code), offset of the with) -> (weak reference to that code, its Body). The code is held
#: weakly: once it is gone (a notebook cell that ran, a function defined again) no frame can
#: run it again, and its entries go with it.
_bodies: OrderedDict = OrderedDict()


def find_body(frame: FrameType, what: str = "trace") -> Body:
    """Return the compiled body of the ``with`` statement ``frame`` is executing now.

    The first time a call site is reached its source is found and proven to be the running code
    (source.py, with proof.py); after that the answer is a dict look-up."""
    code = frame.f_code
    # Keyed by identity: equal code objects from different files or cells compare equal.
    key = (id(code), frame.f_lasti)
    hit = _bodies.get(key)
    if hit is not None and hit[0]() is code:
        return hit[1]
    body = _compile_body(frame, what)
    keep_weakly(_bodies, key, code, body)
    if len(_bodies) > _CACHE_SIZE:
        _bodies.popitem(last=False)
    return body


def _compile_body(frame: FrameType, what: str) -> Body:
    filename = frame.f_code.co_filename
    lineno = frame.f_lineno
    node, lines = find_with(frame, what)
    trivial = all(
        isinstance(st, ast.Pass) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))
        for st in node.body
    )
    # A body on the `with` line gives the line tracer no line to stop on; a trivial one runs
    # inline harmlessly, and a with-block inside a compiled body is skipped by a flag instead.
    if (node.body[0].lineno == node.lineno and not trivial
            and INLINE_NAME not in frame.f_code.co_names):
        raise BodySyntaxError(
            f"the body of a `with ...{what}(...)` block starts on the `with` line itself; put "
            "it on its own indented lines",  # (SyntaxError's str() adds the file and line)
            (filename, lineno, 1, lines[lineno - 1] if lineno <= len(lines) else ""),
        )
    # the parsed tree is shared by the call sites of one source: rewrite a copy
    stmts = rewrite_body(copy.deepcopy(node.body))
    module = ast.Module(body=stmts, type_ignores=[])
    fix_locations(module)
    try:
        code = compile(module, filename, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise body_syntax_error(exc, what, filename, lineno) from None
    # tracebacks name the body's frame after the code it was written in, not "<module>"
    outer = frame.f_code
    names = {"co_name": outer.co_name}
    if hasattr(outer, "co_qualname"):
        names["co_qualname"] = outer.co_qualname
    code = code.replace(**names)
    remember_source(code, lines)
    line, skip_error = skip_line(node, what, filename)
    body = Body(code, filename, node.lineno, node.end_lineno or node.lineno, trivial, line)
    body.skip_error = skip_error
    body.assigned = assigned_names(node.body)
    body.binds = scope_names(node.body)
    if frame.f_code.co_name == "<module>":
        body.namespace = id(frame.f_globals)
    return body


def ran(body: Body, kept: "frozenset | None", frame: FrameType) -> None:
    """Record how ``body``'s run as the outermost block in ``frame`` ended: ``kept``, the names
    it bound back there, or None where it raised (then nothing it bound was kept, saved or not,
    and no message may say a name was dropped for want of a .save())."""
    body.kept = kept
    if body.namespace is not None:  # top-level code (a notebook cell): see top_blocks
        # (this run's namespace: top-level code run again, a loop of a script or a served
        # model's cached request code, may run in other globals than it was compiled in)
        key = (id(frame.f_globals), body.filename, body.lineno)
        top_blocks.pop(key, None)
        if kept is not None:
            top_blocks[key] = body.binds - kept  # (the latest last)
            if len(top_blocks) > _TOP_BLOCKS:
                top_blocks.popitem(last=False)


#: (id(globals), filename, line) -> the names the body bound and dropped unsaved, for the latest
#: blocks of top-level code (notebook cells) that ran to the end: a cell's code object, and with
#: it its _bodies entry, is gone once the cell ran, but a later cell's NameError note names the
#: block that dropped the name (tracebacks)
top_blocks: OrderedDict = OrderedDict()
_TOP_BLOCKS = 256


def forget_namespace(namespace: dict) -> None:
    """Drop the blocks recorded for ``namespace``, a dict about to be freed (a served model's
    request: a later dict may get its id, and must not be taken for it)."""
    for key in [k for k in top_blocks if k[0] == id(namespace)]:
        top_blocks.pop(key, None)


def names_read(code) -> set:
    """Every name ``code`` (and code nested in it) may look up: a superset is fine."""
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= names_read(const)
    return names
