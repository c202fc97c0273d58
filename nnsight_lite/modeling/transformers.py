"""``nnsight.modeling.transformers``: :class:`TransformersModel`, nnsight 0.8's name for the
Hugging Face wrapper, and :class:`WrapperModule`, the identity module nnsight's tutorials route
a value through to read it (``sae.encode.output``)."""

from __future__ import annotations

import torch

from ..language import LanguageModel


class TransformersModel(LanguageModel):
    """nnsight 0.8's name for a wrapped Hugging Face model (``from nnsight import
    TransformersModel``). Here it is :class:`nnsight_lite.LanguageModel`: a model and its
    tokenizer, loaded with ``AutoModelForCausalLM`` unless ``task=`` or ``automodel=`` names
    another class; ``.trace``, ``.generate`` and everything else are the same.

    Example::

        model = TransformersModel("path/to/checkpoint", dispatch=True)
        with model.trace("The Eiffel Tower is in the city of"):
            logits = model.output.logits.save()

    ``task=`` (0.8's way to pick the model class): ``"text-generation"`` (the default) or
    another pipeline task of transformers, loaded with that task's auto class; a task whose
    inputs are not text alone (``"image-text-to-text"``) loads the processor too, and invokes
    take ``images=`` (processors.py).
    """


class WrapperModule(torch.nn.Module):
    """An identity module: returns what it is called with (its one argument, or the tuple of
    several), so that a value computed in plain code becomes a module's ``.output``.

    Example (nnsight's SAE tutorial)::

        class SAE(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.encode = WrapperModule()       # model.layers[12].sae.encode.output
            def forward(self, x):
                return self.encode(torch.relu(x @ self.W_enc)) @ self.W_dec
    """

    def forward(self, *args, **kwargs):
        return args[0] if len(args) == 1 else args


__all__ = ["TransformersModel", "WrapperModule"]
