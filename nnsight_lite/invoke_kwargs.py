"""An invoke's keywords that the call's own keywords of the same name override.

    _yield_to(call, inv, name)  ``inv``'s keywords less those the call gives for the whole
                                batch, with a warning at the invoke where the values differ
    _same(a, b), _show(value)   how those values are compared and named in the warning
    _WARNED                     the warnings' registry (each line warns once)

Apart from tracing.py because it is one small policy, read on its own: the keywords of a
trace given no inputs (``model.trace(use_cache=False)``), or generate's, against an invoke's.
It needs nothing of tracing.py at run time (an Invoker is read through ``_kwargs``, ``_body``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .tracing import Invoker


def _yield_to(call: dict, inv: "Invoker", name: str) -> dict:
    """``inv``'s keywords without those ``call`` (the keywords of ``name(...)``, for the whole
    batch) also gives; a warning at the invoke for each whose value differs there."""
    kwargs = inv._kwargs
    clash = [k for k in kwargs if k in call]
    if not clash:
        return kwargs
    for k in clash:
        if not _same(kwargs[k], call[k]):
            body = inv._body
            warnings.warn_explicit(
                f"tracer.invoke(..., {k}={_show(kwargs[k])}) is overridden by {name}(..., "
                f"{k}={_show(call[k])}): {name}()'s keywords apply to the whole batch; give "
                f"{k} in one place", UserWarning, body.filename, body.lineno,
                registry=_WARNED)  # (once per line, as warnings.warn: not at every trace)
    return {k: v for k, v in kwargs.items() if k not in call}


_WARNED: dict = {}  # the warnings registry of _yield_to's warnings


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a tensor of several values, an odd __eq__: different
        return False


def _show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["_yield_to"]
