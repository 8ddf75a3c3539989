"""A pool the policy scaled to zero comes back when requests arrive.

The live gateway measures mean input/output lengths on completions; with every pool at zero nothing
completes (requests for a pool at zero wait in the admission queue, the router's `empty_pool`).
Arrivals are still counted (`mosaic_requests_received_total` is incremented before dispatch), so
the arrivals floor of the demand must not vanish with the observed means.
"""

from __future__ import annotations

from scheduler.autoscaler.policy import AutoscalerConfig, MosaicAutoscaler
from scheduler.autoscaler.signals import Observation, PoolObservation, PoolSpec

DECODE = PoolSpec("decode-a100", "llama-3-8b", "decode", "A100-80GB", 3.67, 0, 16, decode_tps_capacity=4000.0)
PREFILL = PoolSpec(
    "prefill-h100", "llama-3-8b", "prefill", "H100-SXM", 4.25, 0, 16, prefill_tps_capacity=28000.0
)


def zero_fleet(now: float, rate: float, **means: float) -> Observation:
    pools = {"decode-a100": PoolObservation(ready=0), "prefill-h100": PoolObservation(ready=0)}
    return Observation(now=now, pools=pools, request_rate=rate, **means)


def test_both_pools_at_zero_scale_up_on_arrivals_with_no_completions() -> None:
    cfg = AutoscalerConfig(
        utilization_target=0.8, pd_ratio=0.5, default_output_tokens=256, default_input_tokens=1024
    )
    policy = MosaicAutoscaler([DECODE, PREFILL], cfg)
    # 5 req/s arriving, nothing completed (means 0), nothing waiting: decode demand = 5 · 256 = 1,280 tok/s
    # → 1,280 / (0.8 · 4,000) = 0.4 → 1 decode; prefill max(ceil(0.4 · 0.5) = 1, 5 · 1024 / (0.8 · 28,000)) → 1
    decision = policy.decide(zero_fleet(15, 5.0))
    assert decision.targets == {"decode-a100": 1, "prefill-h100": 1}
    assert decision.signal["llama-3-8b/decode_demand_tps"] == 5 * 256


def test_observed_means_still_lead_when_present() -> None:
    policy = MosaicAutoscaler([DECODE, PREFILL], AutoscalerConfig(utilization_target=0.8, smoothing=1.0))
    decision = policy.decide(zero_fleet(15, 5.0, mean_input_tokens=2000, mean_output_tokens=1000))
    assert decision.signal["llama-3-8b/decode_demand_tps"] == 5 * 1000
    assert decision.targets["decode-a100"] == 2  # 5,000 / (0.8 · 4,000) = 1.56 → 2


def test_no_arrivals_no_demand() -> None:
    policy = MosaicAutoscaler([DECODE, PREFILL], AutoscalerConfig())
    assert policy.decide(zero_fleet(15, 0.0)).targets == {"decode-a100": 0, "prefill-h100": 0}
