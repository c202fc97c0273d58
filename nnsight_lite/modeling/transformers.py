"""``nnsight.modeling.transformers``: :class:`TransformersModel`, nnsight 0.8's name for the
Hugging Face wrapper."""

from __future__ import annotations

from ..language import LanguageModel


class TransformersModel(LanguageModel):
    """nnsight 0.8's name for a wrapped Hugging Face model (``from nnsight import
    TransformersModel``). Here it is :class:`nnsight_lite.LanguageModel`: a causal LM and its
    tokenizer, loaded with ``AutoModelForCausalLM`` unless ``automodel=`` names another auto
    class; ``.trace``, ``.generate`` and everything else are the same.

    Example::

        model = TransformersModel("path/to/checkpoint", dispatch=True)
        with model.trace("The Eiffel Tower is in the city of"):
            logits = model.output.logits.save()

    ``task=`` (0.8's way to pick the model class) may be ``"text-generation"`` (the default);
    another task raises ``ValueError``, since this class loads causal LMs only (as
    ``LanguageModel`` does).
    """


__all__ = ["TransformersModel"]
