"""Decode capacity by context: the profile the perf model gives, its interpolation, and the policies that
size decode at the observed context (`observed_context`) or at the configured one (the default)."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from scheduler.autoscaler.baselines import DynamoPlanner
from scheduler.autoscaler.capacity import decode_profile, decode_tps_within_slo, instance_capacity
from scheduler.autoscaler.policy import AutoscalerConfig, MosaicAutoscaler
from scheduler.autoscaler.signals import Observation, PoolObservation, PoolSpec

# seconds per token linear in context: 1/rate = 1e-4 at 1k, 2e-4 at 2k, 4e-4 at 4k
PROFILE = ((1024, 10_000.0), (2048, 5_000.0), (4096, 2_500.0))


def decode(profile: tuple[tuple[int, float], ...] = PROFILE, tps: float = 10_000.0) -> PoolSpec:
    return PoolSpec(
        "d",
        "llama-3-8b",
        "decode",
        "A100-80GB",
        3.67,
        1,
        64,
        decode_tps_capacity=tps,
        decode_tps_by_context=profile,
    )


def a100_perf() -> PerfModel:
    cat = load_catalog()
    return PerfModel(cat.gpu("A100-80GB"), cat.model("llama-3-8b"), 1)


@pytest.mark.parametrize(
    ("context", "rate"),
    [
        pytest.param(None, 10_000.0, id="no context: the configured capacity"),
        pytest.param(512, 10_000.0, id="below the first point: its rate"),
        pytest.param(2048, 5_000.0, id="a profile point exactly"),
        pytest.param(1536, 1 / 1.5e-4, id="between points: linear in seconds per token"),
        pytest.param(3072, 1 / 3e-4, id="between the next two"),
        pytest.param(8192, 1_250.0, id="past the last point: rate x context constant"),
    ],
)
def test_decode_tps_at_interpolates_seconds_per_token(context: float | None, rate: float) -> None:
    assert decode().decode_tps_at(context) == pytest.approx(rate, rel=1e-12)


def test_without_a_profile_every_context_gets_the_configured_capacity() -> None:
    assert decode(profile=(), tps=4_321.0).decode_tps_at(8192) == 4_321.0


def test_profile_from_the_perf_model() -> None:
    perf = a100_perf()
    kv = 400_000
    profile = decode_profile(perf, 0.06, 256, kv)
    contexts = [c for c, _ in profile]
    rates = [r for _, r in profile]
    assert contexts == sorted(contexts) and contexts[0] == 256
    assert all(r > 0 for r in rates)
    assert all(a >= b for a, b in pairwise(rates))  # longer context, lower rate
    assert contexts[-1] <= kv  # only contexts the KV cache holds
    # each point is the capacity at that context, and the configured one is among them
    assert dict(profile)[1024] == decode_tps_within_slo(perf, 0.06, 1024, 256, kv)
    cap = instance_capacity(perf, tpot_s=0.06, context=1024, max_num_seqs=256, kv_tokens=kv)
    assert cap.decode_by_context == profile and dict(profile)[1024] == cap.decode_tps
    # Llama-3-8B on an A100: at 8k tokens of context a sixth of the 1k rate (the KV read dominates)
    assert 5.0 < dict(profile)[1024] / dict(profile)[8192] < 7.0


def test_profile_stops_where_the_slo_cannot_be_met() -> None:
    assert decode_profile(a100_perf(), 1e-4, 256, 400_000) == ()  # no batch meets a 0.1 ms step


def observation(now: float, decode_tps: float, mean_in: float, mean_out: float) -> Observation:
    return Observation(
        now=now,
        pools={"d": PoolObservation(ready=1, decode_tokens_per_s=decode_tps)},
        mean_input_tokens=mean_in,
        mean_output_tokens=mean_out,
    )


def test_mosaic_sizes_decode_at_the_observed_context_when_asked() -> None:
    # 8,000 tok/s at a 3,072-token mean context (2,560 in + 1,024 out / 2): 3,333 tok/s per instance there
    observed = MosaicAutoscaler(
        [decode()], AutoscalerConfig(smoothing=1.0, utilization_target=1.0, observed_context=True)
    )
    decision = observed.decide(observation(15, 8_000, 2_560, 1_024))
    assert decision.signal["llama-3-8b/context_tokens"] == 3_072
    assert decision.targets["d"] == math.ceil(8_000 / (1 / 3e-4))  # 3
    # the default sizes at the configured context (10,000 tok/s): one instance, the context only reported
    default = MosaicAutoscaler([decode()], AutoscalerConfig(smoothing=1.0, utilization_target=1.0))
    decision = default.decide(observation(15, 8_000, 2_560, 1_024))
    assert decision.signal["llama-3-8b/context_tokens"] == 3_072
    assert decision.targets["d"] == 1


def test_the_observed_context_is_smoothed_and_kept_while_nothing_completes() -> None:
    policy = MosaicAutoscaler([decode()], AutoscalerConfig(smoothing=0.5, observed_context=True))
    policy.decide(observation(15, 1_000, 1_000, 2_048))  # context 2,024: the first sample as is
    first = policy.decide(observation(30, 1_000, 3_000, 2_048)).signal["llama-3-8b/context_tokens"]
    assert first == 0.5 * 4_024 + 0.5 * 2_024
    # an interval with no completion (means 0) keeps the estimate
    assert policy.decide(observation(45, 1_000, 0.0, 0.0)).signal["llama-3-8b/context_tokens"] == first


def test_planner_always_sizes_decode_at_the_forecast_context() -> None:
    """As Dynamo's decode interpolator does (it has no fixed-context setting): the planner followed Mosaic's
    `observed_context` knob, off by default, and read this decode pool's 1,024-token 10,000 tok/s."""
    planner = DynamoPlanner([decode()], interval_s=30, utilization_target=1.0)
    # 4 req/s, 2,560 in / 1,024 out: 4,096 decode tok/s at a 3,072-token context
    for t in (15.0, 30.0, 45.0):
        decision = planner.decide(
            Observation(
                now=t,
                pools={"d": PoolObservation(ready=1)},
                request_rate=4.0,
                mean_input_tokens=2_560,
                mean_output_tokens=1_024,
            )
        )
    assert decision.targets["d"] == math.ceil(4 * 1_024 / (1 / 3e-4))  # 2 at 3,333 tok/s per instance
