"""nnsight's module paths for its model classes, so that ``from nnsight.modeling.language
import LanguageModel`` runs with ``nnsight`` changed to ``nnsight_lite``.

    base.NNsight                    the wrapper of any torch.nn.Module
    language.LanguageModel          a Hugging Face causal LM and its tokenizer
    transformers.TransformersModel  nnsight 0.8's name for the Hugging Face wrapper
    transformers.WrapperModule      an identity module: a value routed through it is an .output
    vlm.VisionLanguageModel         the older name of TransformersModel(task="image-text-to-text")
    diffusion.DiffusionModel        a diffusers pipeline (needs diffusers)
"""

from . import base, diffusion, language, transformers, vlm  # (attributes after ``import nnsight_lite``)

__all__ = ["base", "diffusion", "language", "transformers", "vlm"]
