"""``nnsight.intervention.envoy``'s name: :class:`nnsight_lite.Envoy`."""

from ..envoy import Envoy

__all__ = ["Envoy"]
