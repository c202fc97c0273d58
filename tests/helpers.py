"""Ground truth with plain PyTorch hooks, a reference-cycle probe, and a check for body
greenlets left suspended."""

from __future__ import annotations

import gc

import torch

from nnsight_lite.workers import _workers


def record(model: torch.nn.Module, names, *args, edits=None, **kwargs):
    """Run ``model`` with plain forward hooks; return ({(name, call): output}, final output).

    ``edits`` maps a module name to ``fn(call, output) -> new output or None`` (None: kept).
    """
    seen = {}
    counts = {}
    handles = []
    edits = edits or {}
    mods = dict(model.named_modules())
    for name in set(names) | set(edits):
        def hook(mod, inp, out, name=name):
            c = counts.get(name, 0)
            counts[name] = c + 1
            if name in edits:
                new = edits[name](c, out)
                if new is not None:
                    out = new
            seen[(name, c)] = out.detach().clone() if isinstance(out, torch.Tensor) else out
            return out
        handles.append(mods[name].register_forward_hook(hook))
    try:
        out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen, out


def settle(passes: int = 10) -> None:
    """Collect until a pass frees nothing: objects that a finalizer or weakref callback run by
    one pass lets go of (dynamo's compile state after ``torch._dynamo.reset()``) are only
    garbage for the next pass, and would otherwise count against whatever runs after it."""
    for _ in range(passes):
        if not gc.collect():
            return


def cycles_left_by(fn) -> list:
    """Run ``fn`` with the garbage collector off; return the objects it left in reference
    cycles (what only the collector would free), by type name."""
    settle()
    gc.disable()
    try:
        fn()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def suspended_bodies() -> list[str]:
    """Worker greenlets still suspended in a body. Idle pooled workers (no body attached) are
    fine. No gc.collect(): a greenlet that only the collector would end counts as left behind.
    ``_workers`` holds every live worker weakly, so there is no scan of gc.get_objects()."""
    return [
        f"suspended {type(w).__name__} holding a body"
        for w in list(_workers)
        if w and not w.dead and (w.mediator is not None or w.grads is not None)
    ]
