"""nnsight's module paths for the Envoy and the ordering error, so that ``from
nnsight.intervention.envoy import Envoy`` runs with ``nnsight`` changed to ``nnsight_lite``."""

from . import envoy, interleaver  # (attributes after ``import nnsight_lite``, as nnsight's are)

__all__ = ["envoy", "interleaver"]
