"""Probes render every field the values schema accepts (the gateway's liveness with a timeout its event loop
can meet under load), the controller is probed on the /metrics it serves and annotated for scraping as the
gateway is, and the gateway replicas spread over nodes by default."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.chart.chartkit import RELEASE, container, pod_labels, pod_spec, render, selects

KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
PROBES = {"startup": "startupProbe", "readiness": "readinessProbe", "liveness": "livenessProbe"}


def _probe_values(chart: helm.Chart, offset: int) -> dict[str, int]:
    """A distinct value for every field of the schema's `probe` definition."""
    fields = chart.schema["definitions"]["probe"]["properties"]  # type: ignore[index]
    return {name: offset + i for i, name in enumerate(sorted(fields))}


def _validate(obj: dict[str, Any]) -> None:
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


# ---- every probe field rendered ----

# values key → (Deployment, its probes' handler per probe)
PROBED = {
    "gateway": (
        f"{RELEASE}-gateway",
        {
            "startup": {"path": "/health", "port": "http"},
            "readiness": {"path": "/ready", "port": "http"},
            "liveness": {"path": "/health", "port": "http"},
        },
    ),
    "vllm": (f"{RELEASE}-a100-mixed", {kind: {"path": "/health", "port": "http"} for kind in PROBES}),
    "controller": (
        f"{RELEASE}-controller",
        {kind: {"path": "/metrics", "port": "metrics"} for kind in PROBES},
    ),
}


@pytest.mark.parametrize("component", list(PROBED))
def test_every_probe_field_the_schema_accepts_is_rendered(chart: helm.Chart, component: str) -> None:
    """Before: gateway.probes.*.timeoutSeconds passed the schema and was dropped (Kubernetes' 1 s applied),
    and the controller had no probes at all."""
    probes = {kind: _probe_values(chart, 10 * (i + 1)) for i, kind in enumerate(PROBES)}
    name, handlers = PROBED[component]
    dep = render(chart, {component: {"probes": probes}}).get("Deployment", name)
    c = container(dep)
    for kind, field in PROBES.items():
        assert c[field] == {"httpGet": handlers[kind], **probes[kind]}, f"{component} {kind}"
    _validate(dep)


@pytest.mark.parametrize(
    ("component", "expected"),
    [
        pytest.param(
            "gateway", {"startup": (2, 60, 2), "readiness": (5, 3, 3), "liveness": (10, 3, 5)}, id="gateway"
        ),
        pytest.param(
            "controller",
            {"startup": (5, 24, 5), "readiness": (10, 3, 5), "liveness": (20, 3, 5)},
            id="controller",
        ),
    ],
)
def test_default_probe_timings(
    chart: helm.Chart, component: str, expected: dict[str, tuple[int, int, int]]
) -> None:
    """(periodSeconds, failureThreshold, timeoutSeconds): the gateway's liveness waits 5 s, not 1 s, for an
    event loop that proxies every stream (a 1 s timeout restarted busy gateways and cut their streams)."""
    c = container(render(chart).get("Deployment", PROBED[component][0]))
    for kind, field in PROBES.items():
        probe = c[field]
        assert (probe["periodSeconds"], probe["failureThreshold"], probe["timeoutSeconds"]) == expected[kind]


def test_simulated_workers_are_probed_with_the_gateways_default_timings(chart: helm.Chart) -> None:
    """Before: Kubernetes' 1 s timeout, which a simulated worker's one event loop, timing every stream it
    serves, can miss under load: three misses restarted it and cut its streams."""
    rendered = render(chart, {"simulated": True})
    gateway = container(rendered.get("Deployment", f"{RELEASE}-gateway"))
    for dep in rendered.pool_deployments():
        c = container(dep)
        assert c["command"][0] == "mosaic" or "worker" in c.get("args", [])
        for field in PROBES.values():
            timings = ("periodSeconds", "failureThreshold", "timeoutSeconds")
            assert {k: c[field][k] for k in timings} == {k: gateway[field][k] for k in timings}, field
        _validate(dep)


def test_a_gateway_liveness_timeout_set_to_null_keeps_a_safe_default(chart: helm.Chart) -> None:
    """A user's `timeoutSeconds: null` removes the key (Helm): liveness falls back to 5 s, the others to 1 s."""
    probes = {kind: {"timeoutSeconds": None} for kind in PROBES}
    c = container(render(chart, {"gateway": {"probes": probes}}).get("Deployment", f"{RELEASE}-gateway"))
    assert [c[field]["timeoutSeconds"] for field in PROBES.values()] == [1, 1, 5]


# ---- the controller: probes and scrape annotations on its metrics port ----


@pytest.mark.parametrize(
    ("values", "annotated"),
    [
        pytest.param({}, True, id="annotations scraping (default)"),
        pytest.param({"monitoring": {"scrapeAnnotations": False}}, False, id="scrapeAnnotations off"),
        pytest.param({"monitoring": {"podMonitor": {"enabled": True}}}, False, id="its PodMonitor instead"),
        pytest.param(
            {"monitoring": {"serviceMonitor": {"enabled": True}}}, False, id="a ServiceMonitor: same"
        ),
        pytest.param({"controller": {"metricsPort": 9191}}, True, id="another port"),
    ],
)
def test_the_controller_is_annotated_for_scraping_as_the_gateway(
    chart: helm.Chart, values: dict[str, Any], annotated: bool
) -> None:
    """Before: a Prometheus scraping by annotation never found the controller's /metrics."""
    rendered = render(chart, values)
    controller = rendered.get("Deployment", f"{RELEASE}-controller")
    gateway = rendered.get("Deployment", f"{RELEASE}-gateway")
    (port,) = [p["containerPort"] for p in container(controller)["ports"] if p["name"] == "metrics"]
    notes = controller["spec"]["template"]["metadata"]["annotations"]
    scrape = {k: v for k, v in notes.items() if k.startswith("prometheus.io/")}
    assert scrape == (
        {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
        if annotated
        else {}
    )
    # consistent with the gateway's: both annotated, or neither
    assert ("prometheus.io/scrape" in gateway["spec"]["template"]["metadata"]["annotations"]) == annotated
    for field in PROBES.values():
        assert container(controller)[field]["httpGet"] == {"path": "/metrics", "port": "metrics"}


def test_a_controller_without_metrics_port_has_no_probes_or_annotations(chart: helm.Chart) -> None:
    controller = render(chart, {"controller": {"metricsPort": 0}}).get("Deployment", f"{RELEASE}-controller")
    c = container(controller)
    assert not {"ports", *PROBES.values()} & set(c)
    assert not any(
        k.startswith("prometheus.io/") for k in controller["spec"]["template"]["metadata"]["annotations"]
    )
    _validate(controller)


# ---- gateway spread over nodes ----

HOSTNAME_SPREAD = {
    "maxSkew": 1,
    "topologyKey": "kubernetes.io/hostname",
    "whenUnsatisfiable": "ScheduleAnyway",
}


def test_gateway_replicas_spread_over_nodes_by_default(chart: helm.Chart) -> None:
    """Before: no spread, so the scheduler could put both gateway replicas on one node (one failure: no API)."""
    rendered = render(chart)
    gateway = rendered.get("Deployment", f"{RELEASE}-gateway")
    (constraint,) = pod_spec(gateway)["topologySpreadConstraints"]
    selector = gateway["spec"]["selector"]["matchLabels"]
    # matchLabelKeys: a rollout's new pods are spread among themselves (before, the old ReplicaSet's pods
    # counted toward the skew, so new pods stacked on the nodes the old ones were leaving)
    assert constraint == {
        **HOSTNAME_SPREAD,
        "labelSelector": {"matchLabels": selector},
        "matchLabelKeys": ["pod-template-hash"],
    }
    # it counts exactly the gateway's pods
    spread = [
        d["metadata"]["name"] for d in rendered.of_kind("Deployment") if selects(selector, pod_labels(d))
    ]
    assert spread == [f"{RELEASE}-gateway"]
    _validate(gateway)


@pytest.mark.parametrize(
    ("spread", "expected"),
    [
        pytest.param([], None, id="[] turns it off"),
        pytest.param(None, None, id="null turns it off"),
        pytest.param(
            [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "DoNotSchedule",
                }
            ],
            [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "DoNotSchedule",
                    "labelSelector": "gateway",
                }
            ],
            id="a list of your own, labelSelector filled in",
        ),
        pytest.param(
            [{**HOSTNAME_SPREAD, "labelSelector": {"matchLabels": {"tier": "edge"}}}],
            [{**HOSTNAME_SPREAD, "labelSelector": {"matchLabels": {"tier": "edge"}}}],
            id="your own labelSelector kept",
        ),
    ],
)
def test_gateway_spread_can_be_replaced_or_turned_off(
    chart: helm.Chart, spread: list[dict[str, Any]] | None, expected: list[dict[str, Any]] | None
) -> None:
    gateway = render(chart, {"gateway": {"topologySpreadConstraints": spread}}).get(
        "Deployment", f"{RELEASE}-gateway"
    )
    selector = {"matchLabels": gateway["spec"]["selector"]["matchLabels"]}
    if expected is not None:
        expected = [
            {**c, "labelSelector": selector} if c["labelSelector"] == "gateway" else c for c in expected
        ]
    assert pod_spec(gateway).get("topologySpreadConstraints") == expected
