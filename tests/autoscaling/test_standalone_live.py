"""`mosaic autoscale`'s controller against a live `mosaic serve` gateway (real HTTP on 127.0.0.1, one simulated
worker): scraping the gateway's /metrics (`autoscaler.gateways`), it sees the gateway's admission queue, its
TTFT and TPOT and the arrival rate while the gateway is loaded — signals a controller that serves no
traffic had no other way to see."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.commands.autoscale import standalone
from server.config import validate_config
from server.metrics_endpoint import metrics_endpoint
from server.runner import start_gateway_server
from tests.autoscaling.test_embedded_live import MODEL, stream, until

POOL = {"name": "l4", "model": MODEL, "gpu": "L4", "role": "mixed", "max_num_seqs": 2}


async def _loaded() -> dict[str, Any]:
    serve = validate_config(
        {
            "pools": [{**POOL, "endpoints": {"simulated": {"replicas": 1, "time_scale": 2.0, "seed": 2}}}],
            "scrape": {"interval_s": 0.2},
            "limits": {"queue_deadline_s": 60},
        }
    )
    running = await start_gateway_server(serve, "127.0.0.1", 0)
    gw = running.gateway
    try:
        worker = gw.registry.records()[0].url
        autoscale = validate_config(
            {
                "pools": [{**POOL, "endpoints": {"static": [worker]}}],
                "scrape": {"interval_s": 0.2},
                "autoscaler": {
                    "actuator": "dry-run",
                    "interval_s": 3600,  # the test runs the cycles
                    "gateways": {"static": [running.url], "interval_s": 0.2},
                },
            }
        )
        async with (
            standalone(autoscale) as run,  # baseline: the idle gateway
            metrics_endpoint(run.registry, "127.0.0.1", 0) as metrics_port,  # `--metrics-port`
            httpx.AsyncClient(base_url=running.url, timeout=60) as client,
        ):
            ctl = run.controller
            ctl.build()
            # 12 streams on a worker that runs 2 sequences (the router lets ~3 in): the rest wait in the
            # gateway's admission queue, where only the gateway can see them
            tasks = [asyncio.create_task(stream(client, 8)) for _ in range(12)]
            ttft_count = "mosaic_time_to_first_token_seconds_count"
            tpot_count = "mosaic_time_per_output_token_seconds_count"
            labels = {"model": MODEL, "pool": "l4"}
            value = gw.metrics.registry.get_sample_value
            await until(lambda: (value(tpot_count, labels) or 0) >= 1, 20)  # a first stream completed
            seen_at = time.monotonic()
            await until(
                lambda: all(s is not None and s.at > seen_at for s in run.scraper.snapshots().values()), 5
            )
            queue_at_gateway = gw.admission.depths()[MODEL]
            await ctl.cycle()
            decision = ctl.decisions[-1]
            results = await asyncio.gather(*tasks)
            exported = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            return {
                "obs": decision["observation"],
                "signals": decision["signals"],
                "queue_at_gateway": queue_at_gateway,
                "results": results,
                "gateways": len(run.scraper.latest) - len(run.scraper.down),
                "ttft_count": value(ttft_count, labels),
                "exported": {
                    f.name: {tuple(sorted(x.labels.items())): x.value for x in f.samples}
                    for f in text_string_to_metric_families(exported)
                },
            }
    finally:
        await running.stop()


def test_standalone_controller_sees_a_loaded_gateways_queue_and_latency() -> None:
    out = asyncio.run(_loaded())
    obs = out["obs"]
    assert out["gateways"] == 1
    assert all(r.status == 200 and r.tokens == 8 for r in out["results"])
    # the queue the gateway exported at the last scrape: requests still waiting behind the busy worker
    assert 1 <= obs["admission_queue"][MODEL] <= 12 and out["queue_at_gateway"] >= 1
    assert obs["ttft_p90_s"] is not None and obs["ttft_p90_s"] > 0
    assert obs["tpot_p90_s"] is not None and obs["tpot_p90_s"] > 0  # per-request TPOT of the completed ones
    assert obs["request_rate"] > 0  # the 12 arrivals fell inside the interval
    assert out["signals"]["ttft_p90_s"] == round(obs["ttft_p90_s"], 6)
    # the policy counts the gateway's queue as waiting demand (`<model>/waiting` = queue + Σ num_waiting)
    assert out["signals"][f"{MODEL}/waiting"] >= obs["admission_queue"][MODEL]
    # the controller's own /metrics: one gateway up, none down, one cycle run
    exported = out["exported"]
    assert exported["mosaic_autoscaler_gateways"] == {(("state", "up"),): 1.0, (("state", "down"),): 0.0}
    assert exported["mosaic_autoscaler_cycles"][()] == 1.0
    # and only the controller's: the gateway object it builds for discovery routes nothing, and its request,
    # worker and KV families (0 in flight, nothing reserved) were exported under the gateways' own names
    assert {n for n in exported if not n.startswith(("mosaic_autoscaler_", "mosaic_placement_"))} == set()
