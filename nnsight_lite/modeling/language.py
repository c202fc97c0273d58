"""``nnsight.modeling.language``'s name: :class:`nnsight_lite.LanguageModel`."""

from ..language import LanguageModel

__all__ = ["LanguageModel"]
