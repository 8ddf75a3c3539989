"""The controller's view of the gateways: the config the chart renders points `mosaic autoscale` at exactly
the release's gateway pods (their labels, their port), parses with Mosaic's loader into the scraper's
config, is allowed by the controller's Role, and can be turned off or replaced; objects stay valid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.chart.chartkit import (
    EXAMPLES_DIR,
    NAMESPACE,
    RELEASE,
    container,
    load_values,
    parse_selector,
    pod_labels,
    render,
)

CASES = [pytest.param(None, id="default values")] + [
    pytest.param(p, id=f"example {p.name}") for p in sorted(EXAMPLES_DIR.glob("*.yaml"))
]


@pytest.mark.parametrize("values_file", CASES)
def test_controller_scrapes_exactly_the_release_gateway_pods(
    chart: helm.Chart, values_file: Path | None, tmp_path: Path
) -> None:
    rendered = render(chart, load_values(values_file) if values_file else {})
    gateways = rendered.config()["autoscaler"]["gateways"]
    pods = gateways["kubernetes"]
    assert (pods["resource"], pods["namespace"], pods["in_cluster"]) == ("pods", NAMESPACE, True)
    assert pods["domain_label"] is None  # gateways have no network domain: no node listing, no nodes RBAC
    selector = parse_selector(pods["label_selector"])
    deployments = rendered.of_kind("Deployment")
    selected = [d["metadata"]["name"] for d in deployments if selector.items() <= pod_labels(d).items()]
    assert selected == [f"{RELEASE}-gateway"]  # the gateway's pods, not the controller's or a pool's
    gateway = rendered.get("Deployment", f"{RELEASE}-gateway")
    assert selector == gateway["spec"]["selector"]["matchLabels"]
    http = next(p for p in container(gateway)["ports"] if p["name"] == "http")
    assert pods["port"] == http["containerPort"]
    # the Role the controller runs under may list those pods in the release namespace
    role = rendered.get("Role", f"{RELEASE}-controller")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert any(r["resources"] == ["pods"] and "list" in r["verbs"] for r in role["rules"])
    # what `mosaic autoscale` reads: the scraper's config, default period 5 s
    config = rendered.load_config(tmp_path)
    scrape = config.autoscaler.gateways
    assert scrape is not None and scrape.kubernetes is not None and scrape.static is None
    assert (scrape.interval_s, scrape.kubernetes.resync_s, scrape.path) == (5.0, 30.0, "/metrics")
    for version in ("1.27.0", kubernetes_validate.utils.latest_version()):
        for obj in (rendered.get("ConfigMap", f"{RELEASE}-config"), role):
            kubernetes_validate.validate(obj, version, strict=True)


def test_interval_and_resync_follow_the_values(chart: helm.Chart) -> None:
    values = {"controller": {"gatewayMetrics": {"intervalSeconds": 2, "resyncSeconds": 10}}}
    gateways = render(chart, values).config()["autoscaler"]["gateways"]
    assert (gateways["interval_s"], gateways["kubernetes"]["resync_s"]) == (2, 10)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param(
            {"controller": {"gatewayMetrics": {"enabled": False}}}, None, id="turned off: no gateways key"
        ),
        pytest.param(
            {"config": {"autoscaler": {"gateways": {"static": ["http://gw.example:8080"]}}}},
            {"static": ["http://gw.example:8080"]},
            id="the user's own gateways section is kept as written",
        ),
        pytest.param(
            {"controller": {"enabled": False}}, None, id="no controller: no autoscaler section at all"
        ),
    ],
)
def test_gateways_section_can_be_off_or_replaced(
    chart: helm.Chart, values: dict[str, Any], expected: dict[str, Any] | None
) -> None:
    scaler = render(chart, values).config().get("autoscaler") or {}
    assert scaler.get("gateways") == expected


def test_schema_refuses_a_zero_scrape_period(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema({"controller": {"gatewayMetrics": {"intervalSeconds": 0}}})
    assert "intervalSeconds" in str(caught.value)


@pytest.mark.parametrize(
    ("port", "expected"), [pytest.param(None, 9090, id="default 9090"), pytest.param(0, None, id="0: off")]
)
def test_controller_metrics_port(chart: helm.Chart, port: int | None, expected: int | None) -> None:
    values = {} if port is None else {"controller": {"metricsPort": port}}
    rendered = render(chart, values)
    controller = rendered.get("Deployment", f"{RELEASE}-controller")
    c = container(controller)
    args = c["args"]
    if expected is None:
        assert "--metrics-port" not in args and "ports" not in c
        return
    assert args[args.index("--metrics-port") + 1] == str(expected)
    assert c["ports"] == [{"name": "metrics", "containerPort": expected, "protocol": "TCP"}]
    for version in ("1.27.0", kubernetes_validate.utils.latest_version()):
        kubernetes_validate.validate(controller, version, strict=True)
