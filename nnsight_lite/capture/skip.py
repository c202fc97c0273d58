"""Skipping a captured body's inline execution, so that it runs later, interleaved with the model.

    skip_line(node, ...)    the line on which the body can be skipped (or why it cannot)
    skip_body(frame, sk)    arrange for the frame to jump over that body (returns a restore token)
    restore_tracing(tok)    undo skip_body's changes (a skip never reached is dropped)
    skip_inline(ctx)        the same for a context entered inside a compiled body (a flag)
    body_runs_inline()      ``INLINE_NAME()``: the check those compiled with-blocks make

In user code: ``__enter__`` arranges for ``SkipBody`` to be raised on the first line of the
body; the context manager's ``__exit__`` receives it, runs the compiled body in its place and
suppresses it. On Python 3.12+ that is a ``sys.monitoring`` LINE event on the caller's code object
alone (our own tool id); before 3.12, where no tool id is free, and while a line tracer is set
(``sys.settrace``: pdb, coverage's tracer), a line-trace function on the caller's frame, with
the tracer that was active before put back in ``__exit__``. (On 3.12+ ``sys.settrace`` is built on ``sys.monitoring`` too, and turning it on and
off re-instruments every code object on the stack and every one run after it: ~10 µs a trace
on 3.12.1 and 3.13.0, a sixth of a small trace's whole cost; see README, How it works.) Inside compiled bodies every with-block is guarded by
``if INLINE_NAME():`` (see rewrite.py), which a context entered there turns off for its block.
"""

from __future__ import annotations

import ast
import sys
from threading import Lock
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


# ---- Python 3.12+: a LINE event on the caller's code object alone (sys.monitoring)

_MON = getattr(sys, "monitoring", None)
_TOOL_NAME = "nnsight_lite"
#: the sys.monitoring tool id the skips use: None until the first skip claims one, False where
#: this Python has no sys.monitoring or every id we may take is another tool's (line tracer then)
_tool = None if _MON is not None else False
#: id(code object) -> (the code, {frame: the body's first line}) for the with-statements in that
#: code waiting to skip their body (a code object's LINE events reach every frame running it:
#: the recursion of a function, other threads). Keyed by id: a code object's hash is computed
#: anew at every use (its name, constants, bytecode...: ~500 instructions on 3.12), and the
#: entry holds the code, so the id stays its own while the entry exists.
_pending: dict = {}
_MONITORED = object()  # the first item of a skip_body token on the sys.monitoring path
_LINE = _MON.events.LINE if _MON is not None else 0


_lock = Lock()  # (arming, dropping and claiming the tool id, across threads)


def _on_line(code, line):
    """The LINE callback: ``SkipBody`` where the frame is at the body it waits for."""
    entry = _pending.get(id(code))
    if entry is not None:
        frame = sys._getframe(1)  # (the frame the event is for)
        body_line = entry[1].get(frame)
        if body_line is not None and line >= body_line:
            _drop(code, frame)
            raise SkipBody
    # (returns None: sys.monitoring.DISABLE would turn this line's event off for every frame)


def _claim_tool():
    """A tool id of our own (4, else 3: the ids no convention assigns), with the callback;
    False where both are another tool's."""
    for tid in (4, 3):
        name = _MON.get_tool(tid)
        if name is None:
            try:
                _MON.use_tool_id(tid, _TOOL_NAME)
            except ValueError:  # (another tool took it just now)
                if _MON.get_tool(tid) != _TOOL_NAME:
                    continue
        elif name != _TOOL_NAME:  # (ours already after importlib.reload)
            continue
        _MON.register_callback(tid, _MON.events.LINE, _on_line)
        return tid
    return False


def _drop(code, frame) -> None:
    with _lock:
        entry = _pending.get(id(code))
        if entry is not None and entry[1].pop(frame, None) is not None and not entry[1]:
            del _pending[id(code)]
            _MON.set_local_events(_tool, code, 0)


def skip_body(frame: FrameType, skipper: Skipper):
    """Make ``frame`` raise ``SkipBody`` when it reaches the body ``skipper`` belongs to.
    Returns what ``restore_tracing`` needs."""
    global _tool
    # (with a line tracer set, a debugger's or coverage's, the line tracer below: the tracer
    # would see the body's first line before the LINE event skips it, as ``sys.settrace``'s
    # events come before every tool's; sys.monitoring tools see ours first, from the highest id
    # down, so a debugger on id 0 or coverage on 1 never sees the skipped line)
    if _tool is not False and sys.gettrace() is None:
        if _tool is None or _MON.get_tool(_tool) != _TOOL_NAME:
            with _lock:  # (threads making their first traces at once: one claims the id)
                if _tool is None or (_tool is not False and _MON.get_tool(_tool) != _TOOL_NAME):
                    _tool = _claim_tool()  # (the first skip; or another tool took our id)
        if _tool is not False:
            code = frame.f_code
            # An exception delivered once the skip is armed (KeyboardInterrupt from a signal
            # handler, a remote time limit's stop: both arrive as a call returns, here
            # set_local_events's or the lock's, below settrace's) propagates from __enter__, so
            # no __exit__ undoes the skip: it is undone here. Left armed, the frame stayed in
            # _pending for good (3.12+; before, the thread's tracer stayed set), and raised
            # SkipBody at the next line it ran past the body's first line: in the user's
            # ``except KeyboardInterrupt:`` around the with-statement.
            try:
                with _lock:
                    entry = _pending.get(id(code))
                    if entry is None:
                        _pending[id(code)] = (code, {frame: skipper.body_line})
                        _MON.set_local_events(_tool, code, _LINE)
                    else:
                        entry[1][frame] = skipper.body_line
                return (_MONITORED, frame, code)
            except BaseException:
                _drop(code, frame)
                raise
    token = (sys.gettrace(), frame, frame.f_trace)
    try:
        frame.f_trace = skipper
        sys.settrace(token[0] or _no_global_trace)
        return token
    except BaseException:  # (as above)
        restore_tracing(token)
        raise


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
    """Undo ``skip_body`` (a skip still waiting, where the body was never reached, is dropped)."""
    prev_global, frame, prev_local = token
    if prev_global is _MONITORED:
        _drop(prev_local, frame)
        return
    sys.settrace(prev_global)
    frame.f_trace = prev_local

