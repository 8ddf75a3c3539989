"""Policies by name, as `mosaic simulate --policy` and the controller's config spell them.

| name | policy |
|---|---|
| `mosaic` | `MosaicAutoscaler` (decode tokens/s, P/D ratio, cost-aware) |
| `hpa-util:T` | Kubernetes HPA on GPU utilisation, target T (default 0.7); starting instances under its missing-metrics rule |
| `hpa-waiting:T` | KEDA on `num_requests_waiting`, AverageValue T per replica (default 4): ceil(total / T) |
| `dynamo[:I]` | Dynamo-style planner, re-planning every I seconds (default 180) |
| `static[:pool=N,...]` | fixed counts (default: the configured replicas, within the pool's bounds) |
| `fixed` | no autoscaler at all |
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from scheduler.autoscaler.baselines import DynamoPlanner, HpaPolicy, StaticPolicy
from scheduler.autoscaler.policy import AutoscalerConfig, MosaicAutoscaler
from scheduler.autoscaler.signals import PoolSpec, ScalingPolicy

POLICY_NAMES = ("mosaic", "hpa-util", "hpa-waiting", "dynamo", "static", "fixed")


class PolicyError(ValueError):
    """An unknown policy name or a bad parameter; the message lists the valid spellings."""


def _positive(spec: str, what: str, arg: str, default: float, upper: float | None = None) -> float:
    """`arg` (or `default` when empty) as a finite number > 0 (and ≤ `upper`): a NaN, infinite, zero or
    negative target or interval would pin the pools, re-plan every decision or never plan at all."""
    if not arg:
        return default
    try:
        value = float(arg)
    except ValueError:
        raise PolicyError(f"policy {spec!r}: bad parameter: {what} must be a number, got {arg!r}") from None
    if not math.isfinite(value) or value <= 0 or (upper is not None and value > upper):
        wanted = "a finite number > 0" if upper is None else f"a finite number in (0, {upper:g}]"
        raise PolicyError(f"policy {spec!r}: bad parameter: {what} must be {wanted}, got {arg}")
    return value


def _static_counts(
    spec: str, arg: str, initial: Mapping[str, int], pools: Sequence[PoolSpec], check_bounds: bool
) -> dict[str, int]:
    bounds = {p.name: (p.min_replicas, p.max_replicas) for p in pools}
    # a pool not given a count keeps the one it has, within its bounds: a pool under its minimum is raised
    # to it, as by every other policy (the drivers leave that to the policy, `within_bounds`)
    counts = {
        name: min(max(n, bounds[name][0]), bounds[name][1]) if name in bounds else n
        for name, n in initial.items()
    }
    given: set[str] = set()
    for item in filter(None, arg.split(",")):
        pool, eq, n = item.partition("=")
        if pool not in counts:
            raise PolicyError(f"static policy: unknown pool {pool!r}; pools: {', '.join(counts)}")
        if pool in given:  # which count wins would be a guess
            raise PolicyError(f"policy {spec!r}: bad parameter: pool {pool!r} is given twice")
        given.add(pool)
        text = n.strip()
        # an integer ≥ 0: no sign, no fraction, no nan/inf
        if not eq or not (text.isascii() and text.isdigit()):
            raise PolicyError(
                f"policy {spec!r}: bad parameter: the count of pool {pool!r} must be an integer ≥ 0 "
                f"(static:POOL=N), got {n!r}"
            )
        count = int(text)
        if check_bounds and pool in bounds:
            lo, hi = bounds[pool]
            if not lo <= count <= hi:
                raise PolicyError(
                    f"policy {spec!r}: bad parameter: the count of pool {pool!r} ({count}) is outside its "
                    f"min_replicas..max_replicas ({lo}..{hi})"
                )
        counts[pool] = count
    return counts


def build_policy(
    spec: str,
    pools: Sequence[PoolSpec],
    config: AutoscalerConfig,
    initial: Mapping[str, int],
    *,
    check_bounds: bool = False,
) -> ScalingPolicy | None:
    """The policy `spec` names, every parameter checked (PolicyError naming the policy and the argument).

    `check_bounds`: refuse `static:` counts outside their pool's [min_replicas, max_replicas] (`mosaic
    simulate`, and the gateway config when it loads, with each pool's configured bounds). Off by default:
    the live controller pins unmanaged pools at min = max = their current count, so a check there would
    refuse at run time what the config accepted; it clamps every policy's targets to the bounds instead.
    """
    name, colon, arg = spec.partition(":")
    if name in ("mosaic", "fixed") and colon:
        raise PolicyError(f"policy {spec!r}: bad parameter: {name} takes no parameter")
    try:
        if name == "mosaic":
            return MosaicAutoscaler(pools, config)
        if name == "hpa-util":
            target = _positive(spec, "the GPU-utilisation target (hpa-util:T)", arg, 0.7, upper=1.0)
            return HpaPolicy(pools, "gpu_utilization", target)
        if name == "hpa-waiting":
            target = _positive(spec, "the waiting requests per replica (hpa-waiting:T)", arg, 4.0)
            return HpaPolicy(pools, "num_requests_waiting", target)
        if name == "dynamo":
            return DynamoPlanner(
                pools,
                interval_s=_positive(spec, "the re-planning interval in seconds (dynamo:I)", arg, 180.0),
                utilization_target=config.utilization_target,
            )
        if name == "static":
            return StaticPolicy(_static_counts(spec, arg, initial, pools, check_bounds))
        if name == "fixed":
            return None
    except ValueError as exc:
        if isinstance(exc, PolicyError):
            raise
        raise PolicyError(f"policy {spec!r}: bad parameter ({exc})") from None
    raise PolicyError(f"unknown policy {spec!r}; valid: {', '.join(POLICY_NAMES)}")
