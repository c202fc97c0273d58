"""What ``.save()`` and ``nnsight_lite.save`` do, and the tensor methods nnsight_lite adds.

    save(obj)        keep ``obj`` after the trace: its name in the body is bound in the caller
    save_in_body     what ``obj.save()`` means inside a body
    _saved_stack()   this thread's stack of the running blocks' saved dicts (id -> value)
    Tensor.save      ``tensor.save()`` (and ``Tensor.value``, an error pointing past nnsight's
                     old proxies)
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def _saved_stack() -> list:
    stack = getattr(_local, "saved", None)
    if stack is None:
        stack = _local.saved = []
    return stack


def save(obj):
    """Keep ``obj`` after the trace: its name in the body is bound in the caller's scope.

    Example::

        with model.trace(x):
            shapes = nnsight_lite.save([])
            shapes.append(model.layer1.output.shape)
        print(shapes)

    Outside a trace it does nothing and returns ``obj``.
    """
    stack = _saved_stack()
    if stack:
        stack[-1][id(obj)] = obj
    return obj


def save_in_body(obj):
    """What ``obj.save()`` means inside a body: the object's own ``save()`` if its class has
    one, else :func:`save`."""
    own = getattr(type(obj), "save", None)
    if own is not None and own is not _tensor_save:
        return obj.save()
    stack = getattr(_local, "saved", None)  # (save(obj), in line: a body's every .save())
    if stack:
        stack[-1][id(obj)] = obj
    return obj


def _tensor_save(self):
    """Keep this tensor after the trace (``h = model.layer.output.save()``). Returns ``self``."""
    return save(self)


torch.Tensor.save = _tensor_save


def _old_value(self):
    raise AttributeError(
        "'Tensor' object has no attribute 'value': in nnsight_lite module values are real "
        "tensors already, so drop `.value` (nnsight's proxies needed it; these do not)"
    )


if not hasattr(torch.Tensor, "value"):
    torch.Tensor.value = property(_old_value)
