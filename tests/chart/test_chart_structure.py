"""What the rendered objects must say to work together: selectors select the pods they are meant to, RBAC is
namespaced and minimal, every pool becomes a Deployment + Service with the discovery labels, GPU placement,
tensor parallelism and P/D KV-transfer arguments its values ask for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.chart.chartkit import (
    EXAMPLES_DIR,
    NAMESPACE,
    RELEASE,
    Rendered,
    container,
    container_args,
    env_map,
    example_files,
    load_values,
    parse_mosaic_args,
    parse_selector,
    pod_labels,
    pod_spec,
    render,
    selects,
    validated_deployment,
)

CASES = [pytest.param(None, id="default values")] + [
    pytest.param(path, id=f"example {path.name}") for path in example_files()
]


def _render(chart: helm.Chart, values_file: Path | None, **overrides: Any) -> Rendered:
    values = {} if values_file is None else load_values(values_file)
    values.update(overrides)
    return render(chart, values)


def _args(c: dict[str, Any]) -> list[str]:
    return [str(a) for a in c.get("args") or []]


def _flag(args: list[str], name: str) -> str | None:
    """The value after `name` in an argument list (None when the flag is absent)."""
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("values_file", CASES)
def test_every_deployment_selector_matches_its_pod_template(
    chart: helm.Chart, values_file: Path | None
) -> None:
    for dep in _render(chart, values_file).of_kind("Deployment"):
        assert selects(dep["spec"]["selector"]["matchLabels"], pod_labels(dep)), dep["metadata"]["name"]


@pytest.mark.parametrize("values_file", CASES)
def test_every_service_selects_exactly_its_deployments_on_a_named_port(
    chart: helm.Chart, values_file: Path | None
) -> None:
    rendered = _render(chart, values_file)
    deployments = rendered.of_kind("Deployment")
    for svc in rendered.of_kind("Service"):
        matched = [d for d in deployments if selects(svc["spec"]["selector"], pod_labels(d))]
        # its namesake; a pool with domains: each domain's Deployment, all behind the pool's one Service
        pool = svc["metadata"]["labels"].get("mosaic.dev/pool")
        expected = (
            [svc["metadata"]["name"]]
            if pool is None
            else [d["metadata"]["name"] for d in rendered.deployments_of_pool(pool)]
        )
        assert [d["metadata"]["name"] for d in matched] == expected, svc["metadata"]["name"]
        port_names = {p["name"] for c in pod_spec(matched[0])["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names


@pytest.mark.parametrize("values_file", CASES)
def test_pdbs_and_hpa_target_their_own_deployments(chart: helm.Chart, values_file: Path | None) -> None:
    rendered = _render(chart, values_file)
    gateway = rendered.get("Deployment", f"{RELEASE}-gateway")
    deployments = rendered.of_kind("Deployment")
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        # the gateway's budget covers the gateway, a pool's covers that pool's Deployments, nothing else
        pool = pdb["metadata"]["labels"].get("mosaic.dev/pool")
        expected = [gateway] if pool is None else rendered.deployments_of_pool(pool)
        matched = [d for d in deployments if selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(d))]
        assert [d["metadata"]["name"] for d in matched] == [d["metadata"]["name"] for d in expected]
    hpas = rendered.of_kind("HorizontalPodAutoscaler")
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": f"{RELEASE}-gateway",
        }
    # With an HPA, the Deployment must not pin replicas (each `helm upgrade` would undo the HPA).
    assert ("replicas" in gateway["spec"]) == (not hpas)


CONTROLLER_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]},
]


@pytest.mark.parametrize("values_file", CASES)
def test_rbac_is_namespaced_and_minimal(chart: helm.Chart, values_file: Path | None) -> None:
    rendered = _render(chart, values_file)
    kinds = {o["kind"] for o in rendered.objects}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, "no cluster-wide RBAC"
    pool_names = [d["metadata"]["name"] for d in rendered.pool_deployments()]  # values order

    controller = rendered.get("Role", f"{RELEASE}-controller")
    scale_rule = {
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "resourceNames": pool_names,
        "verbs": ["get", "patch"],
    }
    assert controller["rules"] == [*CONTROLLER_RULES, scale_rule]
    # The gateway only lists what its discovery reads (EndpointSlices by default): `list pods` would show
    # it every pod spec of the namespace, literal env values included.
    assert rendered.get("Role", f"{RELEASE}-gateway")["rules"] == CONTROLLER_RULES[1:]
    # With pod discovery it lists pods, and EndpointSlices only to count its own replicas (gateway.peers)
    pods = _render(chart, values_file, gateway={"discovery": {"resource": "pods"}})
    assert pods.get("Role", f"{RELEASE}-gateway")["rules"] == CONTROLLER_RULES
    alone = _render(
        chart, values_file, gateway={"discovery": {"resource": "pods"}, "peers": {"enabled": False}}
    )
    assert alone.get("Role", f"{RELEASE}-gateway")["rules"] == CONTROLLER_RULES[:1]

    for binding in rendered.of_kind("RoleBinding"):
        role = rendered.get("Role", binding["roleRef"]["name"])
        assert binding["roleRef"]["kind"] == "Role" and role["metadata"]["namespace"] == NAMESPACE
        for subject in binding["subjects"]:
            assert subject["namespace"] == NAMESPACE
            rendered.get("ServiceAccount", subject["name"])
    uses = {pod_spec(d).get("serviceAccountName") for d in rendered.of_kind("Deployment")}
    assert {f"{RELEASE}-gateway", f"{RELEASE}-controller"} <= uses
    for dep in rendered.pool_deployments():  # workers never talk to the API
        assert pod_spec(dep)["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod_spec(dep)


def test_controller_can_be_turned_off(chart: helm.Chart) -> None:
    rendered = render(chart, {"controller": {"enabled": False}})
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects}
    assert not {n for n in names if n[1].endswith("-controller")}
    assert ("Deployment", f"{RELEASE}-gateway") in names


def test_controller_runs_the_autoscaler_once_on_the_shared_config(chart: helm.Chart) -> None:
    rendered = render(chart)
    dep = rendered.get("Deployment", f"{RELEASE}-controller")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    c = container(dep)
    assert c["command"] == ["mosaic"] and _args(c)[:3] == ["autoscale", "--config", "/etc/mosaic/config.yaml"]
    assert {"name": "config", "configMap": {"name": f"{RELEASE}-config"}} in pod_spec(dep)["volumes"]


@pytest.mark.parametrize("values_file", CASES)
def test_pools_carry_the_labels_the_gateway_discovers_them_by(
    chart: helm.Chart, values_file: Path | None
) -> None:
    rendered = _render(chart, values_file)
    config_pools = rendered.config()["pools"]
    assert sum(len(rendered.deployments_of_pool(p["name"])) for p in config_pools) == len(
        rendered.pool_deployments()
    )
    for pool in config_pools:
        k8s = pool["endpoints"]["kubernetes"]
        assert k8s["namespace"] == NAMESPACE and k8s["resource"] == "endpointslices"
        # EndpointSlices carry kubernetes.io/service-name: the pool's Service, which selects the pool's pods.
        service_name = parse_selector(k8s["label_selector"])["kubernetes.io/service-name"]
        svc = rendered.get("Service", service_name)
        deps = rendered.deployments_of_pool(pool["name"])
        assert deps and (len(deps) > 1 or deps[0]["metadata"]["name"] == service_name)
        for dep in deps:
            labels = pod_labels(dep)
            assert selects(svc["spec"]["selector"], labels)
            assert labels["mosaic.dev/pool"] == pool["name"]
            assert labels["mosaic.dev/role"] == pool["role"]
            assert labels["mosaic.dev/gpu"] == pool["gpu"]
            assert k8s["port"] in {p["port"] for p in svc["spec"]["ports"]}
            assert k8s["port"] in {p["containerPort"] for p in container(dep)["ports"]}


def test_discovery_by_pods_selects_exactly_each_pools_pods(chart: helm.Chart) -> None:
    values = load_values(EXAMPLES_DIR / "simulated-fleet.yaml")
    values["gateway"] = {**values["gateway"], "discovery": {"resource": "pods", "resyncSeconds": 5}}
    rendered = render(chart, values)
    deployments = rendered.pool_deployments()
    for pool in rendered.config()["pools"]:
        k8s = pool["endpoints"]["kubernetes"]
        assert k8s["resource"] == "pods" and k8s["resync_s"] == 5
        selector = parse_selector(k8s["label_selector"])
        matched = [d["metadata"]["name"] for d in deployments if selects(selector, pod_labels(d))]
        assert matched == [f"{RELEASE}-{pool['name']}"]


@pytest.mark.parametrize("values_file", CASES)
def test_autoscaler_bounds_agree_between_annotations_and_config(
    chart: helm.Chart, values_file: Path | None
) -> None:
    rendered = _render(chart, values_file)
    for pool in rendered.config()["pools"]:
        deps = rendered.deployments_of_pool(pool["name"])  # the pool's bounds hold for its total
        for dep in deps:
            notes = dep["metadata"]["annotations"]
            assert int(notes["mosaic.dev/min-replicas"]) == pool["min_replicas"]
            assert int(notes["mosaic.dev/max-replicas"]) == pool["max_replicas"]
        assert pool["min_replicas"] <= sum(d["spec"]["replicas"] for d in deps) <= pool["max_replicas"]


# heterogeneous-pd.yaml / multi-model.yaml, pool by pool: (pool, tp, kv_role or None, max-model-len, products)
REAL_POOLS = [
    pytest.param(
        "heterogeneous-pd.yaml",
        "h100-prefill",
        1,
        "kv_producer",
        "8192",
        ["NVIDIA-H100-80GB-HBM3"],
        id="H100 prefill pool gets the NIXL kv-transfer config, 1 GPU",
    ),
    pytest.param(
        "heterogeneous-pd.yaml",
        "a100-decode",
        1,
        "kv_consumer",
        "8192",
        ["NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"],
        id="A100 decode pool gets the NIXL kv-transfer config",
    ),
    pytest.param(
        "heterogeneous-pd.yaml",
        "l4-mixed",
        1,
        None,
        "4096",
        ["NVIDIA-L4"],
        id="L4 mixed pool has no kv-transfer config and its own max-model-len",
    ),
    pytest.param(
        "multi-model.yaml",
        "qwen-h100",
        2,
        None,
        "16384",
        ["NVIDIA-H100-80GB-HBM3"],
        id="TP 2 pool asks for 2 GPUs and --tensor-parallel-size 2",
    ),
]


@pytest.mark.parametrize(("example", "pool", "tp", "kv_role", "max_len", "products"), REAL_POOLS)
def test_real_pool_runs_vllm_as_configured(
    chart: helm.Chart,
    example: str,
    pool: str,
    tp: int,
    kv_role: str | None,
    max_len: str,
    products: list[str],
) -> None:
    values = load_values(EXAMPLES_DIR / example)
    rendered = render(chart, values)
    dep = rendered.get("Deployment", f"{RELEASE}-{pool}")
    spec = pod_spec(dep)
    c = container(dep)
    args = _args(c)
    entry = next(p for p in values["pools"] if p["name"] == pool)
    assert c["command"] == ["vllm", "serve"] and args[0] == entry["model"]
    assert _flag(args, "--served-model-name") == entry["model"]
    assert _flag(args, "--tensor-parallel-size") == str(tp)
    assert _flag(args, "--max-model-len") == max_len
    assert _flag(args, "--port") == "8000" and _flag(args, "--host") == "0.0.0.0"
    assert "--enable-prefix-caching" in args
    # vLLM drains on SIGTERM only with --shutdown-timeout: the grace period less the preStop sleep and 5 s
    grace, drain = spec["terminationGracePeriodSeconds"], entry.get("drainSeconds", 15)
    assert _flag(args, "--shutdown-timeout") == str(grace - drain - 5)
    assert (
        c["resources"]["limits"]["nvidia.com/gpu"] == tp
        and c["resources"]["requests"]["nvidia.com/gpu"] == tp
    )
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": products}]}
    ]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]

    env = env_map(c)
    if kv_role is None:
        assert "--kv-transfer-config" not in args and "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env
    else:
        assert json.loads(_flag(args, "--kv-transfer-config") or "") == {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
        }
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert {"name": "nixl", "containerPort": 5600, "protocol": "TCP"} in c["ports"]
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert env["HF_HOME"]["value"] == "/models/hf"

    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"model-cache": "/models", "dshm": "/dev/shm"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert c[probe]["timeoutSeconds"] == 5  # not Kubernetes' 1 s: /health shares vLLM's API event loop
    # a Service named `vllm` in the namespace would inject VLLM_PORT=tcp://…, which vLLM refuses to start with
    assert spec["enableServiceLinks"] is False
    # no chart or app version on the pod template: an upgrade that leaves vLLM alone restarts no GPU pod
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels
    assert "helm.sh/chart" in dep["metadata"]["labels"]
    # 10 s × 180 = 30 min for weights to download and load before liveness can kill the pod.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 1800
    # A replacement needs free GPUs: never surge.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        pytest.param(
            {}, {"emptyDir": {"sizeLimit": "100Gi"}}, id="no claim or host path → emptyDir of sizeLimit"
        ),
        pytest.param(
            {"existingClaim": "weights"},
            {"persistentVolumeClaim": {"claimName": "weights"}},
            id="existing PVC",
        ),
        pytest.param(
            {"hostPath": "/mnt/models"},
            {"hostPath": {"path": "/mnt/models", "type": "DirectoryOrCreate"}},
            id="host path",
        ),
    ],
)
def test_model_cache_volume(chart: helm.Chart, cache: dict[str, str], expected: dict[str, Any]) -> None:
    rendered = render(chart, {"vllm": {"modelCache": cache}})
    volumes = {v["name"]: v for v in pod_spec(rendered.pool_deployments()[0])["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", **expected}


def test_hf_token_value_is_stored_in_a_secret_the_pods_read(chart: helm.Chart) -> None:
    rendered = render(chart, {"vllm": {"hfToken": {"value": "hf_abc"}}})
    secret = rendered.get("Secret", f"{RELEASE}-hf-token")
    assert secret["data"] == {"token": "aGZfYWJj"}  # base64("hf_abc")
    env = env_map(container(rendered.pool_deployments()[0]))
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-hf-token", "key": "token"}
    assert "HF_TOKEN" not in env_map(container(render(chart).pool_deployments()[0])), "no token → no env var"


def test_simulated_pools_run_mosaic_worker_without_gpus(chart: helm.Chart) -> None:
    values = load_values(EXAMPLES_DIR / "simulated-fleet.yaml")
    rendered = render(chart, values)
    for entry, dep in zip(values["pools"], rendered.pool_deployments(), strict=True):
        spec = pod_spec(dep)
        c = container(dep)
        args = _args(c)
        assert c["command"] == ["mosaic"] and args[0] == "worker"
        assert _flag(args, "--gpu") == entry["gpu"] and _flag(args, "--model") == entry["model"]
        assert _flag(args, "--role") == entry["role"] and _flag(args, "--port") == "8000"
        assert _flag(args, "--host") == "0.0.0.0"
        # Clients (and the gateway) ask for the pool's model name; the worker must serve that name.
        assert _flag(args, "--served-model-name") == entry["model"]
        # The same engine knobs the gateway sizes capacity with (poolDefaults: 256 seqs, 16-token blocks, 0.9).
        assert (
            _flag(args, "--max-num-seqs"),
            _flag(args, "--block-size"),
            _flag(args, "--gpu-memory-utilization"),
        ) == ("256", "16", "0.9")
        assert env_map(c)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert not any("gpu" in k for k in c["resources"].get("limits", {})), "simulated workers need no GPU"
        assert "affinity" not in spec
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert pod_labels(dep)["mosaic.dev/simulated"] == "true"
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_one_pool_can_be_simulated_among_real_ones(chart: helm.Chart) -> None:
    values = load_values(EXAMPLES_DIR / "heterogeneous-pd.yaml")
    values["pools"][2] = {**values["pools"][2], "simulated": True}
    rendered = render(chart, values)
    commands = {d["metadata"]["name"]: container(d)["command"] for d in rendered.pool_deployments()}
    assert commands == {
        f"{RELEASE}-h100-prefill": ["vllm", "serve"],
        f"{RELEASE}-a100-decode": ["vllm", "serve"],
        f"{RELEASE}-l4-mixed": ["mosaic"],
    }


def test_simulated_worker_is_timed_by_the_catalog_row_the_config_names(chart: helm.Chart) -> None:
    """multi-model.yaml serves Qwen/Qwen2.5-32B-Instruct, a name the catalog does not know; config.models
    maps it to the catalog row qwen2.5-32b, and its catalog overrides are mounted for the worker."""
    values = load_values(EXAMPLES_DIR / "multi-model.yaml")
    values["simulated"] = True
    rendered = render(chart, values)
    dep = rendered.get("Deployment", f"{RELEASE}-qwen-h100")
    c = container(dep)
    args = _args(c)
    assert (_flag(args, "--model"), _flag(args, "--served-model-name")) == (
        "qwen2.5-32b",
        "Qwen/Qwen2.5-32B-Instruct",
    )
    assert (_flag(args, "--tp"), _flag(args, "--max-model-len")) == ("2", "16384")
    assert _flag(args, "--catalog") == "/etc/mosaic/catalog.yaml"
    assert {"name": "config", "mountPath": "/etc/mosaic", "readOnly": True} in c["volumeMounts"]
    assert {"name": "config", "configMap": {"name": f"{RELEASE}-config"}} in pod_spec(dep)["volumes"]


_SIM_POOL = {"name": "sim", "model": "llama-3-8b", "gpu": "L4"}


@pytest.mark.parametrize(
    ("values", "pool", "simulated"),
    [
        pytest.param({"poolDefaults": {"simulated": True}}, {}, True, id="poolDefaults' simulated"),
        pytest.param({"simulated": True, "poolDefaults": {"simulated": False}}, {}, False,
                     id="poolDefaults' over the chart-wide switch"),
        pytest.param({"poolDefaults": {"simulated": True}}, {"simulated": False}, False, id="the pool's own"),
    ],
)  # fmt: skip
def test_pool_defaults_simulated_reaches_every_pool(
    chart: helm.Chart, values: dict[str, Any], pool: dict[str, Any], simulated: bool
) -> None:
    """poolDefaults are merged under every pool, `simulated` included (it was read only from the pool and the
    chart-wide switch, so poolDefaults' true rendered real vLLM pods asking for GPUs)."""
    dep = validated_deployment(render(chart, {**values, "pools": [{**_SIM_POOL, **pool}]}), "sim")
    assert dep["metadata"]["labels"]["mosaic.dev/simulated"] == str(simulated).lower()
    assert container(dep)["command"] == (["mosaic"] if simulated else ["vllm", "serve"])


@pytest.mark.parametrize("on", [True, False])
def test_a_simulated_pool_caches_prefixes_as_its_vllm_would(chart: helm.Chart, on: bool) -> None:
    """`enablePrefixCaching` (default true, vLLM's default) reaches `mosaic worker` too, whose own default is off."""
    pool = {**_SIM_POOL, "simulated": True, "enablePrefixCaching": on}
    dep = validated_deployment(render(chart, {"pools": [pool]}), "sim")
    assert parse_mosaic_args(container_args(dep))["enable_prefix_caching"] is on


NODE_READER_CASES = [
    # (discovery values, reads nodes) — module docstring of server/discovery.py: EndpointSlice endpoints
    # carry the zone label themselves; pods carry only spec.nodeName; any other label lives on the node.
    pytest.param({}, False, id="endpointslices with the zone label need no node access"),
    pytest.param({"resource": "pods"}, True, id="pods by selector read their nodes' labels"),
    pytest.param({"domainLabel": "example.com/rack"}, True, id="a rack label is read off the nodes"),
    pytest.param({"resource": "pods", "domainLabel": None}, False, id="domains turned off read no nodes"),
]


@pytest.mark.parametrize(("discovery", "reads_nodes"), NODE_READER_CASES)
def test_node_access_is_granted_only_when_discovery_reads_nodes(
    chart: helm.Chart, discovery: dict[str, Any], reads_nodes: bool
) -> None:
    rendered = render(chart, {"gateway": {"discovery": discovery}})
    name = f"{RELEASE}-{NAMESPACE}-nodes"  # cluster-scoped: the namespace keeps releases apart
    cluster_roles = rendered.of_kind("ClusterRole")
    if not reads_nodes:
        assert cluster_roles == [] and rendered.of_kind("ClusterRoleBinding") == []
        return
    [role] = cluster_roles
    assert role["metadata"]["name"] == name
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}]
    [binding] = rendered.of_kind("ClusterRoleBinding")
    for obj in (role, binding):
        assert "namespace" not in obj["metadata"]
        kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": name,
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{RELEASE}-gateway", "namespace": NAMESPACE},
        {"kind": "ServiceAccount", "name": f"{RELEASE}-controller", "namespace": NAMESPACE},
    ]


def test_gateway_config_carries_the_domain_label(chart: helm.Chart) -> None:
    for label in ("topology.kubernetes.io/zone", "example.com/rack", None):
        config = render(chart, {"gateway": {"discovery": {"domainLabel": label}}}).config()
        sources = [pool["endpoints"]["kubernetes"] for pool in config["pools"]]
        assert sources and all(s["domain_label"] == label for s in sources)
