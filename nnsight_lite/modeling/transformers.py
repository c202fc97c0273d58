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
    another task raises ``ValueError``, since this class loads causal LMs only.
    """

    def __init__(self, model, *args, task: str | None = None, **kwargs):
        if task not in (None, "text-generation"):
            raise ValueError(
                f"TransformersModel(..., task={task!r}): nnsight_lite wraps causal language "
                "models only (task='text-generation'); load another kind of model with "
                "transformers yourself and wrap it with NNsight(model)"
            )
        super().__init__(model, *args, **kwargs)


__all__ = ["TransformersModel"]
