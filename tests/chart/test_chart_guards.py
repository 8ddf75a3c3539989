"""Values that would render but break in the cluster fail the render with a message naming the values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.chart.chartkit import refusal, render


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {"poolDefaults": {"drainSeconds": 300, "terminationGracePeriodSeconds": 60}},
            "drainSeconds 300 must be below terminationGracePeriodSeconds 60",
            id="a worker's preStop drain longer than its grace period: killed mid-drain on every scale-in",
        ),
        pytest.param(
            {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
            "gateway.autoscaling.minReplicas 5 is above maxReplicas 2",
            id="an HPA the API server refuses mid-install",
        ),
        pytest.param(
            {
                "pools": [
                    {
                        "name": "l4",
                        "model": "llama-3-8b",
                        "gpu": "L4",
                        "simulated": True,
                        "domains": ["east"],
                    },
                    {"name": "l4-east", "model": "llama-3-8b", "gpu": "L4", "simulated": True},
                ],
                "gateway": {"discovery": {"domainLabel": "mosaic.dev/rack"}},
            },
            'pools[1] (l4-east): Deployment name "mosaic-l4-east" is already pool "l4"\'s',
            id="a pool named <pool>-<domain>: two pools' manifests on one Deployment",
        ),
        pytest.param(
            {
                "pools": [
                    {"name": "l4-east", "model": "llama-3-8b", "gpu": "L4", "simulated": True},
                    {
                        "name": "l4",
                        "model": "llama-3-8b",
                        "gpu": "L4",
                        "simulated": True,
                        "domains": ["east"],
                    },
                ],
                "gateway": {"discovery": {"domainLabel": "mosaic.dev/rack"}},
            },
            'pools[1] (l4): Deployment name "mosaic-l4-east" is already pool "l4-east"\'s',
            id="the same collision, pools the other way round",
        ),
        pytest.param(
            {"poolDefaults": {"drainSeconds": 5}, "gateway": {"discovery": {"resyncSeconds": 30}}},
            "drainSeconds 5 must exceed gateway.discovery.resyncSeconds 30",
            id="a worker SIGTERMed before the gateways re-list and see it terminating",
        ),
        pytest.param(
            {"commonLabels": {"app.kubernetes.io/name": "x"}},
            "invalid propertyName 'app.kubernetes.io/name'",
            id="a common label the chart sets itself: rendered twice, or pods off their selector",
        ),
        pytest.param(
            {"monitoring": {"serviceMonitor": {"enabled": True, "interval": "5s", "scrapeTimeout": "10s"}}},
            "monitoring: scrapeTimeout 10s is longer than interval 5s",
            id="a ServiceMonitor the Prometheus operator drops: metrics silently unscraped",
        ),
        pytest.param(
            {"monitoring": {"podMonitor": {"enabled": True, "interval": "1m", "scrapeTimeout": "61s"}}},
            "monitoring: scrapeTimeout 61s is longer than interval 1m",
            id="a PodMonitor the operator drops, units compared",
        ),
        pytest.param(
            {"config": {"autoscaler": {"enabled": False}}},
            "config.autoscaler.enabled: false does not stop the controller",
            id="autoscaling turned off where the controller does not read it: it would scale anyway",
        ),
    ],
)
def test_values_that_break_in_the_cluster_fail_the_render(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    assert message in refusal(chart, values)


def test_a_gateway_scaled_to_zero_still_renders_a_config_the_controller_loads(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """Before: `gateway.replicas: 0` wrote `gateway.replicas: 0` into the shared ConfigMap, which the
    controller (`mosaic autoscale --config`) refused, so it crash-looped while the gateway was down."""
    rendered = render(chart, {"gateway": {"replicas": 0}, "controller": {"enabled": True}})
    assert rendered.config()["gateway"]["replicas"] == 1
    assert rendered.load_config(tmp_path).gateway.replicas == 1


@pytest.mark.parametrize("resource", ["endpointslices", "pods"])
def test_an_all_digit_pool_name_stays_a_string_label(
    chart: helm.Chart, tmp_path: Path, resource: str
) -> None:
    """The schema accepts a pool named `123` (a DNS label); unquoted it rendered as an integer label value,
    which the API server refuses, and the pods selector read `mosaic.dev/pool=%!s(float64=123)`."""
    values = {
        "pools": [{"name": "123", "model": "llama-3-8b", "gpu": "L4", "simulated": True}],
        "gateway": {"discovery": {"resource": resource}},
    }
    rendered = render(chart, values)
    dep = rendered.get("Deployment", "mosaic-123")
    assert dep["metadata"]["labels"]["mosaic.dev/pool"] == "123"
    assert dep["spec"]["template"]["metadata"]["labels"]["mosaic.dev/pool"] == "123"
    assert dep["spec"]["selector"]["matchLabels"]["mosaic.dev/pool"] == "123"
    config = rendered.load_config(tmp_path)
    (pool,) = config.pools
    if resource == "pods":
        assert "mosaic.dev/pool=123" in pool.endpoints.kubernetes.label_selector.split(",")


@pytest.mark.parametrize(
    ("interval", "timeout", "expected"),
    [("5s", "", None), ("1m", "59s", "59s"), ("15s", "15s", "15s"), ("2s", "1500ms", "1500ms")],
)
def test_a_monitor_timeout_is_left_out_or_kept_at_most_the_interval(
    chart: helm.Chart, interval: str, timeout: str, expected: str | None
) -> None:
    """Before, every monitor carried scrapeTimeout 10s whatever its interval; at 5s the operator dropped it."""
    values = {
        "monitoring": {"serviceMonitor": {"enabled": True, "interval": interval, "scrapeTimeout": timeout}}
    }
    (endpoint,) = render(chart, values).get("ServiceMonitor", "mosaic")["spec"]["endpoints"]
    assert endpoint["interval"] == interval
    assert endpoint.get("scrapeTimeout") == expected


@pytest.mark.parametrize("name", ["mosaic-gateway", "mosaic-controller", "mosaic-l4"])
def test_a_catalog_change_rolls_the_pods_that_read_it(chart: helm.Chart, name: str) -> None:
    """The catalog is read once at start by the gateway, the controller and simulated workers; only the
    gateway config was hashed, so a price change reached no running pod."""
    base = {
        "pools": [{"name": "l4", "model": "llama-3-8b", "gpu": "L4", "simulated": True}],
        "controller": {"enabled": True},
    }

    def template(price: float) -> dict[str, Any]:
        values = {**base, "catalog": {"gpus": {"L4": {"cost_per_hour": price}}}}
        return render(chart, values).get("Deployment", name)["spec"]["template"]

    assert template(0.8) != template(0.9)
    assert template(0.8) == template(0.8)


def test_a_release_named_by_digits_stays_a_string_label(chart: helm.Chart) -> None:
    """`app.kubernetes.io/instance: 2024` rendered an integer label, which the API server refuses."""
    manifests = chart.render({}, name="2024", namespace="llm", is_install=True)
    objects = [
        d
        for template, text in manifests.items()
        if not template.endswith("NOTES.txt")
        for d in yaml.safe_load_all(text)
        if isinstance(d, dict)
    ]
    (gateway,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "2024-mosaic-gateway"
    ]
    assert gateway["metadata"]["labels"]["app.kubernetes.io/instance"] == "2024"
    assert gateway["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "2024"


def test_simulated_pools_do_not_take_the_gpu_toleration(chart: helm.Chart) -> None:
    """poolDefaults' toleration of the GPU taint let CPU-only simulated pods land on GPU nodes."""
    sim = {"name": "sim", "model": "llama-3-8b", "gpu": "L4", "simulated": True}
    own = {**sim, "name": "own", "tolerations": [{"key": "x", "operator": "Exists"}]}
    real = {"name": "real", "model": "llama-3-8b", "gpu": "L4"}
    rendered = render(chart, {"pools": [sim, own, real]})

    def tolerations(name: str) -> Any:
        return rendered.get("Deployment", f"mosaic-{name}")["spec"]["template"]["spec"].get("tolerations")

    assert tolerations("sim") is None
    assert tolerations("own") == [{"key": "x", "operator": "Exists"}]
    assert tolerations("real") == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_gpu_pools_take_runtime_class_volumes_and_spread(chart: helm.Chart) -> None:
    spread = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"mosaic.dev/pool": "real"}}}]  # fmt: skip
    ib = {"name": "ib", "hostPath": {"path": "/dev/infiniband"}}
    pool = {
        "name": "real", "model": "llama-3-8b", "gpu": "L4", "runtimeClassName": "nvidia",
        "extraVolumes": [ib], "extraVolumeMounts": [{"name": "ib", "mountPath": "/dev/infiniband"}],
        "topologySpreadConstraints": spread,
    }  # fmt: skip
    spec = render(chart, {"pools": [pool]}).get("Deployment", "mosaic-real")["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia" and spec["topologySpreadConstraints"] == spread
    assert ib in spec["volumes"]
    assert {"name": "ib", "mountPath": "/dev/infiniband"} in spec["containers"][0]["volumeMounts"]


def test_ingress_and_route_expose_the_openai_api_only_by_default(chart: helm.Chart) -> None:
    """Both routed `/`: /metrics and /ready (no auth: pod and pool names, traffic) reached the internet."""
    rendered = render(chart, {"gateway": {"ingress": {"enabled": True}, "httpRoute": {"enabled": True}}})
    (rule,) = rendered.get("Ingress", "mosaic-gateway")["spec"]["rules"]
    assert [p["path"] for p in rule["http"]["paths"]] == ["/v1"]
    (route,) = rendered.get("HTTPRoute", "mosaic-gateway")["spec"]["rules"]
    assert route["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    more = {"gateway": {"httpRoute": {"enabled": True, "pathPrefixes": ["/v1", "/admin"]}}}
    (route,) = render(chart, more).get("HTTPRoute", "mosaic-gateway")["spec"]["rules"]
    assert [m["path"]["value"] for m in route["matches"]] == ["/v1", "/admin"]
