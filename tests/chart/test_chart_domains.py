"""`pools[].domains`: a pool becomes one Deployment per network domain, pinned to the domain's nodes, behind
the pool's one Service, and the ConfigMap tells the controller which Deployment holds which domain; and the
controller's own /metrics gets a PodMonitor when the Prometheus operator is in use. Objects stay valid for
the API (kubernetes-validate, strict)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from placement.catalog import load_catalog
from server.autoscale_placement import check_domains, config_inventory
from server.commands.autoscale import kubernetes_deployments, kubernetes_domains
from tests.chart.chartkit import (
    CRD_KINDS,
    EXAMPLES_DIR,
    NAMESPACE,
    RELEASE,
    container,
    label_selector_matches,
    load_values,
    parse_selector,
    pod_labels,
    pod_spec,
    refusal,
    render,
    selects,
)

RACK = "example.com/rack"
POOLS = [
    {"name": "prefill", "model": "llama-3-8b", "gpu": "H100-SXM", "role": "prefill", "replicas": 1},
    {
        "name": "decode",
        "model": "llama-3-8b",
        "gpu": "L4",
        "role": "decode",
        "replicas": 3,
        "maxReplicas": 8,
        "domains": ["rack-1", "Rack_2"],
        "nodeSelector": {"pool": "gpu"},
    },
]
VALUES: dict[str, Any] = {"simulated": True, "gateway": {"discovery": {"domainLabel": RACK}}, "pools": POOLS}
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())


def _validate(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["kind"] not in CRD_KINDS:
            for version in KUBE_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def test_a_pool_with_domains_is_one_deployment_per_domain(chart: helm.Chart) -> None:
    rendered = render(chart, VALUES)
    deps = rendered.deployments_of_pool("decode")
    # "Rack_2" → DNS label "rack-2"; 3 replicas over 2 domains: 2 + 1 (the first 3 mod 2 domains get one more)
    assert [(d["metadata"]["name"], d["spec"]["replicas"]) for d in deps] == [
        (f"{RELEASE}-decode-rack-1", 2),
        (f"{RELEASE}-decode-rack-2", 1),
    ]
    pool_labels = {
        "app.kubernetes.io/component": "worker",
        "mosaic.dev/pool": "decode",
        "mosaic.dev/role": "decode",
        "mosaic.dev/gpu": "L4",
        "mosaic.dev/simulated": "true",
    }
    for dep, domain in zip(deps, ["rack-1", "Rack_2"], strict=True):
        labels = pod_labels(dep)
        assert pool_labels.items() <= labels.items() and labels["mosaic.dev/domain"] == domain
        assert dep["metadata"]["labels"]["mosaic.dev/domain"] == domain
        # its own selector (Deployments must not share pods), which includes the domain
        assert dep["spec"]["selector"]["matchLabels"]["mosaic.dev/domain"] == domain
        assert selects(dep["spec"]["selector"]["matchLabels"], labels)
        # pinned to the domain's nodes, the pool's own nodeSelector kept
        assert pod_spec(dep)["nodeSelector"] == {RACK: domain, "pool": "gpu"}
        assert dep["metadata"]["annotations"]["mosaic.dev/max-replicas"] == "8"
    # one Service for the pool, selecting both domains' pods and nothing else
    svc = rendered.get("Service", f"{RELEASE}-decode")
    chosen = [
        d["metadata"]["name"]
        for d in rendered.pool_deployments()
        if selects(svc["spec"]["selector"], pod_labels(d))
    ]
    assert chosen == [f"{RELEASE}-decode-rack-1", f"{RELEASE}-decode-rack-2"]
    assert [
        s["metadata"]["name"]
        for s in rendered.of_kind("Service")
        if "mosaic.dev/pool" in s["metadata"]["labels"]
    ] == [
        f"{RELEASE}-prefill",
        f"{RELEASE}-decode",
    ]
    # a pool without domains is as before: one Deployment named after the pool, no domain label
    (prefill,) = rendered.deployments_of_pool("prefill")
    assert prefill["metadata"]["name"] == f"{RELEASE}-prefill" and "mosaic.dev/domain" not in pod_labels(
        prefill
    )
    assert "nodeSelector" not in pod_spec(prefill)
    # the controller may scale exactly these three Deployments
    rule = next(
        r
        for r in rendered.get("Role", f"{RELEASE}-controller")["rules"]
        if r["resources"] == ["deployments/scale"]
    )
    assert rule["resourceNames"] == [
        f"{RELEASE}-prefill",
        f"{RELEASE}-decode-rack-1",
        f"{RELEASE}-decode-rack-2",
    ]
    _validate(list(rendered.objects))


def test_the_configmap_maps_each_domain_to_its_deployment(chart: helm.Chart, tmp_path: Path) -> None:
    rendered = render(chart, VALUES)
    cfg = rendered.load_config(tmp_path)
    assert kubernetes_domains(cfg) == {
        "decode": {"rack-1": f"{RELEASE}-decode-rack-1", "Rack_2": f"{RELEASE}-decode-rack-2"}
    }
    assert kubernetes_deployments(cfg) == {"prefill": f"{RELEASE}-prefill"}
    assert (cfg.autoscaler.actuator, cfg.autoscaler.kubernetes.namespace) == ("kubernetes", NAMESPACE)
    # discovery still sees one pool: its Service's EndpointSlices (both domains' pods), domains from the label
    decode = next(p for p in cfg.pools if p.name == "decode")
    assert decode.endpoints.kubernetes is not None
    assert decode.endpoints.kubernetes.label_selector == f"kubernetes.io/service-name={RELEASE}-decode"
    assert decode.endpoints.kubernetes.domain_label == RACK


def test_discovery_by_pods_selects_every_domains_pods(chart: helm.Chart) -> None:
    values = {**VALUES, "gateway": {"discovery": {"domainLabel": RACK, "resource": "pods"}}}
    rendered = render(chart, values)
    decode = next(p for p in rendered.config()["pools"] if p["name"] == "decode")
    selector = parse_selector(decode["endpoints"]["kubernetes"]["label_selector"])
    chosen = [d["metadata"]["name"] for d in rendered.pool_deployments() if selects(selector, pod_labels(d))]
    assert chosen == [f"{RELEASE}-decode-rack-1", f"{RELEASE}-decode-rack-2"]


def test_a_real_vllm_pool_keeps_its_gpu_affinity_and_adds_the_domain(chart: helm.Chart) -> None:
    pool = {"name": "decode", "model": "llama-3-8b", "gpu": "L4", "role": "decode", "domains": ["rack-1"]}
    rendered = render(chart, {"gateway": {"discovery": {"domainLabel": RACK}}, "pools": [pool]})
    (dep,) = rendered.deployments_of_pool("decode")
    spec = pod_spec(dep)
    assert spec["nodeSelector"] == {RACK: "rack-1"}
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]
    assert term["matchExpressions"][0]["values"] == ["NVIDIA-L4"]
    assert container(dep)["resources"]["limits"]["nvidia.com/gpu"] == 1
    _validate([dep])


def test_a_long_deployment_name_is_cut_to_63_with_a_hash(chart: helm.Chart) -> None:
    release_name = "mosaic-serving-for-the-research-cluster"  # fullnameOverride: 39 characters
    domain = "us-east-1a-row-0042-switch-7"
    values = {**VALUES, "fullnameOverride": release_name, "pools": [{**POOLS[1], "domains": [domain]}]}
    (dep,) = render(chart, values).deployments_of_pool("decode")
    full = f"{release_name}-decode-{domain}"  # 74 characters
    # first 54 characters ("...-decode-us-east-1a-row") without a trailing "-", then 8 hex of sha256(full)
    expected = f"{full[:54].rstrip('-')}-{hashlib.sha256(full.encode()).hexdigest()[:8]}"
    assert dep["metadata"]["name"] == expected and len(expected) <= 63
    _validate([dep])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {**VALUES, "gateway": {"discovery": {"domainLabel": None}}},
            "pools[1] (decode): domains need gateway.discovery.domainLabel",
            id="domains without a domain label",
        ),
        pytest.param(
            {**VALUES, "pools": [{**POOLS[1], "domains": ["rack_1", "rack.1"]}]},
            'pools[0] (decode): domain "rack.1" makes the Deployment name "mosaic-decode-rack-1", which is empty or '
            "another domain's",
            id="two domains with one Deployment name",
        ),
        pytest.param(
            {**VALUES, "pools": [{**POOLS[1], "nodeSelector": {RACK: "rack-1"}}]},
            "pools[0] (decode): nodeSelector sets example.com/rack, which domains set per Deployment",
            id="a nodeSelector on the domain label itself",
        ),
    ],
)
def test_templates_refuse_what_cannot_work(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    assert message in refusal(chart, values)


@pytest.mark.parametrize(
    "domains",
    [
        pytest.param([], id="an empty list"),
        pytest.param(["rack-1", "rack-1"], id="a domain twice"),
        pytest.param(["rack 1"], id="not a label value"),
    ],
)
def test_schema_refuses_bad_domains(chart: helm.Chart, domains: list[str]) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema({"pools": [{**POOLS[1], "domains": domains}]})
    assert "/pools/0/domains" in str(caught.value)


def test_the_example_places_per_zone_and_its_inventory_covers_every_domain(
    chart: helm.Chart, tmp_path: Path
) -> None:
    rendered = render(chart, load_values(EXAMPLES_DIR / "topology-domains.yaml"))
    names = [d["metadata"]["name"] for d in rendered.pool_deployments()]
    assert names == [
        f"{RELEASE}-h100-prefill-us-east-1a",
        f"{RELEASE}-h100-prefill-us-east-1b",
        f"{RELEASE}-l4-decode-us-east-1a",
        f"{RELEASE}-l4-decode-us-east-1b",
    ]
    cfg = rendered.load_config(tmp_path)
    # what `mosaic autoscale` checks at startup: every domain in the inventory, every zone with the GPUs mapped
    catalog = load_catalog(cfg.catalog)
    inventory = config_inventory(cfg, catalog)
    assert inventory is not None
    check_domains(kubernetes_domains(cfg), inventory, {p.name: catalog.gpu(p.gpu).name for p in cfg.pools})
    assert not rendered.of_kind("ClusterRole")  # the zone label comes with EndpointSlices: no node reads


@pytest.mark.parametrize(
    ("values", "monitor"),
    [
        pytest.param(
            {"monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}},
            "podMonitor",
            id="PodMonitor on: the controller's uses its settings",
        ),
        pytest.param(
            {"monitoring": {"serviceMonitor": {"enabled": True, "interval": "30s", "scrapeTimeout": "30s"}}},
            "serviceMonitor",
            id="ServiceMonitor only: the operator is there too",
        ),
        pytest.param(
            {}, None, id="no operator monitors: none (the controller has no scrape annotations either)"
        ),
        pytest.param(
            {"monitoring": {"podMonitor": {"enabled": True}}, "controller": {"metricsPort": 0}},
            None,
            id="metrics port off: nothing to scrape",
        ),
        pytest.param(
            {"monitoring": {"podMonitor": {"enabled": True}}, "controller": {"enabled": False}},
            None,
            id="no controller",
        ),
    ],
)
def test_controller_pod_monitor(chart: helm.Chart, values: dict[str, Any], monitor: str | None) -> None:
    rendered = render(chart, values)
    pm = rendered.find("PodMonitor", f"{RELEASE}-controller")
    if monitor is None:
        assert pm is None
        return
    assert pm is not None
    settings = {"interval": "15s", "labels": {}, **values["monitoring"][monitor]}
    assert settings["labels"].items() <= pm["metadata"]["labels"].items()
    assert pm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    timeout = {"scrapeTimeout": settings["scrapeTimeout"]} if "scrapeTimeout" in settings else {}
    assert pm["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": settings["interval"], **timeout}
    ]
    # it selects the controller's pods only, and they have the named port
    chosen = [
        d
        for d in rendered.of_kind("Deployment")
        if label_selector_matches(pm["spec"]["selector"], pod_labels(d))
    ]
    assert [d["metadata"]["name"] for d in chosen] == [f"{RELEASE}-controller"]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container(chosen[0])["ports"]
    # and no other monitor scrapes it (the workers' PodMonitor, the ServiceMonitor's Services)
    for other in rendered.of_kind("PodMonitor"):
        if other is not pm:
            assert not label_selector_matches(other["spec"]["selector"], pod_labels(chosen[0]))
