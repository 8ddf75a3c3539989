"""What an autoscaling policy sees (pools and one observation per cycle) and what it returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal, Protocol

PoolRole = Literal["prefill", "decode", "mixed"]


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A scalable pool: one model on one GPU type in one role.

    `decode_tps_capacity` is the decode tokens/s one instance sustains within the TPOT SLO (from the
    throughput profile or the perf model) at the configured context; `decode_tps_by_context` the same at
    several contexts (ascending), so a policy can size at the context it observes (`decode_tps_at`);
    `prefill_tps_capacity` the prompt tokens/s one instance sustains within the TTFT SLO. The policy
    applies its utilisation target on top of these.
    """

    name: str
    model: str
    role: PoolRole
    gpu: str
    cost_per_hour: float
    min_replicas: int = 0
    max_replicas: int = 64
    decode_tps_capacity: float = 0.0
    prefill_tps_capacity: float = 0.0
    domain: str | None = None
    decode_tps_by_context: tuple[tuple[int, float], ...] = ()

    def decode_tps_at(self, context: float | None) -> float:
        """Decode tokens/s within the TPOT SLO at `context` tokens per sequence, from the profile.

        Within the SLO the batch is bounded by the KV read per step, so seconds per token (1/rate) grows
        linearly with the context: interpolated linearly in 1/rate between profile points, and along the
        last point's 1/context law beyond it (a rate under the profile's, never 0). Below the first point,
        that point's rate (an underestimate). No profile or no context: `decode_tps_capacity`.
        """
        points = self.decode_tps_by_context
        if not points or context is None or context <= 0:
            return self.decode_tps_capacity
        if context <= points[0][0]:
            return points[0][1]
        for (c0, r0), (c1, r1) in pairwise(points):
            if context <= c1:
                f = (context - c0) / (c1 - c0)
                return 1.0 / ((1 - f) / r0 + f / r1)
        c_last, r_last = points[-1]
        return r_last * c_last / context

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"pool {self.name}: need 0 ≤ min_replicas ≤ max_replicas")
        if self.role in ("decode", "mixed") and self.decode_tps_capacity <= 0:
            raise ValueError(f"pool {self.name}: a {self.role} pool needs decode_tps_capacity > 0")
        if self.role == "prefill" and self.prefill_tps_capacity <= 0:
            raise ValueError(f"pool {self.name}: a prefill pool needs prefill_tps_capacity > 0")


def within_bounds(target: int, have: int, min_replicas: int, max_replicas: int) -> int:
    """A policy's `target` for a pool of `have` as its driver applies it: never above `max_replicas`, never
    scaled in below `min_replicas` (a pool already under its minimum is not raised here: the policy does
    that), never negative. Both drivers apply it, whatever the policy (a `static:` count knows no bounds)."""
    return max(0, min(target, max_replicas), min(min_replicas, max(have, target)))


@dataclass(frozen=True, slots=True)
class PoolObservation:
    """One pool's state at a cycle. Rates are sums over the pool's ready instances."""

    ready: int
    starting: int = 0  # counted as arriving capacity
    draining: int = 0  # leaving: not counted
    decode_tokens_per_s: float = 0.0  # rate of vllm:generation_tokens_total
    prompt_tokens_per_s: float = 0.0  # rate of vllm:prompt_tokens_total
    num_waiting: int = 0  # Σ vllm:num_requests_waiting
    gpu_utilization: float = 0.0  # mean busy fraction of the pool's GPUs (HPA baseline only)
    # seconds until each starting instance is expected ready (its start + the cold start); may be empty
    starting_ready_in_s: tuple[float, ...] = ()
    # False when a ready instance's load is unknown (its metrics are stale): the rates above undercount,
    # so a policy must not scale in on them (scale-up stays allowed). The simulator always knows: True.
    signal_complete: bool = True

    @property
    def provisioned(self) -> int:
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class ModelObservation:
    """The gateway-side signals of one model (or of the whole fleet: `Observation.for_model`)."""

    request_rate: float = 0.0
    mean_input_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    now: float
    pools: Mapping[str, PoolObservation]
    admission_queue: Mapping[str, int] = field(
        default_factory=dict
    )  # per model: gateway admission queue depth
    ttft_p90_s: float | None = None  # measured at the gateway over the last interval
    tpot_p90_s: float | None = None
    request_rate: float = 0.0  # requests/s arriving over the last interval (Dynamo-style baseline)
    mean_input_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    # the same per model, where the gateway labels them (a multi-model fleet: one model's arrivals and
    # latencies must not size another's pools). Empty (the simulator, a gateway without model labels):
    # every model reads the fleet-wide fields; otherwise a model absent here has seen nothing (zero rate)
    models: Mapping[str, ModelObservation] = field(default_factory=dict)

    def for_model(self, model: str) -> ModelObservation:
        found = self.models.get(model)
        if found is not None:
            return found
        if self.models:  # labelled per model, none for this one: no arrivals, not another model's load
            return ModelObservation()
        return ModelObservation(
            self.request_rate,
            self.mean_input_tokens,
            self.mean_output_tokens,
            self.ttft_p90_s,
            self.tpot_p90_s,
        )


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    now: float
    targets: Mapping[str, int]  # desired replicas per pool (ready + starting), every pool present
    reasons: Mapping[str, str] = field(default_factory=dict)
    signal: Mapping[str, float] = field(default_factory=dict)  # the numbers the decision came from

    def changes(self, obs: Observation) -> dict[str, int]:
        """Pools whose target differs from what is provisioned now, with the delta."""
        return {
            name: target - obs.pools[name].provisioned
            for name, target in self.targets.items()
            if name in obs.pools and target != obs.pools[name].provisioned
        }


class ScalingPolicy(Protocol):
    def decide(self, obs: Observation) -> ScalingDecision:
        """Desired replicas for every pool. Deterministic given the sequence of observations."""
        ...
