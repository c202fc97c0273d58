"""Edits inside activation checkpointing: a warning instead of silently wrong gradients.

``torch.utils.checkpoint`` (what HF's ``model.activation_checkpointing_enable()``, formerly
``gradient_checkpointing_enable()``, uses in train mode) keeps no activations of the region it
wraps and runs the region's modules again during the backward pass. The recompute runs the
modules alone, without the trace's bodies, so an edit a body made there in the forward never
reaches the gradients:

- ``use_reentrant=True`` (HF's default): the region's forward ran under ``torch.no_grad()``,
  so the edit is not in the graph at all; what it used (a steering vector) gets no gradient;
- ``use_reentrant=False``: the backward uses the forward's graph with activations recomputed
  unedited, so gradients that use the activations after the edit mix the two models.

A forward hook does not have the problem (it runs again in the recompute); a body cannot be
run again. So a trace that edits, replaces or skips a value inside such a region, with
gradients on, warns once per place (module, invoke, line) and says what to do. Finding the
region costs one C call per served value with gradients on; the rest runs only inside one.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.utils.checkpoint as _checkpoint_module

from .workers import user_location

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks  # (the inlined check's call)
_FILE = os.path.normcase(os.path.abspath(_checkpoint_module.__file__))
_REENTRANT = "use_reentrant=True"
_NON_REENTRANT = "use_reentrant=False"
_WARNED: dict = {}  # the warnings registry: each place warns once, as warnings.warn does


def region(inter, slot, state: int) -> "str | None":
    """How the module call being served is checkpointed (``use_reentrant=...``), or None.

    Called where a served value has gradients on at the trace's start and either a
    saved-tensor hook is set or grad mode is off here (``Interleaver._checkpointed``)."""
    hooks = _top_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", None) == _checkpoint_module.__name__:
        return _NON_REENTRANT
    if state & 1:
        return None
    # grad off though the trace began with it on: the model turned it off around this call, as
    # a reentrant checkpoint's forward does. Found by the stack, once per module and trace.
    seen = inter.no_grad_regions
    if seen is None:
        seen = inter.no_grad_regions = {}
    found = seen.get(slot, 0)
    if found == 0:
        found = seen[slot] = _reentrant_on_stack()
    return found


def _reentrant_on_stack() -> "str | None":
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name == "forward" and os.path.normcase(code.co_filename) == _FILE:
            return _REENTRANT  # CheckpointFunction.forward
        f = f.f_back
    return None


def versions(value) -> list:
    """``(id, _version)`` of the tensors in ``value`` and the containers it is made of (an
    in-place edit bumps a version, a replacement changes an id)."""
    seen = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            seen.append((id(v), v._version))
        elif isinstance(v, (tuple, list)):
            seen.append(id(v))
            stack.extend(v)
        elif isinstance(v, dict):
            seen.append(id(v))
            stack.extend(v.values())
    return seen


def warn_edited(meds, slot, kind: str, how: str) -> None:
    """Warn that ``meds`` (the bodies served there) changed ``slot``'s ``kind`` inside a
    checkpointed region (``how``: its ``use_reentrant``)."""
    bodies = [m for m in meds if m.switches]
    who = ", ".join(m.label() for m in bodies) or "a body"
    where, filename, line = _location(bodies)
    path = f"{slot.label()}.{kind}"
    if how == _REENTRANT:
        effect = ("that region's forward ran under torch.no_grad(), so the edit is not in the "
                  "autograd graph: what it used (a steering vector, a parameter) gets no gradient "
                  "through it, and the other gradients are the unedited model's")
    else:
        effect = ("the activations recomputed after the edit are the unedited model's, so "
                  "gradients that use them mix the edited and the unedited model")
    text = (
        f"{who} changed {path} (its body {where}), which runs inside activation checkpointing "
        f"(torch.utils.checkpoint, {how}; HF models use it in train mode after "
        "activation_checkpointing_enable(), formerly gradient_checkpointing_enable()). The "
        "forward's values are edited, but a backward pass recomputes the checkpointed modules "
        f"without the trace's bodies: {effect}. To take gradients of an edited model, turn "
        "checkpointing off for this trace (model.activation_checkpointing_disable()), or edit a "
        "module outside the checkpointed blocks; hooks in the forward would be run again by "
        "the recompute, bodies are not."
    )
    warnings.warn_explicit(text, UserWarning, filename, line, registry=_WARNED)


def _location(bodies) -> tuple:
    """(words, file, line): where the body is now (the read after the edit), or where it
    ended, its with-block's lines."""
    for m in bodies:
        g = m.greenlet
        frame = getattr(g, "gr_frame", None) if g is not None and not m.done else None
        if frame is not None:
            where = user_location(frame)
            if where != "<unknown>":
                filename, _, line = where.rpartition(":")
                return f"is now at {where}, the read after the edit", filename, int(line)
        code = getattr(m.run_fn, "args", (None,))[0]
        if hasattr(code, "co_lines"):
            lines = [line for _, _, line in code.co_lines() if line]
            if lines:
                first, last = min(lines), max(lines)
                return f"at {code.co_filename}:{first}-{last}", code.co_filename, first
    return "is not known", "<unknown>", 0
