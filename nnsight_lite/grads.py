"""What ``t.grad`` and ``t.grad = g`` mean in a body (bodies call them through ``RUNTIME``).

    read_grad / set_grad   inside ``with loss.backward():`` the gradient as backprop reaches
                           ``t`` / the gradient that flows on from it; outside, a tensor's own
                           ``.grad`` (an activation's raises, saying to use a backward block)
    add_grad_hook          ``t.register_hook(hook)`` without that method's per-call overhead
    retain_grad            the ``Tensor.retain_grad`` patch: on an invoke's value (its rows of the
                           batch tensor) it retains those rows of the batch tensor's gradient

The backward block they talk to (``Backward``, found as the running greenlet's ``grads``) and
the ``Tensor.backward`` patch are backward.py's, which imports this module: importing either
puts ``read_grad``/``set_grad`` in ``RUNTIME``.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict

import torch

from .backward_errors import _describe, grad_expr
from .batching import merge
from .capture import GRAD_NAME, SET_GRAD_NAME
from .context import RUNTIME
from .errors import GradientError
from .workers import _getcurrent, user_location

_Tensor = torch.Tensor


def _current_backward():
    return getattr(_getcurrent(), "grads", None)


class _HookHandle:
    """Removes one hook that add_grad_hook put in a tensor's hook dict."""

    __slots__ = ("hooks", "key")

    def __init__(self, hooks, key):
        self.hooks = hooks
        self.key = key

    def remove(self) -> None:  # idempotent; lets go of the hook (it refers to its owner)
        hooks, self.hooks = self.hooks, None
        if hooks is not None:
            hooks.pop(self.key, None)
            self.key = None


def add_grad_hook(t, hook):
    """``t.register_hook(hook)``, returning a handle whose ``remove()`` takes it off again.

    For a plain tensor it does what ``Tensor.register_hook`` does (add ``hook`` to the tensor's
    ``_backward_hooks`` dict, which torch calls as backprop reaches the tensor, creating and
    attaching the dict the first time) without that method's per-call overhead: its
    ``__torch_function__`` check, an import and a RemovableHandle, about half of what reading one
    gradient costs. The hook is its own key, so it never collides with torch's integer ids.
    Tensor subclasses go through ``register_hook`` itself (they may override it).
    """
    if type(t) is not _Tensor:
        return t.register_hook(hook)
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        fn = t.grad_fn
        if fn is not None:
            fn._register_hook_dict(t)
    hooks[hook] = hook
    return _HookHandle(hooks, hook)


def read_grad(t):
    """``t.grad`` in a body: the gradient at the moment backprop reaches ``t``."""
    ctx = _current_backward()
    if ctx is not None:
        return ctx.request(t)
    if not isinstance(t, torch.Tensor) or t.is_leaf or t.retains_grad:
        return t.grad
    with warnings.catch_warnings():  # (torch warns at reading a non-leaf's grad: the error
        warnings.simplefilter("ignore", UserWarning)  # below says more, or one was assigned)
        grad = t.grad
    if grad is not None:
        return grad
    where = user_location()
    raise GradientError(
        f".grad of an activation ({_describe(t)}) was read at {where} outside a "
        "backward context. Activation gradients exist only while backprop runs: write\n"
        f"    with loss.backward():\n        g = {grad_expr(where)}.grad.save()\n"
        "(inside the trace or after it, on saved tensors) instead of calling loss.backward() "
        "and reading .grad afterwards."
    )


def set_grad(t, value) -> None:
    """``t.grad = value`` in a body: replace the gradient that flows on from ``t``."""
    ctx = _current_backward()
    if ctx is None:
        if isinstance(t, torch.Tensor) and not t.is_leaf and not t.retains_grad:
            where = user_location()
            raise GradientError(
                f".grad of an activation ({_describe(t)}) was assigned at {where} "
                "outside a backward context, where it changes no gradient (torch would keep "
                "it as a plain attribute that backprop never reads). Replace the gradient that "
                "flows on from it while backprop runs:\n"
                f"    with loss.backward():\n        {grad_expr(where)}.grad = new_grad\n"
            )
        t.grad = value
        return
    rows = _rows_of(t)
    grad = ctx.request(t)
    if grad is None and value is not None:
        raise GradientError(
            f".grad of a {_describe(t)} was set at {user_location()}, but backprop reached it "
            "with no gradient (None: the operation that uses it gives it none, as a quantized "
            "or otherwise non-differentiable op does), and autograd cannot replace a None "
            "gradient with a tensor. Nothing flows on from it to edit."
        )
    if rows is None:
        if value.__class__ is _Tensor and value.shape != grad.shape:  # (autograd refuses it)
            raise GradientError(
                f".grad of a {_describe(t)} was set at {user_location()} to a {_describe(value)}; "
                f"the gradient that flows on from it must keep its shape {tuple(grad.shape)}. "
                "Set a tensor of that shape, or edit the gradient in place (`h.grad[:] = ...`)."
            )
        ctx.cur_value = value
    else:  # an invoke's rows of a batched activation: replace only those rows
        full = ctx.cur_value
        ctx.cur_value = merge(full, value, rows[1], rows[2], full.shape[0])


RUNTIME[GRAD_NAME] = read_grad
RUNTIME[SET_GRAD_NAME] = set_grad


def _rows_of(t):
    return getattr(t, "_nnsight_rows", None) if isinstance(t, torch.Tensor) else None


_original_retain_grad = torch.Tensor.retain_grad


def retain_grad(self) -> None:
    """``Tensor.retain_grad``; on an invoke's value in a trace of several invokes (its rows of
    the batch tensor, a slice the forward does not go on from) it retains the rows' gradient
    of the batch tensor, as ``retain_grad`` on the one invoke's value (the batch tensor itself)
    does: ``h.grad`` after a plain ``loss.backward()`` is the gradient w.r.t. those rows,
    where backprop never reaches the slice itself and left it None. As torch does, a second
    backward adds to it."""
    rows = _rows_of(self)
    if rows is None or self.is_leaf or not self.requires_grad:
        return _original_retain_grad(self)
    base, start, size = rows
    ref = weakref.ref(self)
    seen = False  # (until the first gradient, reading the view's .grad makes torch warn)

    def hook(grad):
        nonlocal seen
        view = ref()
        if view is not None:
            part = grad[start:start + size]
            old = view.grad if seen else None
            view.grad = part.clone() if old is None else old + part
            seen = True
        return None

    base.register_hook(hook)
    return None


if not getattr(torch.Tensor.retain_grad, "__nnsight_lite__", False):  # (once: reload)
    retain_grad.__wrapped__ = _original_retain_grad
    retain_grad.__nnsight_lite__ = True
    torch.Tensor.retain_grad = retain_grad
