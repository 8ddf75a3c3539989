"""Policies by name, as `mosaic simulate --policy` and the controller's config spell them.

| name | policy |
|---|---|
| `mosaic` | `MosaicAutoscaler` (decode tokens/s, P/D ratio, cost-aware) |
| `hpa-util:T` | Kubernetes HPA on GPU utilisation, target T (default 0.7); starting instances under its missing-metrics rule |
| `hpa-waiting:T` | KEDA on `num_requests_waiting`, AverageValue T per replica (default 4): ceil(total / T) |
| `dynamo[:I]` | Dynamo-style planner, re-planning every I seconds (default 180) |
| `static[:pool=N,...]` | fixed counts (default: the configured replicas) |
| `fixed` | no autoscaler at all |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from scheduler.autoscaler.baselines import DynamoPlanner, HpaPolicy, StaticPolicy
from scheduler.autoscaler.policy import AutoscalerConfig, MosaicAutoscaler
from scheduler.autoscaler.signals import PoolSpec, ScalingPolicy

POLICY_NAMES = ("mosaic", "hpa-util", "hpa-waiting", "dynamo", "static", "fixed")


class PolicyError(ValueError):
    """An unknown policy name or a bad parameter; the message lists the valid spellings."""


def build_policy(
    spec: str, pools: Sequence[PoolSpec], config: AutoscalerConfig, initial: Mapping[str, int]
) -> ScalingPolicy | None:
    name, _, arg = spec.partition(":")
    try:
        if name == "mosaic":
            return MosaicAutoscaler(pools, config)
        if name == "hpa-util":
            return HpaPolicy(pools, "gpu_utilization", float(arg or 0.7))
        if name == "hpa-waiting":
            return HpaPolicy(pools, "num_requests_waiting", float(arg or 4))
        if name == "dynamo":
            return DynamoPlanner(
                pools,
                interval_s=float(arg or 180),
                utilization_target=config.utilization_target,
                observed_context=config.observed_context,
            )
        if name == "static":
            counts = dict(initial)
            for item in filter(None, arg.split(",")):
                pool, _, n = item.partition("=")
                if pool not in counts:
                    raise PolicyError(f"static policy: unknown pool {pool!r}; pools: {', '.join(counts)}")
                counts[pool] = int(n)
            return StaticPolicy(counts)
        if name == "fixed":
            return None
    except ValueError as exc:
        if isinstance(exc, PolicyError):
            raise
        raise PolicyError(f"policy {spec!r}: bad parameter ({exc})") from None
    raise PolicyError(f"unknown policy {spec!r}; valid: {', '.join(POLICY_NAMES)}")
