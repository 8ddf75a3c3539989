"""The HPA / KEDA baselines during cold starts: instances still starting must not compound the scale-up.

Before the fix the HPA averaged its metric over the ready instances but multiplied by ready + starting,
so a pool whose ready instances stayed busy for a 120 s cold start kept multiplying its size every 15 s.
"""

from __future__ import annotations

import pytest

from scheduler.autoscaler.baselines import HpaPolicy, hpa_pod_metric_replicas, keda_average_value_replicas
from scheduler.autoscaler.signals import Observation, PoolObservation, PoolSpec


def decode_pool(hi: int = 64) -> PoolSpec:
    return PoolSpec("d", "llama-3-8b", "decode", "A100-80GB", 3.67, 1, hi, decode_tps_capacity=1000.0)


def step(policy: HpaPolicy, now: float, **fields: float) -> int:
    return policy.decide(Observation(now, {"d": PoolObservation(**fields)})).targets["d"]  # type: ignore[arg-type]


def test_waiting_keda_average_value_does_not_snowball_during_a_cold_start() -> None:
    """KEDA AverageValue: ceil(total waiting / target), whatever the replica count. 2 ready instances with
    8 waiting requests between them stay that way for the whole 120 s cold start; the target must stay 4
    (the old per-ready average went 2 → 4 → 8 → 16 … by multiplying by ready + starting)."""
    policy = HpaPolicy([decode_pool()], "num_requests_waiting", target=2.0)
    target = step(policy, 0, ready=2, num_waiting=8)
    assert target == 4
    targets = []
    for t in range(15, 135, 15):  # what the policy asked for is provisioned: 2 ready, the rest starting
        target = step(policy, t, ready=2, starting=target - 2, num_waiting=8)
        targets.append(target)
    assert targets == [4] * len(targets)


def test_gpu_utilisation_starting_pods_count_as_zero_on_scale_up() -> None:
    """Ready pods at 100% busy with a 0.5 target: 2 → 4 at once; while the 2 new ones start (no metric),
    HPA counts them at 0%: (1.0·2 + 0·2) / (0.5·4) = 1.0 → within tolerance, no further growth."""
    policy = HpaPolicy([decode_pool()], "gpu_utilization", target=0.5)
    target = step(policy, 0, ready=2, gpu_utilization=1.0)
    assert target == 4
    targets = []
    for t in range(15, 135, 15):
        target = step(policy, t, ready=2, starting=target - 2, gpu_utilization=1.0)
        targets.append(target)
    assert targets == [4] * len(targets)


@pytest.mark.parametrize(
    ("ready", "starting", "mean", "expected"),
    [
        pytest.param(2, 2, 1.0, 4, id="(2·1.0 + 2·0)/(4·0.5) = 1.0: within tolerance, keep 4"),
        pytest.param(4, 2, 1.0, 8, id="(4·1.0)/(6·0.5) = 1.33 → ceil(1.33·6) = 8 (old: ceil(6·2) = 12)"),
        pytest.param(2, 4, 0.6, 6, id="(2·0.6)/(6·0.5) = 0.4 < 1 reverses 1.2's scale-up: keep 6"),
        pytest.param(
            6, 2, 0.2, 5, id="scale-down, starting at 100% of target: (6·0.2 + 2·0.5)/(8·0.5) = 0.55 → 5"
        ),
        pytest.param(0, 3, 0.0, 3, id="no pod reports: no change"),
        pytest.param(3, 0, 0.9, 6, id="nothing starting: ceil(3 · 0.9/0.5) = ceil(5.4) = 6"),
    ],
)
def test_hpa_missing_metrics_rule(ready: int, starting: int, mean: float, expected: int) -> None:
    assert hpa_pod_metric_replicas(ready + starting, ready, starting, mean, 0.5, 0.1) == expected


def test_keda_average_value_formula() -> None:
    assert keda_average_value_replicas(6, 9, 2.0, 0.1) == 5  # ceil(9/2) regardless of 6 replicas
    assert keda_average_value_replicas(4, 8.5, 2.0, 0.1) == 4  # 8.5/(2·4) = 1.06: within tolerance
    assert keda_average_value_replicas(3, 0, 2.0, 0.1) == 0  # the policy then clamps to min/1


def test_hpa_scale_up_rate_limited_like_the_default_behaviour() -> None:
    """HPA's default scale-up policy: at most max(+100%, +4 pods) per 15 s."""
    policy = HpaPolicy([decode_pool()], "num_requests_waiting", target=1.0)
    assert step(policy, 0, ready=2, num_waiting=40) == 6  # want 40; max(2·2, 2+4) = 6
    assert step(policy, 15, ready=2, starting=4, num_waiting=40) == 12  # from 6: max(12, 10)


def test_hpa_scale_down_waits_for_the_window_even_with_pods_starting() -> None:
    policy = HpaPolicy([decode_pool()], "num_requests_waiting", target=2.0)
    assert step(policy, 0, ready=2, num_waiting=8) == 4
    assert step(policy, 15, ready=2, starting=2, num_waiting=0) == 4  # held by the 300 s window
    assert step(policy, 316, ready=4, num_waiting=0) == 1
