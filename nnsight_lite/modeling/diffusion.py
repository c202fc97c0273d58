"""``nnsight.modeling.diffusion``: :class:`DiffusionModel`, a diffusers pipeline traced like any
module (nnsight_lite/diffusion.py; needs ``diffusers``)."""

from __future__ import annotations

from ..diffusion import DiffusionModel, PipelineModule

__all__ = ["DiffusionModel", "PipelineModule"]
