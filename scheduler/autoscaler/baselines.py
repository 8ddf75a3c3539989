"""Baselines the Mosaic policy is evaluated against, in the same simulator and on the same trace.

- `HpaPolicy`: Kubernetes' Horizontal Pod Autoscaler, each pool on its own: desired = ceil(current ·
  metric / target), no change within ±tolerance (0.1), scale-down to the highest recommendation of the
  last 300 s. Metrics: `gpu_utilization` (per-pool mean) or `num_requests_waiting` per instance (KEDA's
  recipe for vLLM).
- `StaticPolicy`: fixed counts, e.g. provisioned for the peak.
- `DynamoPlanner`: Dynamo's planner: every `interval_s` (180 s) forecast request rate and input/output
  lengths, divide by profiled per-replica prefill and decode capacity, size P and D separately. The
  forecaster is Holt's linear trend (level + trend), a stand-in for Dynamo's ARIMA/Kalman/Prophet.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from scheduler.autoscaler.signals import Observation, PoolSpec, ScalingDecision


class HpaPolicy:
    def __init__(
        self,
        pools: Sequence[PoolSpec],
        metric: Literal["gpu_utilization", "num_requests_waiting"],
        target: float,
        tolerance: float = 0.1,
        scale_down_window_s: float = 300.0,
    ) -> None:
        if target <= 0:
            raise ValueError("HPA target must be > 0")
        self.pools = tuple(pools)
        self.metric = metric
        self.target = target
        self.tolerance = tolerance
        self.window = scale_down_window_s
        self._history: dict[str, deque[tuple[float, int]]] = {p.name: deque() for p in pools}

    def decide(self, obs: Observation) -> ScalingDecision:
        targets: dict[str, int] = {}
        reasons: dict[str, str] = {}
        for pool in self.pools:
            po = obs.pools[pool.name]
            n = max(po.provisioned, 1)  # HPA never scales a target to zero on its own
            if self.metric == "gpu_utilization":
                value = po.gpu_utilization
            else:
                value = po.num_waiting / max(po.ready, 1)
            ratio = value / self.target
            raw = n if abs(ratio - 1.0) <= self.tolerance else math.ceil(n * ratio - 1e-9)
            history = self._history[pool.name]
            history.append((obs.now, raw))
            while history and history[0][0] < obs.now - self.window:
                history.popleft()
            desired = raw if raw >= n else min(n, max(r for _, r in history))
            targets[pool.name] = min(max(desired, pool.min_replicas, 1), pool.max_replicas)
            reasons[pool.name] = f"{self.metric}={value:.3g} target={self.target:.3g}"
        return ScalingDecision(obs.now, targets, reasons)


class StaticPolicy:
    def __init__(self, counts: Mapping[str, int]) -> None:
        self.counts = dict(counts)

    def decide(self, obs: Observation) -> ScalingDecision:
        return ScalingDecision(obs.now, dict(self.counts), {name: "static" for name in self.counts})


@dataclass(slots=True)
class _Holt:
    """Holt's linear-trend exponential smoothing of one series."""

    alpha: float = 0.5
    beta: float = 0.3
    level: float | None = None
    trend: float = 0.0

    def update(self, value: float) -> None:
        if self.level is None:
            self.level = value
            return
        previous = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (self.level + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def forecast(self, steps: float = 1.0) -> float:
        return max(0.0, (self.level or 0.0) + self.trend * steps)


class DynamoPlanner:
    def __init__(
        self,
        pools: Sequence[PoolSpec],
        interval_s: float = 180.0,
        utilization_target: float = 1.0,
        alpha: float = 0.5,
        beta: float = 0.3,
    ) -> None:
        self.pools = tuple(pools)
        self.interval_s = interval_s
        self.utilization_target = utilization_target
        self._rate = _Holt(alpha, beta)
        self._in = _Holt(alpha, 0.0)
        self._out = _Holt(alpha, 0.0)
        self._last_plan: float | None = None
        self._targets: dict[str, int] = {}

    def decide(self, obs: Observation) -> ScalingDecision:
        self._rate.update(obs.request_rate)
        if obs.mean_input_tokens:
            self._in.update(obs.mean_input_tokens)
        if obs.mean_output_tokens:
            self._out.update(obs.mean_output_tokens)
        if self._last_plan is None or obs.now - self._last_plan >= self.interval_s:
            self._last_plan = obs.now
            self._plan(obs)
        targets = {p.name: self._targets.get(p.name, obs.pools[p.name].provisioned) for p in self.pools}
        return ScalingDecision(obs.now, targets, {p.name: "dynamo planner" for p in self.pools})

    def _plan(self, obs: Observation) -> None:
        rate = self._rate.forecast()
        for role, tokens, cap_attr in (
            ("decode", self._out.forecast(0), "decode_tps_capacity"),
            ("prefill", self._in.forecast(0), "prefill_tps_capacity"),
        ):
            pools = [p for p in self.pools if p.role == role or (role == "decode" and p.role == "mixed")]
            if not pools:
                continue
            # each phase sized separately, in the cheapest pool per unit of that phase's capacity
            best = min(pools, key=lambda p: p.cost_per_hour / getattr(p, cap_attr))
            need = math.ceil(rate * tokens / (getattr(best, cap_attr) * self.utilization_target) - 1e-9)
            for pool in pools:
                count = need if pool is best else pool.min_replicas
                self._targets[pool.name] = min(max(count, pool.min_replicas), pool.max_replicas)
