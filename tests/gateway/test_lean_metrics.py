"""`server.metrics.Counter`/`Histogram` expose exactly what prometheus_client's do (the hot path's lean
versions): same text for the same updates, `_created` timestamps aside."""

from __future__ import annotations

import re

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from server.metrics import Counter, GatewayMetrics, Histogram, LeanCollector

BUCKETS = (0.001, 0.01, 0.1, 1.0)
# values on both sides of every bound, on a bound exactly (le is inclusive), and past the last one
OBSERVED = (0.0, 0.0005, 0.001, 0.002, 0.01, 0.05, 0.1, 0.9999, 1.0, 7.5)


def _without_created(text: bytes) -> str:
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text.decode())


def test_counters_and_histograms_render_as_prometheus_clients() -> None:
    theirs = CollectorRegistry()
    c1 = prometheus_client.Counter("x_requests", "Requests", ["model", "status"], registry=theirs)
    h1 = prometheus_client.Histogram(
        "x_latency_seconds", "Latency", ["model"], buckets=BUCKETS, registry=theirs
    )
    ours = CollectorRegistry()
    c2 = Counter("x_requests", "Requests", ["model", "status"])
    h2 = Histogram("x_latency_seconds", "Latency", ["model"], buckets=BUCKETS)
    ours.register(LeanCollector([c2, h2]))
    for c in (c1, c2):
        c.labels("m", "200").inc()
        c.labels("m", "200").inc(2.5)
        c.labels("n", "429").inc()
    for h in (h1, h2):
        for v in OBSERVED:
            h.labels("m").observe(v)
        h.labels("n").observe(0.3)
    assert _without_created(generate_latest(ours)) == _without_created(generate_latest(theirs))
    # 1 + 2.5 for (m, 200); the histogram's +Inf bucket and count are all 10 observations of m
    assert ours.get_sample_value("x_requests_total", {"model": "m", "status": "200"}) == 3.5
    assert (
        ours.get_sample_value("x_latency_seconds_bucket", {"model": "m", "le": "0.001"}) == 3
    )  # 0, 0.0005, 0.001
    assert ours.get_sample_value("x_latency_seconds_count", {"model": "m"}) == len(OBSERVED)


def test_bad_updates_are_refused_as_prometheus_client_does() -> None:
    c = Counter("x", "x", ["a"])
    with pytest.raises(ValueError):
        c.labels("v").inc(-1)
    with pytest.raises(ValueError):
        c.labels("v", "extra")


def test_the_gateway_registry_has_every_family_before_any_request() -> None:
    metrics = GatewayMetrics()
    names = {fam.name for fam in metrics.registry.collect()}
    assert {
        "mosaic_requests",
        "mosaic_request_outcomes",
        "mosaic_time_to_first_token_seconds",
        "mosaic_inter_token_latency_seconds",
        "mosaic_e2e_request_latency_seconds",
    } <= names
