"""Bodies with no source: a trace given inputs, or a backward block, run in place.

    enter_inline_trace / exit_inline_trace        ``with model.trace(x):`` in code with no source
    enter_inline_backward / exit_inline_backward  ``with loss.backward():`` there
    no_source_error(ctx, err)                     what every other block gets there

Code typed into a bare REPL (before 3.13), piped through stdin (``python - < file``) or passed
to ``exec`` as a plain string has no source to compile a body from (capture/source.py). There
the roles are inverted: the body runs where it is written, in the user's own greenlet, and the
model's forward runs on a greenlet of its own, started by ``__enter__``. Each module value the
body asks for (``Mediator.get``) switches to the forward greenlet, which runs the model until
that value exists and switches back with it; ``__exit__`` lets the forward finish (or, when the
body raised, ends it so that its wrappers come off). Example, piped to ``python -``::

    with model.trace(x):
        h = model.layer1.output.save()
        model.layer2.output[:] = 0
    print(h.shape)                      # every name the body bound stays bound

A backward block is inverted the same way: the body's first ``t.grad`` hooks ``t`` and starts
backprop on a greenlet of its own; the hook switches back into the body with the gradient and
returns what the body left there when the body asks for the next one (or ends). Plain code
reads ``t.grad`` as an attribute, so while such a block runs ``torch.Tensor.grad`` is a property
that sends the block's reads to ``read_grad``/``set_grad`` (everything else gets torch's own).

Only one body can run this way: a trace without inputs and ``tracer.invoke`` raise
``NoSourceError`` saying so.
"""

from __future__ import annotations

import contextvars
import functools

import greenlet
import torch

from .backward import (
    _is_multithreading,
    _original_backward,
    _seq_of,
    _set_multithreading,
    missed_error,
)
from .errors import GradientError, NoSourceError
from .grads import add_grad_hook, read_grad, set_grad
from .interleaver import Interleaver
from .mediator import _DONE, Mediator
from .scan import _run_fake
from .sessions import _add_edits
from .waits import StopTrace
from .workers import _getcurrent, padded, set_tls_state, tls_state, user_location

_ENDED = object()  # what the backward greenlet returns when backprop is over


class _Ended:
    """What the forward greenlet returns when it ends: the traced call's output."""

    __slots__ = ("output",)

    def __init__(self, output):
        self.output = output


class InlineMediator(Mediator):
    """The mediator of a body running in the user's own greenlet; its parent is the forward
    greenlet. Never unwound or pooled: the greenlet is the user's."""

    __slots__ = ("user",)

    inline = True

    def start(self, parent_state=None) -> None:
        # called on the forward greenlet by Interleaver.run: hand control back to the body,
        # which is waiting in __enter__, and register what it asks for first
        self.parent = _getcurrent()
        self.greenlet = self.user
        self.interleaver.register(self, self.resume(None, None, parent_state))
        self.interleaver.wake()

    def get(self, envoy, kind):
        value = Mediator.get(self, envoy, kind)
        if type(value) is _Ended:  # the forward ended (stopped early) while the body waited
            raise self.missed_error()
        return value


def enter_inline_trace(tracer) -> None:
    """Start the forward of ``tracer`` (a trace given inputs) on its own greenlet; return to
    the caller, whose body then runs in place, once the forward waits for it."""
    model = tracer.model
    prepared = model._prepare_inputs(*tracer._args, **tracer._kwargs)
    args, kwargs, sizes = model._batch_inputs([prepared])
    inter = Interleaver(model._module, sum(sizes), model.__dict__)
    made = _add_edits(inter, model) if model._edits else []  # persistent edits run first
    user = _getcurrent()
    med = InlineMediator(inter, len(inter.mediators), None)
    med.user = user
    inter.mediators.append(med)
    if tracer._scan:
        def run():
            _run_fake(inter, model, args, kwargs)
    else:
        def run():
            return inter.run(lambda: tracer._forward(inter, args, kwargs))

    def main():
        try:
            return _Ended(run())
        finally:
            for scope in made:
                scope.reset()

    fwd = greenlet.greenlet(padded(main), user)
    fwd.gr_context = contextvars.copy_context()
    previous = getattr(user, "mediator", None)
    user.mediator = med
    tracer._inter = inter
    tracer.__dict__["_inline"] = (fwd, previous)
    try:
        fwd.switch()  # returns when the forward is ready for the body's first request
    except BaseException:
        _restore(tracer, user)
        raise


def exit_inline_trace(tracer, exc_type, exc) -> bool:
    """Let the forward finish (the body is done), or end it when the body raised; True when
    the exception is ``tracer.stop()``'s (suppressed)."""
    fwd = tracer.__dict__["_inline"][0]
    user = _getcurrent()
    state = tls_state()
    stop = isinstance(exc, StopTrace) and exc.ends(tracer)
    try:
        if not fwd.dead:
            if exc_type is None:
                fwd.switch(_DONE)
            elif stop:
                fwd.throw(exc)  # the forward stops there; values read so far stay
            else:
                fwd.throw(greenlet.GreenletExit)  # its wrappers come off (Interleaver.run)
    finally:
        _restore(tracer, user)
        now = tls_state()
        if now != state:
            set_tls_state(state, now)
    return stop


def _restore(tracer, user) -> None:
    fwd, previous = tracer.__dict__.pop("_inline")
    user.mediator = previous
    tracer._inter = None


def no_source_error(ctx, err: NoSourceError) -> NoSourceError:
    """The error for a block that cannot run in place: says why, and what to do."""
    what = ctx._what
    if getattr(ctx, "_backend", None) is not None:
        why = ("the trace is remote (remote=... / backend=...): what is sent to the model's "
               "server is the with-statement's source, which it runs there")
    elif what == "trace":
        why = ("a trace given no inputs runs several invokes, each of which must be compiled "
               "from its source" if not getattr(ctx, "_args", True) else
               "this kind of trace (generate) cannot run its body in place")
    elif what == "invoke":
        why = "tracer.invoke(...) blocks are compiled from their source to run interleaved"
    else:
        why = f"a `{what}` block is compiled from its source"
    return NoSourceError(
        f"{err} Without source, only a single-input trace (`with model.trace(x):`) and a "
        f"`with loss.backward():` block can run, in place; here {why}."
    )


# --------------------------------------------------------------------------- backward

_BASE_GRAD = torch._C.TensorBase.__dict__["grad"]


def _grad_get(t):
    # ``t.grad`` while a backward block runs in place: the body's reads go to the backward
    ctx = getattr(_getcurrent(), "grads", None)
    if ctx is not None and "_inline" in ctx.__dict__:
        return read_grad(t)
    return _BASE_GRAD.__get__(t)


def _grad_set(t, value):
    ctx = getattr(_getcurrent(), "grads", None)
    if ctx is not None and "_inline" in ctx.__dict__:
        set_grad(t, value)
    else:
        _BASE_GRAD.__set__(t, value)


def _grad_del(t):
    _BASE_GRAD.__delete__(t)


_GRAD_PROPERTY = property(_grad_get, _grad_set, _grad_del, _BASE_GRAD.__doc__)
_patched = [0]  # backward blocks running in place now (torch.Tensor.grad is patched while > 0)


def enter_inline_backward(ctx) -> None:
    """Arrange for the body of ``with loss.backward():`` to run in place: ``t.grad`` in it waits
    for backprop, which runs on a greenlet of its own, started by the first such read."""
    loss = ctx._loss
    if not loss.requires_grad:
        ctx._run(None)  # raises the usual GradientError
    user = _getcurrent()
    args = ctx._args

    def main():
        multithreading = _is_multithreading()
        _set_multithreading(False)
        try:
            _original_backward(loss, *args)
        finally:
            _set_multithreading(multithreading)
            ctx._finished = True
        return _ENDED

    bwd = greenlet.greenlet(padded(main), user)
    bwd.gr_context = contextvars.copy_context()
    ctx._runner = bwd
    ctx._done = False
    ctx._handles = []
    ctx.__dict__["_inline"] = (bwd, getattr(user, "grads", None))
    ctx.__dict__["_wait"] = functools.partial(_wait_inline, ctx)
    user.grads = ctx
    if not _patched[0]:
        torch.Tensor.grad = _GRAD_PROPERTY
    _patched[0] += 1


def _wait_inline(ctx, t):
    """The body (in the user's greenlet) asks for ``t``'s gradient: hook ``t``, let backprop
    run until it reaches it, and return the value the hook hands over."""
    ctx._pending = t
    ctx._handles.append(add_grad_hook(t, functools.partial(_hook_inline, ctx, t)))
    bwd = ctx._runner
    state = tls_state()
    try:
        value = bwd.switch()
    finally:
        now = tls_state()
        if now != state:
            set_tls_state(state, now)
    if value is _ENDED:
        ctx._pending = None
        raise missed_error(t, user_location(), ctx._args[3], ctx._last, ctx._loss)
    return value


def _hook_inline(ctx, t, grad):
    if _getcurrent() is not ctx._runner:
        raise GradientError(
            "a gradient hook fired outside the greenlet running the backward; nnsight_lite runs "
            "backward with autograd multithreading off to prevent this"
        )
    if ctx._pending is not t:
        return None
    ctx._pending = None
    value = None if grad is None else grad.clone()  # (None: an op that gives t no gradient)
    ctx.cur = t
    ctx.cur_value = value
    ctx._seq = _seq_of(t)
    ctx._last = t
    user = ctx.__dict__["_inline"][0].parent
    try:
        user.switch(value)  # back here when the body asks for the next gradient, or is done
    finally:
        ctx.cur = None
    out, ctx.cur_value = ctx.cur_value, None
    return out


def exit_inline_backward(ctx, exc_type, exc) -> bool:
    """Let the backward finish (or end it when the body raised, or stopped: that ends only the
    backward); remove every hook."""
    bwd, previous = ctx.__dict__["_inline"]
    user = _getcurrent()
    state = tls_state()
    try:
        if exc_type is None:
            if not bwd.dead:
                bwd.switch()  # runs the rest of the backward (all of it if nothing was read)
        elif bwd:  # started, and suspended in a hook: end it; the body's exception is the one
            try:
                bwd.throw(greenlet.GreenletExit)
            except BaseException:  # noqa: S110  (the backward failing as it is torn down)
                pass
    finally:
        ctx._finished = True
        for h in ctx._handles:
            h.remove()
        ctx._handles = []
        del ctx.__dict__["_inline"], ctx.__dict__["_wait"]
        ctx._runner = None
        user.grads = previous
        _patched[0] -= 1
        if not _patched[0]:
            del torch.Tensor.grad
        now = tls_state()
        if now != state:
            set_tls_state(state, now)
    # tracer.stop() in the block ends the backward pass only (as Backward._stoppable)
    return exc_type is not None and issubclass(exc_type, StopTrace)
