"""The chart's alerting rules (`monitoring.prometheusRule`): what renders for which values, that every metric,
label and label value a rule selects is one Mosaic or the simulated worker (vLLM's names) exposes, and that a
live gateway's /metrics has the series the rules select, in the proportions the alerts compare.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import helm_python as helm
import httpx
import pytest

from tests.chart.chartkit import CHART_DIR, NAMESPACE, Rendered, refusal, render
from tests.chart.promkit import (
    TARGET_LABELS,
    controller_labels,
    gateway_labels,
    label_lists,
    samples,
    selectors,
    simulated_worker_labels,
)

ALERTS = [
    "MosaicPoolNoReadyWorkers",
    "MosaicRequestsFailing",
    "MosaicRequestsShed",
    "MosaicTTFTAboveSLO",
    "MosaicTPOTAboveSLO",
    "MosaicWorkerBreakerOpen",
    "MosaicWorkerEngineStuck",
    "MosaicWorkerMetricsStale",
    "MosaicWorkerPreempting",
    "MosaicAutoscalerCycleFailing",
    "MosaicAutoscalerScaleErrors",
    "MosaicAutoscalerPlacementShortfall",
]
LATENCY = {"MosaicTTFTAboveSLO", "MosaicTPOTAboveSLO"}
AUTOSCALER = {
    "MosaicAutoscalerCycleFailing",
    "MosaicAutoscalerScaleErrors",
    "MosaicAutoscalerPlacementShortfall",
}
SLO = {"config": {"slo": {"ttft_ms": 500, "tpot_ms": 50}}}


def on(**rule: Any) -> dict[str, Any]:
    """The rules on, with the ServiceMonitor whose series they select."""
    return {"monitoring": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True, **rule}}}


def rules(rendered: Rendered) -> dict[str, dict[str, Any]]:
    (obj,) = rendered.of_kind("PrometheusRule")
    assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["metadata"]["namespace"] == NAMESPACE
    (group,) = obj["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def test_no_rules_unless_enabled(chart: helm.Chart) -> None:
    assert render(chart, SLO).of_kind("PrometheusRule") == []


def test_every_alert_renders_with_the_slo_as_latency_thresholds(chart: helm.Chart) -> None:
    got = rules(render(chart, {**on(), **SLO}))
    assert list(got) == ALERTS
    assert got["MosaicTTFTAboveSLO"]["expr"].startswith("histogram_quantile(0.9, ")
    # judged stuck at least once in every 4 minutes: one verdict that clears (a stall that ended) does not fire
    assert got["MosaicWorkerEngineStuck"]["expr"] == (
        'max by (namespace, pool, worker) (max_over_time(mosaic_worker_engine_stuck{namespace="llm"}[4m])) == 1'
    )
    assert "[5m])))\n> 0.5\nand on" in got["MosaicTTFTAboveSLO"]["expr"]  # 500 ms
    assert "[5m])))\n> 0.05\nand on" in got["MosaicTPOTAboveSLO"]["expr"]  # 50 ms
    for name in ("MosaicRequestsFailing", "MosaicRequestsShed", *LATENCY):  # judged from 0.05 requests/s
        assert got[name]["expr"].endswith("[5m])) > 0.05"), name
    # a pool may load for the vLLM startup probe's budget (10 s × 180 = 30 min) before it counts as down
    assert got["MosaicPoolNoReadyWorkers"]["for"] == "35m"
    for r in got.values():
        assert re.fullmatch(r"[0-9]+[smh]", r["for"]) and r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    assert got["MosaicPoolNoReadyWorkers"]["labels"]["severity"] == "critical"


def test_latency_alerts_are_left_out_without_a_threshold(chart: helm.Chart) -> None:
    assert list(rules(render(chart, on()))) == [a for a in ALERTS if a not in LATENCY]
    only_ttft = {"config": {"slo": {"ttft_ms": 2000}}}
    assert list(rules(render(chart, {**on(), **only_ttft}))) == [
        a for a in ALERTS if a != "MosaicTPOTAboveSLO"
    ]


def test_thresholds_quantile_and_window_come_from_the_values(chart: helm.Chart) -> None:
    values = on(
        ttftSeconds=2,
        tpotSeconds=0.1,
        latencyQuantile=0.99,
        errorRatio=0.02,
        shedRatio=0.1,
        minRequestRate=1,
        preemptionRatio=0.2,
        rateWindow="2m",
        scrapeAgeSeconds=30,
    )
    startup = {"vllm": {"probes": {"startup": {"periodSeconds": 10, "failureThreshold": 30}}}}  # 5 min
    got = rules(render(chart, {**values, **SLO, **startup}))  # explicit seconds win over config.slo
    ttft = got["MosaicTTFTAboveSLO"]
    assert ttft["expr"].startswith("histogram_quantile(0.99, ") and "[2m])))\n> 2\nand on" in ttft["expr"]
    assert "quantile 0.99" in ttft["annotations"]["summary"]
    assert "\n> 0.1\nand on" in got["MosaicTPOTAboveSLO"]["expr"]
    assert "[2m]))\n> 0.02\nand on" in got["MosaicRequestsFailing"]["expr"]
    assert "[2m]))\n> 0.1\nand on" in got["MosaicRequestsShed"]["expr"]
    for name in ("MosaicRequestsFailing", "MosaicRequestsShed", *LATENCY):
        assert got[name]["expr"].endswith("[2m])) > 1"), name
    assert got["MosaicWorkerPreempting"]["expr"].endswith("[2m]))\n> 0.2")
    assert ") > 30\nand on" in got["MosaicWorkerMetricsStale"]["expr"]
    assert got["MosaicPoolNoReadyWorkers"]["for"] == "15m"  # never shorter


def test_disabled_overrides_and_labels(chart: helm.Chart) -> None:
    values = on(
        disabled=["MosaicWorkerPreempting"],
        overrides={"MosaicRequestsShed": {"for": "30m", "severity": "critical"}},
        labels={"release": "kube-prometheus-stack"},
        alertLabels={"team": "llm-platform"},
    )
    rendered = render(chart, values)
    got = rules(rendered)
    assert "MosaicWorkerPreempting" not in got and len(got) == len(ALERTS) - len(LATENCY) - 1
    shed = got["MosaicRequestsShed"]
    assert (shed["for"], shed["labels"]["severity"]) == ("30m", "critical")
    assert (got["MosaicRequestsFailing"]["for"], got["MosaicWorkerBreakerOpen"]["labels"]["severity"]) == (
        "10m",
        "warning",
    )
    assert all(r["labels"]["team"] == "llm-platform" for r in got.values())
    (obj,) = rendered.of_kind("PrometheusRule")
    assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            on(alertLabels={"severity": "page"}),
            "severity is each alert's own label; change an alert's with monitoring.prometheusRule.overrides",
            id="severity among the common labels (two severity keys)",
        ),
        pytest.param(
            on(overrides={"MosaicRequestsShed": {"for": "30s5m"}}),
            "/monitoring/prometheusRule/overrides/MosaicRequestsShed/for",
            id="units out of Prometheus' order",
        ),
        pytest.param(on(rateWindow="0m"), "/monitoring/prometheusRule/rateWindow", id="an empty rate window"),
    ],
)
def test_values_prometheus_would_refuse_fail_the_render(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    assert message in refusal(chart, values)


def test_every_alert_disabled_renders_no_rule(chart: helm.Chart) -> None:
    assert render(chart, {**on(disabled=ALERTS), **SLO}).of_kind("PrometheusRule") == []


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(on(disabled=["MosaicTypo"]), id="disabled"),
        pytest.param(on(overrides={"MosaicTypo": {"for": "5m"}}), id="overrides"),
    ],
)
def test_an_unknown_alert_name_fails_the_render(chart: helm.Chart, values: dict[str, Any]) -> None:
    assert "value must be one of 'MosaicPoolNoReadyWorkers', 'MosaicRequestsFailing', " in refusal(
        chart, values
    )


def test_the_schema_and_the_template_name_the_same_alerts() -> None:
    """The schema refuses an unknown name in `disabled`/`overrides`; the template's own list (its `fail`
    guards a render with --skip-schema-validation) and this file's must stay the same."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    rule = schema["properties"]["monitoring"]["properties"]["prometheusRule"]["properties"]
    assert rule["disabled"]["items"]["enum"] == ALERTS
    assert rule["overrides"]["propertyNames"]["enum"] == ALERTS
    template = (CHART_DIR / "templates" / "prometheusrule.yaml").read_text()
    listed = re.search(r"\$names := list ((?:\"\w+\" ?)+)", template)
    assert listed is not None and re.findall(r"\"(\w+)\"", listed[1]) == ALERTS
    assert re.findall(r'"alert" "(\w+)"', template) == ALERTS  # each written once, in this order


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({"controller": {"enabled": False}}, id="no controller"),
        pytest.param({"controller": {"metricsPort": 0}}, id="no metrics port"),
        pytest.param(
            {"monitoring": {"scrapeAnnotations": False, "prometheusRule": {"enabled": True, "selector": ""}}},
            id="no monitor and no scrape annotations",
        ),
    ],
)
def test_autoscaler_alerts_need_the_controllers_metrics_scraped(
    chart: helm.Chart, values: dict[str, Any]
) -> None:
    got = rules(render(chart, {**on(), **values}))
    assert not AUTOSCALER & set(got) and "MosaicRequestsFailing" in got


def test_autoscaler_alerts_with_the_controller_scraped_by_annotation(chart: helm.Chart) -> None:
    """No operator monitor: the controller's pod carries prometheus.io/* annotations, and a selector for that
    Prometheus's own labels keeps the autoscaler alerts."""
    annotated = {"monitoring": {"prometheusRule": {"enabled": True, "selector": 'job="mosaic"'}}}
    assert set(rules(render(chart, annotated))) >= AUTOSCALER


def test_the_default_scope_needs_a_monitor_of_the_chart(chart: helm.Chart) -> None:
    """`namespace="<release namespace>"` is the label the operator's monitors put on their targets: with
    neither monitor on nothing would carry it and every rule would select nothing, silently."""
    message = refusal(chart, {"monitoring": {"prometheusRule": {"enabled": True}}})
    assert "turn one of monitoring.serviceMonitor, monitoring.podMonitor on" in message
    pod_monitor = {"monitoring": {"podMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}}}
    assert "MosaicRequestsFailing" in rules(render(chart, pod_monitor))


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        pytest.param(None, ("namespace", "=", NAMESPACE), id="default: the release's namespace"),
        pytest.param('cluster="eu-1"', ("cluster", "=", "eu-1"), id="a matcher of the user's"),
        pytest.param("", None, id="none"),
    ],
)
def test_every_selector_carries_the_configured_matchers(
    chart: helm.Chart, selector: str | None, expected: tuple[str, str, str] | None
) -> None:
    got = rules(render(chart, {**on(selector=selector), **SLO}))
    seen = [sel for r in got.values() for sel in selectors(r["expr"])]
    assert len(seen) >= len(ALERTS)
    for sel in seen:
        if expected is not None:
            assert sel.matchers[-1] == expected, sel
        else:
            assert all(label != "namespace" for label, _, _ in sel.matchers), sel


def test_every_metric_and_label_a_rule_uses_is_exposed(chart: helm.Chart) -> None:
    """Names from the gateway's and the controller's registries and the simulated worker's /metrics; labels
    in matchers and `by`/`on` lists on those samples or put there by the scrape; `$labels.x` in annotations
    on the alert's series (the expression's outer `by`)."""
    exposed = {**gateway_labels(), **controller_labels(), **simulated_worker_labels()}
    for name, r in rules(render(chart, {**on(), **SLO})).items():
        sels = selectors(r["expr"])
        assert sels, name
        available = set(TARGET_LABELS)
        for sel in sels:
            assert sel.name in exposed, f"{name}: {sel.name} is not exposed"
            available |= exposed[sel.name]
            for label, _, _ in sel.matchers:
                assert label in exposed[sel.name] | TARGET_LABELS, f"{name}: {sel.name} has no label {label}"
        lists = label_lists(r["expr"])
        for keyword, labels in lists:
            assert set(labels) <= available, f"{name}: {keyword} ({labels}) not among {sorted(available)}"
        outer = next((set(labels) - {"le"} for kw, labels in lists if kw == "by"), available)
        for text in r["annotations"].values():
            for label in re.findall(r"\$labels\.(\w+)", text):
                assert label in outer, f"{name}: the alert's series have no {label} label"


def _emitted_outcomes() -> set[str]:
    from scheduler.routing.reasons import REJECT_TABLE, Outcome
    from server.errors import Cause
    from server.failure import GatewayOutcome

    # Cause.NO_WORKER is raised on the request path only with the router's code as its reason (admission's
    # `_refuse_if_final`); its other raisers (tokenize, LoRA admin) record no outcome
    # and a gateway bug ends a dispatched request as `internal_error`, not `rejected_internal_error`
    causes = {c.value for c in Cause} - {Cause.NO_WORKER.value, Cause.INTERNAL.value}
    rejected = {f"rejected_{c}" for c in causes} | {f"rejected_{r.code}" for r in REJECT_TABLE.values()}
    return {o.value for o in Outcome} | {o.value for o in GatewayOutcome} | rejected


def test_every_label_value_a_rule_matches_is_one_mosaic_emits(chart: helm.Chart) -> None:
    """A typo in `outcome=~"rejected_(...)"` or `state="ready"` would select nothing, and the alert would
    never fire: every alternative must be a value the gateway can write."""
    from scheduler.fleet import WorkerState

    domains = {
        "outcome": _emitted_outcomes(),
        "state": {s.value for s in WorkerState},
    }
    checked = 0
    for name, r in rules(render(chart, {**on(selector=""), **SLO})).items():
        for sel in selectors(r["expr"]):
            for label, op, value in sel.matchers:
                domain = domains[label]
                if op == "=":
                    assert value in domain, f"{name}: {label}={value!r} is never emitted"
                else:
                    grouped = re.fullmatch(r"(\w*)\(([\w|]+)\)", value)
                    alternatives = (
                        [grouped[1] + a for a in grouped[2].split("|")] if grouped else value.split("|")
                    )
                    for alt in alternatives:
                        hits = {v for v in domain if re.fullmatch(alt, v)}
                        assert hits, f"{name}: {label}=~{value!r}: {alt!r} matches nothing emitted"
                checked += 1
    # the failed and the dispatched outcomes, the shed ones; the ready state (no ready worker, stale
    # metrics); ready or unhealthy (an open breaker)
    assert checked == 6


MODEL = "llama-3-8b"


def test_the_rules_select_a_live_gateways_series_in_the_proportions_they_compare(chart: helm.Chart) -> None:
    """One L4 slot and a queue of one (as tests/gateway/test_protection.py): a stream, then a burst of four
    of which one runs, two find the queue full and one waits out its deadline. The shed rule's numerator
    then counts 3 and its denominator 5, the failure rule's 0 of the 2 sent to the worker, and each rule's
    other selectors find their series."""
    from server.config import validate_config
    from tests.gateway.serverkit import GatewayThread

    cfg = validate_config(
        {
            "pools": [
                {
                    "name": "l4",
                    "model": MODEL,
                    "gpu": "L4",
                    "role": "mixed",
                    "max_num_seqs": 1,
                    "endpoints": {"simulated": {"replicas": 1, "time_scale": 2.0}},
                }
            ],
            "routing": {"plugins": [{"type": "at-capacity", "params": {"inflight_factor": 1.0}}]},
            "limits": {"queue_size": 1, "queue_deadline_s": 0.4},
        }
    )
    body = {"model": MODEL, "prompt": [1] * 16, "max_tokens": 40, "ignore_eos": True}

    async def traffic(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            stream = await http.post("/v1/completions", json={**body, "max_tokens": 8, "stream": True})
            first = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            rest = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(3)]
            return [stream.status_code, *[(await t).status_code for t in (first, *rest)]]

    with GatewayThread(cfg) as gw:
        assert sorted(asyncio.run(traffic(gw.url))) == [200, 200, 429, 429, 429]
        gw.metric_reaches("mosaic_requests_received_total", 5, model=MODEL)
        text = httpx.get(f"{gw.url}/metrics").text
    exposition = list(samples(text))

    def total(sel: Any) -> float:
        return sum(v for n, labels, v in exposition if sel.matches(n, labels))

    got = rules(render(chart, {**on(selector=""), **SLO}))
    counts = {name: [total(sel) for sel in selectors(r["expr"])] for name, r in got.items()}
    # failures: none of the 2 requests sent to the worker (the 3 shed are not its failures); 5 received
    assert counts["MosaicRequestsFailing"] == [0.0, 2.0, 5.0]
    assert counts["MosaicRequestsShed"] == [3.0, 5.0, 5.0]  # 2 queue_full + 1 queue_timeout, of 5 received
    # the one worker listed, and ready: the rule's `unless` leaves nothing
    assert counts["MosaicPoolNoReadyWorkers"] == [1.0, 1.0]
    for alert in LATENCY:
        bucket, count = selectors(got[alert]["expr"])
        inf = [v for n, labels, v in exposition if bucket.matches(n, labels) and labels["le"] == "+Inf"]
        assert inf == [1.0] and total(count) == 1.0, (
            alert
        )  # the stream: TTFT and TPOT are measured on streams
    breaker, ready_or_unhealthy = selectors(got["MosaicWorkerBreakerOpen"]["expr"])
    assert [v for n, labels, v in exposition if breaker.matches(n, labels)] == [0.0]
    assert total(ready_or_unhealthy) == 1.0
    age, ready, closed = selectors(got["MosaicWorkerMetricsStale"]["expr"])
    ages = [v for n, labels, v in exposition if age.matches(n, labels)]
    assert len(ages) == 1 and 0.0 <= ages[0] < 60 and total(ready) == 1.0
    assert [v for n, labels, v in exposition if closed.matches(n, labels)] == [0.0]
