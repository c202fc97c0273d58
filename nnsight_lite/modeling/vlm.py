"""``nnsight.modeling.vlm``: :class:`VisionLanguageModel`, the older name of an image-text model
(nnsight 0.8 keeps it, deprecated, for ``TransformersModel(path, task="image-text-to-text")``)."""

from __future__ import annotations

import warnings

from ..compat import NNsightDeprecationWarning
from .transformers import TransformersModel


class VisionLanguageModel(TransformersModel):
    """``TransformersModel(path, task="image-text-to-text")`` under its older name; warns
    (``NNsightDeprecationWarning``) when made, as nnsight 0.8 does.

    Example::

        model = VisionLanguageModel("llava-hf/llava-1.5-7b-hf", dispatch=True)
        with model.generate(text=prompt, images=[image], max_new_tokens=3) as tracer:
            ids = tracer.result.save()
    """

    def __init__(self, *args, **kwargs):
        warnings.warn("VisionLanguageModel is deprecated; use TransformersModel(path, "
                      "task='image-text-to-text') instead", NNsightDeprecationWarning,
                      stacklevel=2)
        kwargs.setdefault("task", "image-text-to-text")
        super().__init__(*args, **kwargs)


__all__ = ["VisionLanguageModel"]
