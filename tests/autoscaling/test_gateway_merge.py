"""`mosaic autoscale` seeing the gateways: recorded `/metrics` of two gateway replicas merged into one
observation (exact queue sums, rates, lengths and quantiles of the merged buckets), a restarted gateway's
counter reset, an unreachable or stale gateway skipped (logged, counted), and the TPOT fallback to ITL.

The fixtures are the gateway's own exposition (`server.metrics.GatewayMetrics.render`), recorded for model
llama-3-8b, pool dec:

| file | received | completed | prompt | generated | TTFT (s) | TPOT (s) | queue |
|---|---|---|---|---|---|---|---|
| gateway_a_1 (t=100) | 10 | 8 | 800 | 1600 | 8 × 0.15 | 8 × 0.03 | 2 |
| gateway_a_2 (t=110) | +20 | +12 | +1200 | +2400 | +5 × 0.15, +5 × 0.3 | +10 × 0.03 | 5 |
| gateway_b_1 (t=100) | 5 | 5 | 250 | 500 | 5 × 0.05 | 5 × 0.01 | 1 |
| gateway_b_2 (t=110) | +10 | +8 | +400 | +800 | +10 × 0.3 | +10 × 0.045 | 4 |
| gateway_b_2r (t=110, b restarted) | 3 | 2 | 100 | 200 | 2 × 0.3 | 2 × 0.045 | 4 |
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.config import AutoscalerGatewaysConfig, ConfigError, validate_config
from server.gateway_scrape import GatewayScraper, bearer_token
from server.gateway_signals import (
    GatewayWindow,
    RegistrySource,
    Snapshot,
    gateway_signals,
    samples_from_text,
)
from server.metrics import GatewayMetrics

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "llama-3-8b"


def snap(name: str, at: float) -> Snapshot:
    return Snapshot(at, samples_from_text((FIXTURES / f"gateway_{name}.metrics.txt").read_text()))


def one(x: str) -> float:
    return 1.0


def merged_signals(second_b: str) -> dict[str, Any]:
    window = GatewayWindow()
    first = window.step({"a": snap("a_1", 100.0), "b": snap("b_1", 100.0)})
    assert first.counted == 0  # first sight of both: baselines
    return gateway_signals(window.step({"a": snap("a_2", 110.0), "b": snap(second_b, 110.0)}), one, one)


def test_two_gateways_merge_into_exact_sums_and_quantiles() -> None:
    out = merged_signals("b_2")
    assert out["admission_queue"] == {MODEL: 9}  # 5 + 4 waiting now, summed over the replicas
    assert out["request_rate"] == pytest.approx(3.0)  # a: 20 / 10 s + b: 10 / 10 s
    # 12 + 8 = 20 completed: (1200 + 400) / 20 = 80 prompt tokens, (2400 + 800) / 20 = 160 output tokens
    assert out["mean_input_tokens"] == pytest.approx(80.0)
    assert out["mean_output_tokens"] == pytest.approx(160.0)
    # TTFT merged buckets: (0.1, 0.2] 5, (0.2, 0.4] 5 + 10 = 15; p90 target 0.9 · 20 = 18:
    # 0.2 + 0.2 · (18 − 5) / 15 = 0.37333...
    assert out["ttft_p90_s"] == pytest.approx(0.2 + 0.2 * 13 / 15)
    # TPOT merged buckets: (0.02, 0.03] 10 (a), (0.04, 0.05] 10 (b); target 18: 0.04 + 0.01 · 8 / 10 = 0.048
    assert out["tpot_p90_s"] == pytest.approx(0.048)


def test_a_restarted_gateway_counts_from_zero() -> None:
    out = merged_signals("b_2r")  # b's counters went down and its series were re-created
    assert out["admission_queue"] == {MODEL: 9}
    assert out["request_rate"] == pytest.approx(2.3)  # a: 20 / 10 s + b: 3 (all since its restart) / 10 s
    # completed 12 + 2 = 14: (1200 + 100) / 14 prompt, (2400 + 200) / 14 output tokens
    assert out["mean_input_tokens"] == pytest.approx(1300 / 14)
    assert out["mean_output_tokens"] == pytest.approx(2600 / 14)
    # TTFT: (0.1, 0.2] 5, (0.2, 0.4] 5 + 2 = 7; target 0.9 · 12 = 10.8: 0.2 + 0.2 · 5.8 / 7
    assert out["ttft_p90_s"] == pytest.approx(0.2 + 0.2 * 5.8 / 7)
    # TPOT: (0.02, 0.03] 10, (0.04, 0.05] 2; target 10.8: 0.04 + 0.01 · 0.8 / 2 = 0.044
    assert out["tpot_p90_s"] == pytest.approx(0.044)


def one_interval(record: Callable[[GatewayMetrics], None], seconds: float) -> dict[str, Any]:
    """The signals of one gateway's own registry over an interval of `seconds` in which `record` ran."""
    metrics = GatewayMetrics()
    clock = iter([0.0, seconds])
    source = RegistrySource(metrics.registry, lambda: next(clock))
    window = GatewayWindow()
    window.step(source())
    record(metrics)
    return gateway_signals(window.step(source()), one, one)


def test_without_a_tpot_histogram_the_net_reads_inter_token_gaps() -> None:
    def record(metrics: GatewayMetrics) -> None:
        for _ in range(10):
            metrics.itl.labels(MODEL, "dec").observe(0.03)

    out = one_interval(record, 1.0)
    assert out["tpot_p90_s"] == pytest.approx(0.038)  # all 10 gaps in (0.02, 0.04]: 0.02 + 0.02 · 9 / 10


def test_each_model_gets_its_own_arrivals_lengths_and_latencies() -> None:
    """Two models behind one gateway: the fleet-wide fields blend them, `models` keeps them apart."""

    def record(metrics: GatewayMetrics) -> None:
        for model, received, prompt, generated, ttft in (
            (MODEL, 40, 4_000, 8_000, 0.15),
            ("small", 10, 5_000, 500, 3.0),
        ):
            metrics.received.labels(model).inc(received)
            for _ in range(received // 2):
                metrics.outcomes.labels(model, "completed").inc()
            metrics.prompt_tokens.labels(model).inc(prompt)
            metrics.generation_tokens.labels(model).inc(generated)
            for _ in range(10):
                metrics.ttft.labels(model, "dec").observe(ttft)

    out = one_interval(record, 10.0)
    assert out["request_rate"] == 5.0  # 50 arrived in 10 s
    big, small = out["models"][MODEL], out["models"]["small"]
    assert (big.request_rate, big.mean_input_tokens, big.mean_output_tokens) == (4.0, 200.0, 400.0)
    assert (small.request_rate, small.mean_input_tokens, small.mean_output_tokens) == (1.0, 1_000.0, 100.0)
    assert big.ttft_p90_s is not None and big.ttft_p90_s < 0.2  # its own latencies only
    assert small.ttft_p90_s is not None and small.ttft_p90_s > 2.0


# ---------------------------------------------------------------------------------------------- scraping


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def recorded(files: dict[str, str], seen: list[httpx.Request]) -> httpx.MockTransport:
    """Gateways a and b answer their current recorded file; c refuses connections."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        host = request.url.host
        if host not in files:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, text=(FIXTURES / f"gateway_{files[host]}.metrics.txt").read_text())

    return httpx.MockTransport(handler)


async def _scrape_three(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[dict[str, Any]], GatewayScraper, CollectorRegistry, list[httpx.Request]]:
    monkeypatch.setenv("GW_KEYS", "adm-1,adm-2")
    cfg = AutoscalerGatewaysConfig(
        static=["http://a:8000", "http://b:8000", "http://c:8000"],
        bearer_token_env="GW_KEYS",
        stale_after_s=25,
    )
    clock, files, seen = Clock(100.0), {"a": "a_1", "b": "b_1"}, []
    registry = CollectorRegistry()
    async with httpx.AsyncClient(transport=recorded(files, seen)) as client:
        scraper = GatewayScraper(cfg, 5.0, registry, client=client, clock=clock)
        window, out = GatewayWindow(), []
        await scraper.scrape_once()
        window.step(scraper.snapshots())
        files.update(a="a_2", b="b_2")
        clock.t = 110.0
        await scraper.scrape_once()
        out.append(gateway_signals(merged := window.step(scraper.snapshots()), one, one))
        out[-1]["gateways"] = merged.gateways
        # a stops answering: its last good snapshot (t = 110) holds until 25 s old, then it is skipped
        del files["a"]
        clock.t = 120.0
        await scraper.scrape_once()
        out.append({"snapshots": {k: v is not None for k, v in scraper.snapshots().items()}})
        clock.t = 136.0
        await scraper.scrape_once()
        out.append({"snapshots": {k: v is not None for k, v in scraper.snapshots().items()}})
    return out, scraper, registry, seen


def test_an_unreachable_gateway_is_skipped_logged_and_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mosaic.autoscaler.gateways")
    out, scraper, registry, seen = asyncio.run(_scrape_three(monkeypatch))
    merged, stale_soon, stale = out
    # c never answered: the observation is a and b's, exactly as merged above
    assert merged["gateways"] == 2 and merged["admission_queue"] == {MODEL: 9}
    assert merged["request_rate"] == pytest.approx(3.0) and merged["tpot_p90_s"] == pytest.approx(0.048)
    assert stale_soon["snapshots"] == {"a:8000": True, "b:8000": True, "c:8000": False}  # a: 10 s old
    assert stale["snapshots"] == {"a:8000": False, "b:8000": True, "c:8000": False}  # a: 26 s old
    value = registry.get_sample_value
    assert value("mosaic_autoscaler_gateway_scrape_errors_total", {"gateway": "c:8000"}) == 4.0  # every round
    assert value("mosaic_autoscaler_gateway_scrape_errors_total", {"gateway": "a:8000"}) == 2.0
    assert (
        value("mosaic_autoscaler_gateways", {"state": "up"}),
        value("mosaic_autoscaler_gateways", {"state": "down"}),
    ) == (1.0, 2.0)
    downs = [r.getMessage() for r in caplog.records if "not scraped" in r.getMessage()]
    assert len(downs) == 2 and downs[0].startswith("gateway c:8000")  # once per gateway going down
    # the first key of the env list, as a bearer token, on the configured path
    assert {r.headers["authorization"] for r in seen} == {"Bearer adm-1"}
    assert {r.url.path for r in seen} == {"/metrics"}
    assert scraper.endpoints and bearer_token(None) is None


def test_gateway_pods_are_found_by_kubernetes_discovery_without_listing_nodes() -> None:
    pods = {
        "items": [
            {
                "metadata": {"name": f"mosaic-gateway-{i}"},
                "spec": {"nodeName": "n1"},
                "status": {
                    "phase": "Running",
                    "podIP": f"10.0.0.{i}",
                    "conditions": [{"type": "Ready", "status": ready}],
                },
            }
            for i, ready in ((1, "True"), (2, "False"))
        ]
    }
    calls: list[tuple[str, str, str]] = []

    def lister(resource: str, namespace: str, selector: str) -> dict[str, Any]:
        calls.append((resource, namespace, selector))
        return pods

    cfg = AutoscalerGatewaysConfig.model_validate(
        {"kubernetes": {"resource": "pods", "namespace": "llm", "label_selector": "app=gw", "port": 8080}}
    )

    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(transport=recorded({}, [])) as client:
            scraper = GatewayScraper(cfg, 5.0, CollectorRegistry(), client=client, lister=lister)
            await scraper.source.start()
            await scraper.scrape_once()
            return [(e.name, e.url) for e in scraper.endpoints]

    # the not-ready pod is scraped too: a gateway with no ready worker is the one whose queue matters
    assert asyncio.run(run()) == [
        ("mosaic-gateway-1", "http://10.0.0.1:8080"),
        ("mosaic-gateway-2", "http://10.0.0.2:8080"),
    ]
    assert calls == [("pods", "llm", "app=gw")]  # no node listing: domains mean nothing for gateways


@pytest.mark.parametrize(
    ("gateways", "message"),
    [
        pytest.param({}, "autoscaler.gateways: give exactly one of static, kubernetes", id="neither source"),
        pytest.param(
            {"static": ["gw:8000"]}, "'gw:8000' is not an http(s):// URL", id="a URL without scheme"
        ),
        pytest.param(
            {"static": ["http://gw"], "path": "metrics"}, "autoscaler.gateways.path: ", id="relative path"
        ),
        pytest.param(
            {"static": ["http://gw"], "interval_s": 0}, "autoscaler.gateways.interval_s: ", id="zero period"
        ),
    ],
)
def test_bad_gateways_section_is_one_config_error(gateways: dict[str, Any], message: str) -> None:
    pool = {"name": "p", "model": MODEL, "gpu": "L4", "endpoints": {"static": ["http://w:8000"]}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config({"pools": [pool], "autoscaler": {"gateways": gateways}}, "cfg")
