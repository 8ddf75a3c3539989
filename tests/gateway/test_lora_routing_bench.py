"""bench/lora_routing.py stays runnable: its gateway config is the deployed one with only lora-affinity's
weight changed, and one short run sends every request through the gateway to workers serving the adapters."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from bench.lora_routing import adapter_names, aggregate, gateway_config, ratios, run_once


def test_the_config_changes_only_the_lora_affinity_weight() -> None:
    cfg = gateway_config(4.0, workers=2, adapters=3, max_loras=1, time_scale=5.0, seed=0)
    assert cfg.routing.weights == {"lora-affinity": 4.0}
    sim = cfg.pools[0].endpoints.simulated
    assert sim is not None and [m.name for m in sim.lora_modules] == adapter_names(3) and sim.max_loras == 1
    assert cfg.scrape.interval_s == pytest.approx(0.2)  # once per simulated second


@pytest.mark.timeout(60)
def test_one_short_run_completes_every_request_naming_the_adapters() -> None:
    args = argparse.Namespace(workers=2, adapters=3, rate=6.0, duration=2.0, time_scale=5.0)
    run = asyncio.run(run_once(args, 2.0, 1, seed=0))
    assert run["sent"] == run["completed"] == 12 and run["errors"] == {}
    assert set(run["requests_by_model"]) <= set(adapter_names(3)) and len(run["requests_by_model"]) > 1
    row = aggregate([run])
    assert row["ttft_p50_ms"] > 0 and row["queue_mean_ms"] is not None
    assert ratios({"0": row, "2": row})["ttft_mean_ms_default_over_baseline"] == 1.0
