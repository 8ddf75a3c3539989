"""The gateway's side of the chart: the config it receives parses with Mosaic's own loader, the commands
the pods run parse with Mosaic's own CLI, keys reach it through a Secret, and monitoring selects what exists.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from server.config import load_config
from tests.chart.chartkit import (
    CHART_DIR,
    EXAMPLES_DIR,
    NAMESPACE,
    RELEASE,
    Rendered,
    container,
    env_map,
    example_files,
    label_selector_matches,
    load_values,
    parse_mosaic_args,
    pod_labels,
    pod_spec,
    render,
    selects,
)

CASES = [pytest.param(None, id="default values")] + [
    pytest.param(path, id=f"example {path.name}") for path in example_files()
]
CONFIG_DIR = "/etc/mosaic"  # where the pods mount the ConfigMap


def _render(chart: helm.Chart, values_file: Path | None) -> Rendered:
    return render(chart, {} if values_file is None else load_values(values_file))


def _materialise_config(rendered: Rendered, into: Path) -> Path:
    """Write the ConfigMap's files as the pods see them under /etc/mosaic, re-rooted at `into`."""
    data = rendered.get("ConfigMap", f"{RELEASE}-config")["data"]
    for name, text in data.items():
        (into / name).write_text(text.replace(f"{CONFIG_DIR}/", f"{into}/"))
    return into / "config.yaml"


@pytest.mark.parametrize("values_file", CASES)
def test_rendered_config_parses_with_mosaics_loader(
    chart: helm.Chart, values_file: Path | None, tmp_path: Path
) -> None:
    rendered = _render(chart, values_file)
    config = load_config(_materialise_config(rendered, tmp_path))
    values = chart.merge_values({} if values_file is None else load_values(values_file))
    assert [p.name for p in config.pools] == [p["name"] for p in values["pools"]]
    for pool, entry in zip(config.pools, values["pools"], strict=True):
        merged = {**values["poolDefaults"], **entry}
        assert (pool.model, pool.gpu, pool.role, pool.tp) == (
            merged["model"],
            merged["gpu"],
            merged["role"],
            merged["tp"],
        )
        assert (pool.min_replicas, pool.max_replicas) == (merged["minReplicas"], merged["maxReplicas"])
        assert pool.max_num_seqs == merged["maxNumSeqs"] and pool.block_size == merged["blockSize"]
        assert pool.gpu_memory_utilization == merged["gpuMemoryUtilization"]
        assert pool.cost_per_hour == merged.get("costPerHour")
        assert pool.endpoints.kind == "kubernetes"
        assert pool.endpoints.kubernetes is not None and pool.endpoints.kubernetes.in_cluster is True
    gateway = values["gateway"]
    n = gateway["autoscaling"]["maxReplicas"] if gateway["autoscaling"]["enabled"] else gateway["replicas"]
    assert (config.gateway.host, config.gateway.port, config.gateway.replicas) == (
        "0.0.0.0",
        gateway["port"],
        n,
    )
    # the KV share's N counted at run time: the gateway Service's EndpointSlices, whose port is named http
    peers = config.gateway.peers
    assert peers is not None and peers.grow_back_after_s == gateway["peers"]["growBackSeconds"]
    service = rendered.get("Service", f"{RELEASE}-gateway")
    assert [p["name"] for p in service["spec"]["ports"]] == [peers.kubernetes.port] == ["http"]
    assert peers.kubernetes.label_selector == f"kubernetes.io/service-name={service['metadata']['name']}"
    assert (peers.kubernetes.resource, peers.kubernetes.namespace) == ("endpointslices", NAMESPACE)
    assert peers.kubernetes.domain_label is None and peers.kubernetes.in_cluster is True
    off = load_config(
        _materialise_config(
            render(
                chart,
                {
                    **(load_values(values_file) if values_file else {}),
                    "gateway": {"peers": {"enabled": False}},
                },
            ),
            tmp_path,
        )
    )
    assert off.gateway.peers is None


def test_config_sections_pass_through_to_the_gateway(chart: helm.Chart, tmp_path: Path) -> None:
    rendered = render(chart, load_values(EXAMPLES_DIR / "multi-model.yaml"))
    config = load_config(_materialise_config(rendered, tmp_path))
    assert [(m.name, m.spec) for m in config.models] == [
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
        ("Qwen/Qwen2.5-32B-Instruct", "qwen2.5-32b"),
    ]
    assert config.routing.policy == "least-loaded" and config.slo.tpot_ms == 60
    assert config.catalog == str(tmp_path / "catalog.yaml")  # the chart's catalog overrides are used


def test_the_lora_section_passes_through_and_the_schema_refuses_a_misspelt_knob(
    chart: helm.Chart, tmp_path: Path
) -> None:
    rendered = render(chart, {"config": {"lora": {"reconcile": False, "load_timeout_s": 300}}})
    config = load_config(_materialise_config(rendered, tmp_path))
    assert (config.lora.reconcile, config.lora.load_timeout_s, config.lora.retry_max_s) == (False, 300, 600)
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema({"config": {"lora": {"reconcil": False}}})
    assert "reconcil" in str(caught.value)


def test_a_gpu_added_through_the_catalog_parses(chart: helm.Chart, tmp_path: Path) -> None:
    values = {
        "catalog": {
            "gpus": {"B200": {"memory_gb": 192, "hbm_gbps": 8000, "tflops": 2250, "cost_per_hour": 6.5}}
        },
        "pools": [{"name": "b200", "model": "llama-3-70b", "gpu": "B200", "gpuProducts": ["NVIDIA-B200"]}],
    }
    config = load_config(_materialise_config(render(chart, values), tmp_path))
    assert config.pools[0].gpu == "B200"


@pytest.mark.parametrize("values_file", CASES)
def test_the_key_env_vars_the_config_names_are_set_from_the_secret(
    chart: helm.Chart, values_file: Path | None
) -> None:
    rendered = _render(chart, values_file)
    auth = rendered.config()["auth"]
    env = env_map(container(rendered.get("Deployment", f"{RELEASE}-gateway")))
    values = chart.merge_values({} if values_file is None else load_values(values_file))
    secret_name = values["auth"]["existingSecret"] or f"{RELEASE}-api-keys"
    for var, key in ((auth["api_keys_env"], "api-keys"), (auth["admin_keys_env"], "admin-keys")):
        assert env[var]["valueFrom"]["secretKeyRef"]["name"] == secret_name
        assert env[var]["valueFrom"]["secretKeyRef"]["key"] == key
    assert (rendered.find("Secret", f"{RELEASE}-api-keys") is None) == bool(values["auth"]["existingSecret"])


@pytest.mark.parametrize(
    ("auth", "api_keys"),
    [
        pytest.param(
            {"apiKeys": ["k1", "k2"], "adminKeys": ["a1"]}, "k1,k2", id="given keys → stored comma-separated"
        ),
        pytest.param({}, None, id="no keys → one generated key, mk- and 40 characters"),
    ],
)
def test_api_key_secret(chart: helm.Chart, auth: dict[str, Any], api_keys: str | None) -> None:
    secret = render(chart, {"auth": auth}).get("Secret", f"{RELEASE}-api-keys")
    stored = base64.b64decode(secret["data"]["api-keys"]).decode()
    if api_keys is None:
        assert stored.startswith("mk-") and len(stored) == 43 and stored[3:].isalnum()
    else:
        assert stored == api_keys
        assert base64.b64decode(secret["data"]["admin-keys"]).decode() == ",".join(auth["adminKeys"])


def test_auth_disabled_renders_no_secret_and_no_auth_section(chart: helm.Chart) -> None:
    rendered = render(chart, {"auth": {"enabled": False}})
    assert rendered.find("Secret", f"{RELEASE}-api-keys") is None
    assert "auth" not in rendered.config()
    assert "MOSAIC_API_KEYS" not in env_map(container(rendered.get("Deployment", f"{RELEASE}-gateway")))


def test_gateway_mounts_the_config_it_is_told_to_read(chart: helm.Chart) -> None:
    dep = render(chart).get("Deployment", f"{RELEASE}-gateway")
    c = container(dep)
    args = [str(a) for a in c["args"]]
    assert c["command"] == ["mosaic"] and args[:3] == ["serve", "--config", f"{CONFIG_DIR}/config.yaml"]
    assert {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod_spec(dep)["securityContext"]["runAsNonRoot"] is True


# ---- the commands the pods run, parsed by Mosaic's own CLI (click parses; nothing runs) ----


def _mosaic_commands(rendered: Rendered, name: str) -> list[list[str]]:
    commands = []
    for dep in rendered.of_kind("Deployment"):
        c = container(dep)
        args = [str(a) for a in c.get("args") or []]
        if c.get("command") == ["mosaic"] and args and args[0] == name:
            commands.append(args)
    assert commands, f"no Deployment runs `mosaic {name}`"
    return commands


@pytest.mark.parametrize("example", ["simulated-fleet.yaml", "multi-model.yaml", "heterogeneous-pd.yaml"])
def test_simulated_workers_command_parses_with_the_mosaic_cli(chart: helm.Chart, example: str) -> None:
    values = load_values(EXAMPLES_DIR / example)
    values["simulated"] = True
    for args in _mosaic_commands(render(chart, values), "worker"):
        parse_mosaic_args(args)


def test_gateway_command_parses_with_the_mosaic_cli(chart: helm.Chart) -> None:
    for args in _mosaic_commands(render(chart), "serve"):
        parse_mosaic_args(args)


def test_controller_command_parses_with_the_mosaic_cli(chart: helm.Chart) -> None:
    for args in _mosaic_commands(render(chart), "autoscale"):
        parse_mosaic_args(args)


# ---- monitoring ----


def test_scrape_annotations_when_no_prometheus_operator(chart: helm.Chart) -> None:
    rendered = render(chart)
    for dep in rendered.of_kind("Deployment"):
        notes = dep["spec"]["template"]["metadata"]["annotations"]
        # the controller's own /metrics is on its `metrics` port (controller.metricsPort), the others' on `http`
        name = "metrics" if dep["metadata"]["name"].endswith("-controller") else "http"
        port = {p["containerPort"] for p in container(dep)["ports"] if p["name"] == name}
        assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
        assert {int(notes["prometheus.io/port"])} == port


def test_service_and_pod_monitors_select_what_exists(chart: helm.Chart) -> None:
    rendered = render(chart, load_values(EXAMPLES_DIR / "multi-model.yaml"))
    (sm,) = rendered.of_kind("ServiceMonitor")
    pm = rendered.get(
        "PodMonitor", f"{RELEASE}-workers"
    )  # the controller has its own (test_chart_domains.py)
    expression = sm["spec"]["selector"]["matchExpressions"][0]
    # The PodMonitor scrapes the workers, so the ServiceMonitor covers only the gateway: no double scrape.
    assert expression == {"key": "app.kubernetes.io/component", "operator": "In", "values": ["gateway"]}
    services = [
        s
        for s in rendered.of_kind("Service")
        if selects(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    selected = [
        s["metadata"]["name"]
        for s in services
        if s["metadata"]["labels"][expression["key"]] in expression["values"]
    ]
    assert selected == [f"{RELEASE}-gateway"]
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in services[0]["spec"]["ports"]}
    workers = [
        d
        for d in rendered.of_kind("Deployment")
        if label_selector_matches(pm["spec"]["selector"], pod_labels(d))
    ]
    assert {d["metadata"]["name"] for d in workers} == {
        d["metadata"]["name"] for d in rendered.pool_deployments()
    }
    for d in workers:
        assert pm["spec"]["podMetricsEndpoints"][0]["port"] in {p["name"] for p in container(d)["ports"]}
    # The gateway and controller pods (cheap to restart) drop their annotations under an operator monitor; the
    # workers keep theirs whatever the toggles (a pod-template change would restart every GPU pod).
    for name in (f"{RELEASE}-gateway", f"{RELEASE}-controller"):
        notes = rendered.get("Deployment", name)["spec"]["template"]["metadata"]["annotations"]
        assert "prometheus.io/scrape" not in notes


def _scraped_by(rendered: Rendered) -> dict[str, list[str]]:
    """Each Deployment's pods → the operator monitors that scrape them: a PodMonitor by the pods' labels, the
    ServiceMonitor through the Services it selects (by their labels) and the pods behind them."""
    by: dict[str, list[str]] = {d["metadata"]["name"]: [] for d in rendered.of_kind("Deployment")}
    for pm in rendered.of_kind("PodMonitor"):
        for d in rendered.of_kind("Deployment"):
            if label_selector_matches(pm["spec"]["selector"], pod_labels(d)):
                by[d["metadata"]["name"]].append(f"PodMonitor/{pm['metadata']['name']}")
    for sm in rendered.of_kind("ServiceMonitor"):
        ports = {e["port"] for e in sm["spec"]["endpoints"]}
        for svc in rendered.of_kind("Service"):
            if not label_selector_matches(sm["spec"]["selector"], svc["metadata"]["labels"]):
                continue
            assert ports <= {p["name"] for p in svc["spec"]["ports"]}, svc["metadata"]["name"]
            for d in rendered.of_kind("Deployment"):
                if selects(svc["spec"]["selector"], pod_labels(d)):
                    by[d["metadata"]["name"]].append(f"ServiceMonitor/{sm['metadata']['name']}")
    return by


@pytest.mark.parametrize(
    "monitors",
    [
        pytest.param({"serviceMonitor": {"enabled": True}}, id="ServiceMonitor"),
        pytest.param({"podMonitor": {"enabled": True}}, id="PodMonitor"),
        pytest.param({"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}, id="both"),
    ],
)
def test_every_pod_is_scraped_by_exactly_one_monitor(chart: helm.Chart, monitors: dict[str, Any]) -> None:
    """Before: with the PodMonitor alone (examples/topology-domains.yaml) the gateway lost its scrape
    annotations and no monitor selected it, so its mosaic_* metrics (the dashboard's top rows, its model and
    pool variables) were never collected while NOTES said they were."""
    rendered = render(chart, {**load_values(EXAMPLES_DIR / "multi-model.yaml"), "monitoring": monitors})
    by = _scraped_by(rendered)
    assert set(by) >= {f"{RELEASE}-gateway", f"{RELEASE}-controller"} and len(by) > 2
    assert {name: found for name, found in by.items() if len(found) != 1} == {}


def test_service_monitor_alone_also_covers_the_workers(chart: helm.Chart) -> None:
    (sm,) = render(chart, load_values(EXAMPLES_DIR / "heterogeneous-pd.yaml")).of_kind("ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchExpressions"][0]["values"] == ["gateway", "worker"]


def test_httproute_sends_traffic_to_the_gateway_service(chart: helm.Chart) -> None:
    rendered = render(chart, load_values(EXAMPLES_DIR / "multi-model.yaml"))
    (route,) = rendered.of_kind("HTTPRoute")
    svc = rendered.get("Service", f"{RELEASE}-gateway")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["name"], backend["port"]) == (svc["metadata"]["name"], svc["spec"]["ports"][0]["port"])
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"


def test_grafana_dashboard_configmap_carries_the_dashboard(chart: helm.Chart) -> None:
    rendered = render(chart, {"monitoring": {"grafanaDashboard": {"enabled": True}}})
    cm = rendered.get("ConfigMap", f"{RELEASE}-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted((CHART_DIR / "dashboards").glob("*.json"))
    assert files and sorted(cm["data"]) == [f.name for f in files]
    for f in files:
        assert json.loads(cm["data"][f.name]) == json.loads(f.read_text())
