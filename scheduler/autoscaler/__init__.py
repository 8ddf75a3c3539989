"""P/D-coordinated autoscaling (after HeteroScale) and the baselines it is evaluated against.

Every policy implements `ScalingPolicy.decide(obs) -> ScalingDecision`: pure and deterministic, with `now`
inside the observation, so the live controller and the cluster simulator drive the same objects.
"""

from scheduler.autoscaler.signals import (
    Observation,
    PoolObservation,
    PoolSpec,
    ScalingDecision,
    ScalingPolicy,
)

__all__ = ["Observation", "PoolObservation", "PoolSpec", "ScalingDecision", "ScalingPolicy"]
