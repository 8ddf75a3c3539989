"""The Grafana dashboard queries only metrics that exist: `mosaic_*` names from the gateway's registry
(server/metrics.py, KV reservation's collectors included) and the autoscaler's (server/autoscaling.py), and
`vllm:*` names from what the simulated worker's /metrics serves (it speaks vLLM's metric names, REFERENCE.md).
A renamed metric fails here instead of leaving an empty panel.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.chart.chartkit import CHART_DIR, REPO_ROOT
from tests.chart.promkit import gateway_exports, metric_names, simulated_worker_exports

DASHBOARDS = sorted((CHART_DIR / "dashboards").glob("*.json"))


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        pytest.param(
            'sum by (status) (rate(mosaic_requests_total{model=~"$model"}[$__rate_interval]))',
            {"mosaic_requests_total"},
            id="aggregation over a rate",
        ),
        pytest.param(
            "histogram_quantile(0.9, sum by (le, pool) (rate(x_bucket[5m])))",
            {"x_bucket"},
            id="quantile: 0.9 and le are not names",
        ),
        pytest.param(
            'count by (pool) (max by (pool, worker) (s{state="ready"}))', {"s"}, id="nested aggregations"
        ),
        pytest.param(
            "max by (instance) (vllm:kv_cache_usage_perc)",
            {"vllm:kv_cache_usage_perc"},
            id="colon in a vLLM name",
        ),
        pytest.param("a / on (pod) group_left b", {"a", "b"}, id="binary operator with matching"),
        pytest.param("x > 1e-05 and y < 0.5", {"x", "y"}, id="number literals are not names"),
        pytest.param("rate(vllm:e2e_total[5m] offset 1h30m) > 2", {"vllm:e2e_total"}, id="durations, e2e"),
        pytest.param('label_replace(z, "dst", "$1", "src", "(.*)")', {"z"}, id="strings are not names"),
    ],
)
def test_metric_name_extraction(expr: str, expected: set[str]) -> None:
    assert metric_names(expr) == expected


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def _exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets") or []:
            yield panel["title"], target["expr"]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var["type"] == "query" and isinstance(query, dict):
            yield f"variable {var['name']}", re.sub(r"^label_values\((\w+),.*\)$", r"\1", query["query"])


def test_dashboards_exist_and_are_grafana_json() -> None:
    assert [p.name for p in DASHBOARDS] == ["mosaic.json"]
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
        ids = [p["id"] for p in _panels(dashboard["panels"])]
        assert len(ids) == len(set(ids)), "panel ids must be unique"
        for panel in _panels(dashboard["panels"]):
            for target in panel.get("targets") or []:
                assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


# What the issue asks the dashboard to show, as (topic, metric a panel must query).
REQUIRED = [
    pytest.param("requests", "mosaic_requests_total", id="requests per second"),
    pytest.param("TTFT", "mosaic_time_to_first_token_seconds_bucket", id="TTFT percentiles"),
    pytest.param("ITL", "mosaic_inter_token_latency_seconds_bucket", id="ITL percentiles"),
    pytest.param("e2e", "mosaic_e2e_request_latency_seconds_bucket", id="end-to-end percentiles"),
    pytest.param("tokens/s", "vllm:generation_tokens_total", id="tokens per second"),
    pytest.param("KV usage per worker", "vllm:kv_cache_usage_perc", id="KV usage per worker"),
    pytest.param("queue depth", "mosaic_admission_queue_depth", id="queue depth"),
    pytest.param("rejections", "mosaic_rejections_total", id="rejections"),
    pytest.param("replicas per pool", "mosaic_worker_state", id="replicas per pool"),
    pytest.param("desired replicas", "mosaic_autoscaler_desired_replicas", id="the autoscaler's decisions"),
    pytest.param("scale failures", "mosaic_autoscaler_scale_errors_total", id="the autoscaler's failures"),
    pytest.param("KV reserved", "mosaic_kv_reserved_units", id="KV reserved per worker"),
    pytest.param("KV refusals", "mosaic_kv_reservations_refused_total", id="KV reservations refused"),
]


@pytest.mark.parametrize(("topic", "metric"), REQUIRED)
def test_dashboard_covers(topic: str, metric: str) -> None:
    queried = {
        name
        for path in DASHBOARDS
        for _, e in _exprs(json.loads(path.read_text()))
        for name in metric_names(e)
    }
    assert metric in queried, f"no panel shows {topic}"


def test_every_mosaic_metric_queried_is_exported_by_the_gateway_or_the_controller() -> None:
    exported = gateway_exports()
    assert "mosaic_requests_total" in exported  # sanity: the registry was read
    missing = {
        (path.name, title, name)
        for path in DASHBOARDS
        for title, expr in _exprs(json.loads(path.read_text()))
        for name in metric_names(expr)
        if name.startswith("mosaic_") and name not in exported
    }
    assert not missing, f"queried but exported by neither the gateway nor the controller: {sorted(missing)}"


def test_every_vllm_metric_queried_is_served_by_the_simulated_worker() -> None:
    exported = simulated_worker_exports()
    missing = {
        (path.name, title, name)
        for path in DASHBOARDS
        for title, expr in _exprs(json.loads(path.read_text()))
        for name in metric_names(expr)
        if name.startswith("vllm:") and name not in exported
    }
    assert not missing, f"queried but not served by the simulated worker: {sorted(missing)}"


def test_every_metric_queried_is_mosaic_or_vllm() -> None:
    dashboards = [*DASHBOARDS, REPO_ROOT / "deploy" / "grafana" / "dashboards" / "mosaic.json"]
    for path in dashboards:
        for title, expr in _exprs(json.loads(path.read_text())):
            for name in metric_names(expr):
                assert name.startswith(("mosaic_", "vllm:")), f"{path.name} / {title}: {name}"
