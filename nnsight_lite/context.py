"""The with-statement plumbing every body context shares (trace, invoke, backward).

    BodyContext    __enter__ captures the body and arranges to skip it; __exit__ runs it
    RUNTIME        the functions body rewrites call (save; grads.py adds grad/set_grad)
    body_job       what a worker greenlet runs for one body
"""

from __future__ import annotations

import functools
import sys

from .capture import (
    INLINE_NAME,
    NAME_NAME,
    SAVE_NAME,
    SkipBody,
    body_runs_inline,
    cancel_inline_skip,
    caller_scope,
    class_body_name,
    find_body,
    let_go_of_locals,
    restore_tracing,
    skip_body,
    skip_inline,
    write_back,
)
from .capture.body import ran as _ran
from .saving import _saved_stack, save_in_body
from .errors import BodySyntaxError, NoSourceError, ReusedContextError
from .mediator import wait_for_name
from .tracebacks import clean, handled_as_is, note_scope_limits
from .waits import StopTrace

_PY311 = sys.version_info >= (3, 11)

RUNTIME = {SAVE_NAME: save_in_body, INLINE_NAME: body_runs_inline, NAME_NAME: class_body_name}
_INLINE = object()  # the token of a context entered from a compiled body (no line tracer)
_UNSAVED = object()  # what a body name that was not saved maps to in the saved dict
_NO_SOURCE = object()  # the token of a context whose body runs in place (no source: nosource.py)


_NONE_KEPT = frozenset()


def saved_only(items, saved: dict) -> dict:
    """The ``(name, value)`` pairs of ``items`` whose value a body saved (``saved`` maps
    ``id(value)`` to the value), as a dict: what a trace binds back in its caller."""
    if not saved:
        return {}
    get = saved.get
    return {k: v for k, v in items if get(id(v), _UNSAVED) is v}


def body_job(code, scope):
    """The job a worker greenlet runs for one body (a partial: fewer objects than a closure)."""
    return functools.partial(exec, code, scope)


class BodyContext:
    """Base of the contexts whose body runs later, in a greenlet, instead of inline."""

    __slots__ = ("_body", "_frame", "_token", "__dict__")

    _what = "trace"

    _binds = None  # what ``with ... as name`` binds where it is not the context (an editor)

    _entered = False  # set at the first with-statement: the object runs that block only
    _single_use = True  # (a session may be entered again: it holds no inputs)
    _made_by = "this object"  # how messages name the call that made it ("model.trace(...)")

    def __enter__(self):
        try:
            if self._entered:
                raise self._reused(sys._getframe(1))
            self._entered = self._single_use
            self._capture(sys._getframe(1))
        except BaseException as err:  # a block that cannot run: the user's `with` line only
            __tracebackhide__ = True  # noqa: F841  (pytest and IPython hide this frame)
            clean(err, SkipBody)  # no capture internals (source lookup, body compiling)
            if _PY311 or handled_as_is(err):
                raise  # re-raised as it is: no frame of this function is added to it
            raise err
        # skip_body's tracers are set from here to the body's first line. (A method call here
        # once hung a Ray replica: remote/execute.Deadline left CPython 3.11's async-exception
        # flag raised, and then any Python function entered while a trace function is set
        # spins in the eval loop; Deadline no longer does, see its docstring.)
        binds = self._binds
        return self if binds is None else binds

    def _capture(self, frame) -> None:
        """Find the body of the with-statement ``frame`` is entering and arrange to skip it."""
        try:
            self._body = find_body(frame, self._what)
        except NoSourceError as err:  # no source at all: run in place, where the context can
            self._frame = None
            self._no_source(err)
            self._token = _NO_SOURCE
            return
        self._frame = frame
        body = self._body
        if body.trivial:
            self._token = None
        elif INLINE_NAME in frame.f_code.co_names:  # a with-block inside a compiled body
            self._token = _INLINE
            skip_inline(self)
        else:
            if body.skip_error is not None:
                raise BodySyntaxError(body.skip_error)
            self._token = skip_body(frame, body.skipper)

    def __exit__(self, exc_type, exc, tb):
        token, self._token = self._token, None  # it holds the frame: no cycle through it
        if token is _NO_SOURCE:
            try:
                return self._exit_no_source(exc_type, exc)
            finally:
                self._let_go()
        if token is _INLINE:
            cancel_inline_skip(self)  # normally consumed already
            expected = None
        elif token is not None:
            restore_tracing(token)
            expected = SkipBody
        else:
            expected = None
        frame, self._frame = self._frame, None
        if exc_type is not expected:
            self._let_go()
            return False
        try:
            self._on_exit(frame)
        except BaseException as err:
            __tracebackhide__ = True  # noqa: F841  (pytest and IPython hide this frame)
            clean(err, SkipBody)  # the user's frames only (see tracebacks.py)
            if frame is not None:
                note_scope_limits(err, frame)
            if _PY311 or handled_as_is(err):  # (3.10: see handled_as_is)
                raise  # re-raised as it is: no frame of this function is added to it
            raise err
        finally:
            self._let_go()
        return True

    def _reused(self, frame) -> ReusedContextError:
        name = self._made_by
        return ReusedContextError(
            f"the with-statement at {frame.f_code.co_filename}:{frame.f_lineno} enters a "
            f"{name} object that has run its block already: each {name} call makes an object "
            f"for one with-block. Call {name} again in the with-statement (`with {name}:`)."
        )

    def _let_go(self) -> None:
        """The block is over: drop what only running it needed (the model, the inputs), so a
        name left bound to this object (``as tracer`` in a notebook) does not keep them alive."""

    def _no_source(self, err: NoSourceError) -> None:
        """Where the block has no source at all: start running its body in place, or raise."""
        from .nosource import no_source_error

        raise no_source_error(self, err) from None

    def _exit_no_source(self, exc_type, exc) -> bool:  # pragma: no cover - see _no_source
        raise NotImplementedError

    def _on_exit(self, frame):  # pragma: no cover - abstract
        raise NotImplementedError

    def _run_in_scope(self, frame, run) -> None:
        """Run ``run(scope)`` in a fresh Scope for ``frame``; bind the saved names back there."""
        scope = caller_scope(frame, RUNTIME, wait_for_name)
        saved: dict = {}
        stack = _saved_stack()
        outermost = not stack
        stack.append(saved)
        stop = None
        try:
            run(scope)
        except StopTrace as exc:  # an enclosing trace's tracer.stop(): it ends that trace,
            stop = exc  # and what the body saved so far is kept
        except BaseException:
            let_go_of_locals(frame)
            if outermost:
                _ran(self._body, None, frame)  # (nothing it bound is kept: saved names neither)
            raise
        finally:
            stack.pop()
        target = frame.f_locals
        # inside another body (a trace's, a backward block's, a session's: its saves are on
        # the stack) every name goes on, as in nnsight: only the outermost block keeps just
        # what was saved
        if stack:
            values = dict(scope.own_items())
        else:
            values = saved_only(scope.bound_items(), saved)
            _ran(self._body, frozenset(values) if values else _NONE_KEPT, frame)
        scope.reset()
        if stack:  # a trace nested in another body: its saves are saved there too
            stack[-1].update(saved)
        write_back(frame, values, target)
        if stop is not None:
            try:
                raise stop
            finally:
                stop = None  # (a local holding the exception it raises: a reference cycle)
