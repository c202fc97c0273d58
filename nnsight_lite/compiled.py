"""Models that hold torch.compile'd modules: a trace runs their code as plain Python.

    is_compiled(module)   whether torch.compile wrapped the module, its call or its forward
    eager(forward)        ``forward()`` with every torch.compile'd callable running eagerly

A trace needs every module call of its forward in Python: the call entries and forward
wrappers (calls.py) count each call and hand its values to the bodies, and the bodies run on
greenlets switched to from inside those calls. Dynamo compiling such a forward would trace into
the entries (a graph break at each), then into the bodies' own code, which it cannot compile
(``NNsight(torch.compile(net))`` failed in dynamo's side-effect tracking; ``module.compile()``
cost seconds of recompiles per trace, and each trace a recompile of the next plain call). So a
trace of a model holding a compiled module runs its forward under
``torch.compiler.set_stance("force_eager")``: the compiled modules run their original code, as
the hooks of an eager forward see it, and their compiled code is untouched for calls outside
traces. Only such models pay for the stance (~60 µs a trace).
"""

from __future__ import annotations

import sys
import threading

from .calls import _ENTRY, traced_slot


def is_compiled(module) -> bool:
    """Whether ``module`` is torch.compile's wrapper of a module (``torch.compile(net)``) or
    has a compiled call of its own (``module.compile()``: not a trace's call entry) or a
    compiled forward (``module.forward = torch.compile(module.forward)``)."""
    d = module.__dict__
    call = d.get(_ENTRY)
    if call is not None and traced_slot(call) is None:
        return True
    if getattr(d.get("forward"), "_torchdynamo_orig_callable", None) is not None:
        return True
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # (never imported here: it is slow,
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)  # and compiling did)


def eager(forward):
    """``forward()`` with torch.compile's callables running their original code.

    The stance is process-wide, and traces on other threads may overlap this one in any order:
    the first trace running sets it and the last one to end puts back the stance it found
    (each trace putting back the stance it found itself would leave force_eager on for good
    where two overlap without nesting)."""
    import torch

    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # torch < 2.6: dynamo runs as it would (the trace may recompile)
        return forward()
    global _users, _setter
    with _lock:
        if _users == 0:
            _setter = set_stance("force_eager")  # (sets it now, and keeps the one before)
        _users += 1
    try:
        return forward()
    finally:
        with _lock:
            _users -= 1
            if _users == 0:  # the last trace running puts back the stance the first found
                _setter.__exit__(None, None, None)
                _setter = None


_lock = threading.Lock()
_users = 0  # traces running under the eager stance, on any thread
_setter = None  # torch's set_stance("force_eager") that the first of them made
