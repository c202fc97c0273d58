"""Skipping a captured body's inline execution, so that it runs later, interleaved with the model.

    skip_line(node, ...)    the line on which the body can be skipped (or why it cannot)
    skip_body(frame, sk)    arrange for the frame to jump over that body (returns a restore token)
    restore_tracing(tok)    undo skip_body's tracing changes
    skip_inline(ctx)        the same for a context entered inside a compiled body (a flag)
    body_runs_inline()      ``INLINE_NAME()``: the check those compiled with-blocks make

In user code: ``__enter__`` sets a line-trace function on the caller's frame that raises
``SkipBody`` on the first line of the body; the context manager's ``__exit__`` receives it, runs
the compiled body in its place and suppresses it. Any tracer that was active before (a debugger,
coverage) is put back in ``__exit__``. Inside compiled bodies every with-block is guarded by
``if INLINE_NAME():`` (see rewrite.py), which a context entered there turns off for its block.
"""

from __future__ import annotations

import ast
import sys
from types import FrameType


class SkipBody(BaseException):
    """Raised by the line tracer on the first line of a captured body; never reaches users.

    A BaseException, so that ``except Exception`` in the body or ``contextlib.suppress(Exception)``
    beside the context cannot swallow it."""




_TRY_NODES = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)


def skip_line(node: ast.With, what: str, filename: str):
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



def _no_global_trace(frame, event, arg):
    return None


class Skipper:
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


def skip_body(frame: FrameType, skipper: Skipper):
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

