"""Gradients: ``with loss.backward():`` bodies that read and edit ``.grad`` as backprop runs.

    patched Tensor.backward   plain call: the original; ``with loss.backward(...):`` a Backward
    Backward                  the context: runs its body interleaved with one backward pass
    (``read_grad``/``set_grad``, what ``t.grad``/``t.grad = g`` mean inside a body, and
    ``add_grad_hook``: grads.py; the errors of a backward body that are worded apart,
    ``missed_error`` and Backward's error builders: backward_errors.py)

Whether ``loss.backward()`` is used as a context manager is read from the caller's bytecode
(with_calls.py): the call is immediately followed by the with-statement's setup instruction.
That look-up is cached per code object, so a plain ``loss.backward()`` pays about a microsecond.

Inside the body, ``t.grad`` registers a hook on ``t`` and switches to the parent, which runs
the backward; the hook switches back into the body with the gradient, and returns whatever
the body left there. Gradients therefore arrive in reverse execution order. The backward runs
with autograd's multithreading off, so every hook fires on the calling thread (a greenlet
cannot be switched into from another thread, and autograd uses device threads for CUDA).
"""

from __future__ import annotations

import contextvars
import functools
import sys

import torch

from .backward_errors import _FREED, BackwardErrors, _describe, missed_error, no_grad_trace
from .context import BodyContext, body_job
from .errors import GradientError, OutOfOrderError
from .grads import _rows_of, add_grad_hook
from .mediator import _DONE
from .waits import StopTrace
from .with_calls import _called_as_context
from .workers import (
    _FINISHED,
    _getcurrent,
    GRADS,
    _take_worker,
    attached,
    set_tls_state,
    switch_job,
    tls_state,
    unwind,
    user_location,
)

_original_backward = torch.Tensor.backward
# what torch.autograd.set_multithreading_enabled does, without building a context manager
_is_multithreading = torch._C._is_multithreading_enabled
_set_multithreading = torch._C._set_multithreading_enabled


@functools.wraps(_original_backward)
def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    if _called_as_context(sys._getframe(1)):
        return Backward(self, gradient, retain_graph, create_graph, inputs)
    return _original_backward(self, gradient, retain_graph, create_graph, inputs)


backward.__nnsight_lite__ = True
torch.Tensor.backward = backward


class Backward(BackwardErrors, BodyContext):
    """``with loss.backward(gradient=None, retain_graph=None, create_graph=False, inputs=None):``

    Example::

        with model.trace(x):
            hs = model.layer1.output
            loss = model.output.sum()
            with loss.backward():
                g = hs.grad.save()          # the gradient w.r.t. layer1's output
                hs.grad[:] = 0              # and what flows on to earlier layers

    Works standalone too, on tensors saved from a trace or any autograd graph. Read gradients
    in reverse execution order (last layer first).
    """

    _what = "backward"
    _made_by = "loss.backward()"

    def __init__(self, loss, gradient, retain_graph, create_graph, inputs):
        self._loss = loss
        self._args = (gradient, retain_graph, create_graph, inputs)
        self.cur = None
        self.cur_value = None
        self._seq = None
        self._pending_seq = None
        self._finished = False
        self._pending = None
        self._last = None

    def _on_exit(self, frame):
        self._run_in_scope(frame, self._stoppable)

    def _let_go(self) -> None:
        # The loss holds its graph, whose nodes hold the weights and the leaf inputs: a name
        # left bound to this object (`as bw`) must not keep them (plain backward returns None).
        self._loss = self._args = None
        self.cur = self.cur_value = self._pending = self._last = None
        self._seq = self._pending_seq = None
        self._runner = self._greenlet = None
        self._handles = []

    def _stoppable(self, scope) -> None:
        """``_run``, where a ``tracer.stop()`` in the block ends the backward pass only: what
        the block saved is kept and the code after the block runs (as in nnsight)."""
        try:
            self._run(scope)
        except StopTrace:
            pass

    # ---- running

    def _run(self, scope):
        loss = self._loss
        if not loss.requires_grad:
            raise GradientError(
                f"`with loss.backward():` at {user_location()}: the loss ({_describe(loss)}) does "
                "not require grad, so there is no backward pass to run. It was computed under "
                "torch.no_grad()/inference_mode or only from tensors that do not require grad; "
                "compute it with grad enabled." + no_grad_trace()
            )
        if self._args[0] is None and loss.numel() != 1:  # (autograd's own error is bare)
            raise GradientError(
                f"`with loss.backward():` at {user_location()}: the loss is a "
                f"{_describe(loss)}, not a single number, and backward needs one: reduce it "
                "first (`with loss.sum().backward():`), or pass the gradient to start from "
                "(`loss.backward(gradient=torch.ones_like(loss))`)."
            )
        code = self._body.code
        self._runner = _getcurrent()
        self._greenlet = None
        self._done = False
        self._handles = []
        saved_state = tls_state()
        try:  # (the worker is attached inside: a Ctrl-C at any point is cleaned up below)
            g = self._greenlet = _take_worker(GRADS)
            g.grads = self
            g.gr_context = contextvars.copy_context()
            self._register(self._resume(body_job(code, scope)))
            multithreading = _is_multithreading()
            _set_multithreading(False)
            try:
                _original_backward(loss, *self._args)
            except RuntimeError as exc:
                if _FREED not in str(exc):
                    raise
                raise self._freed_error(exc) from exc
            finally:
                _set_multithreading(multithreading)
            self._finished = True
            while not self._done and self._pending is not None:
                self._register(self._resume(None, self._missed_error()))
        finally:
            self._finished = True
            try:  # (in line, not a helper's call: an interrupt lands at a function's entry)
                self._cleanup()
            except BaseException:  # Ctrl-C part way: finish it, then let the interrupt through
                self._cleanup()
                raise
            now = tls_state()
            if now != saved_state:
                set_tls_state(saved_state, now)

    def _cleanup(self) -> None:
        """Remove the gradient hooks and unwind the body if it is still attached (idempotent)."""
        for h in self._handles:
            h.remove()
        if attached(self._greenlet, self):
            unwind(self._greenlet)

    def _resume(self, value, throw=None):
        """Switch into the body; return its next request, or _DONE when it has ended."""
        try:
            req = switch_job(self._greenlet, value, throw)
        except BaseException:  # the body ended with an exception, which is the user's
            throw = None  # in the exception's traceback through this frame: no cycle
            self._done = True
            raise
        if req is _FINISHED:
            self._done = True
            return _DONE
        return req

    def _register(self, req):
        if req is _DONE:
            self._pending = None
            return
        t = req
        self._pending = req
        self._handles.append(add_grad_hook(t, functools.partial(self._hook, t)))

    def _hook(self, t, grad):
        if _getcurrent() is not self._runner:
            raise GradientError(
                "a gradient hook fired on a thread other than the one running the backward; "
                "nnsight_lite runs backward with autograd multithreading off to prevent this"
            )
        if self._pending is not t:
            return None
        # (None where the op using t gives it no gradient, a quantized Linear say: torch hands
        # hooks None and leaves a retained .grad None, and so does the body's t.grad)
        value = None if grad is None else grad.clone()
        self.cur = t
        self.cur_value = value
        self._seq = self._pending_seq  # t's, found when it was requested
        self._last = t
        try:
            req = self._resume(value)
        finally:
            self.cur = None
        out, self.cur_value = self.cur_value, None
        self._register(req)
        return out

    # ---- body side

    def request(self, t, view=None):
        rows = _rows_of(t)
        if rows is not None:  # an invoke's view of a batched activation: its rows of the grad
            full = self.request(rows[0], t)
            return None if full is None else full.narrow(0, rows[1], rows[2])
        if t is self.cur:
            return self.cur_value
        if not isinstance(t, torch.Tensor) or not t.requires_grad or self._finished:
            raise self._bad_request(t)
        seq = _seq_of(t)
        if self._seq is not None and seq is not None and seq > self._seq:
            raise OutOfOrderError(
                f".grad of a {_describe(t if view is None else view)} was read at "
                f"{user_location()}, but backprop has already passed it: it was computed after "
                f"the {_describe(self._last)} whose .grad was read before it. Gradients arrive "
                "in reverse execution order: read the later tensor's .grad first (here: this "
                "one before the other)." + ("" if view is None else _SHARED.format(tuple(t.shape)))
            )
        self._pending_seq = seq
        return self._wait(t)

    def _wait(self, t):
        """Wait for backprop to reach ``t`` (the backward runs in the parent greenlet)."""
        return _getcurrent().parent.switch(t)

    def _no_source(self, err):
        from .nosource import enter_inline_backward

        enter_inline_backward(self)

    def _exit_no_source(self, exc_type, exc) -> bool:
        from .nosource import exit_inline_backward

        return exit_inline_backward(self, exc_type, exc)

    def _missed_error(self):
        g = self._greenlet
        where = user_location(g.gr_frame) if g.gr_frame is not None else "<unknown>"
        return missed_error(self._pending, where, self._args[3], self._last, self._loss)


_SHARED = (
    " This tensor is an invoke's rows of a batched activation of shape "
    "{}: all invokes' rows get their gradient at once, so read a module's .grad in every "
    "invoke before an earlier module's (with several invokes: for each module from the "
    "last, each invoke's value of it)."
)


def _seq_of(t):
    fn = t.grad_fn
    return fn._sequence_nr() if fn is not None else None
