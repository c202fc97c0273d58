"""``nnsight.intervention.interleaver``'s name: :class:`nnsight_lite.OutOfOrderError`."""

from ..errors import OutOfOrderError

__all__ = ["OutOfOrderError"]
