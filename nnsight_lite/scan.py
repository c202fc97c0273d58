"""``model.scan(...)``'s run: the interleaved forward on fake tensors (shapes, no compute).

    _run_fake(inter, model, args, kwargs)   run ``inter``'s bodies with the model's forward
                                            under torch's FakeTensorMode, leaving the model's
                                            buffers as they were

Apart from tracing.py because it is the one place that knows torch's fake tensors: a scan
is a trace in every other way (Tracer picks this run instead of the real forward). It needs
nothing of tracing.py; tracing.py and nosource.py import it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .interleaver import Interleaver


def _run_fake(inter: Interleaver, model, args, kwargs):
    """Run the interleaved forward on fake tensors: shapes and dtypes, no real compute."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    import torch

    # (a shape environment lets a data-dependent value, ``.item()``, be a symbol, as nnsight's
    # scan gives, instead of an error; shapes stay the real, static ones)
    mode = FakeTensorMode(allow_non_fake_inputs=True,
                          shape_env=ShapeEnv(assume_static_by_default=True))

    def fake(x):
        return mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x

    f_args = tuple(fake(a) for a in args)
    f_kwargs = {k: fake(v) for k, v in kwargs.items()}
    # (torch logs the traceback of an op its fake tensors cannot run before raising it: the
    # error the scan raises says the same)
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, log.disabled = log.disabled, True
    # a forward's state updates must not stick: a 0-dim buffer changed in place (BatchNorm's
    # num_batches_tracked, a step counter) is changed for real under fake tensors, and a buffer
    # the forward rebinds (self.count = self.count + 1) would be left a fake tensor
    buffers = [(m._buffers, dict(m._buffers)) for m in model._module.modules() if m._buffers]
    scalars = [(b, b.clone()) for _, held in buffers for b in held.values()
               if b is not None and b.dim() == 0]
    try:
        with mode:
            inter.run(lambda: model._run_forward(f_args, f_kwargs))
    finally:
        log.disabled = disabled
        for table, held in buffers:
            if len(table) != len(held) or any(table.get(k) is not v for k, v in held.items()):
                table.clear()
                table.update(held)
        with torch.no_grad():
            for b, value in scalars:
                b.copy_(value)


__all__ = ["_run_fake"]
