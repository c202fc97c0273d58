"""nnsight's module paths for the Envoy and the ordering error, so that ``from
nnsight.intervention.envoy import Envoy`` runs with ``nnsight`` changed to ``nnsight_lite``."""
