"""``nnsight.modeling.base``'s name: :class:`nnsight_lite.NNsight`."""

from ..model import NNsight

__all__ = ["NNsight"]
