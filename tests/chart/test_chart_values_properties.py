"""Property test over the chart's VALUES: for random values, `helm template` either refuses them (the schema, or
one of the chart's own `fail` messages), or renders objects that Kubernetes accepts (kubernetes-validate,
strict; DNS names; selectors that select; named ports that exist; RBAC for what the controller patches) and a
config that `mosaic serve` and `mosaic autoscale` accept at start (no CrashLoopBackOff). The strategy also draws
values those refuse (a KV lease under a request timeout, a backlog lead without a cold start, policy knobs and
parameters out of range, unknown policies, a model listed twice, a node inventory off the pools' domains), which
the chart must refuse. Renders are deterministic (byte for byte, but for the API key the chart generates when
none is given).

Derandomized and short by default (about 60 examples); MOSAIC_CHART_PROPERTY_EXAMPLES=2000 for a longer hunt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from scheduler.autoscaler.policy import AutoscalerConfig as PolicyConfig
from server.config import ConfigError, load_config
from tests.chart.chartkit import CRD_KINDS, LABEL_VALUE, NAMESPACE, RELEASE, Rendered, parse_selector

EXAMPLES = int(os.environ.get("MOSAIC_CHART_PROPERTY_EXAMPLES", "60"))
KUBE_VERSION = kubernetes_validate.utils.latest_version()

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# A Go template error (not a `fail`): the template, not the values, is wrong.
TEMPLATE_BUG = re.compile(
    r"nil pointer|wrong type|can't evaluate|error calling|invalid value|incompatible types|"
    r"YAML parse error|error converting YAML|cannot unmarshal|not defined|unable to parse"
)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a mapping key given twice, as Helm's install does (sigs.k8s.io/yaml: `key … already set
    in map`); PyYAML would keep the last one silently."""


def _no_duplicates(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    twice = {k for k in keys if keys.count(k) > 1}
    assert not twice, f"mapping key(s) {sorted(map(str, twice))} given twice at {node.start_mark}"
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)

# --- strategies -------------------------------------------------------------------------------------------

# Not T4: an 8B model does not fit it, which the gateway's sizing refuses (rightly) when an autoscaler runs.
GPUS = ["L4", "A100-80GB", "H100-SXM", "H200", "MI300X", "h100", "A100", "B200"]
WITH_PRODUCTS = {"L4", "A100-80GB", "H100-SXM", "H200"}  # vllm.gpuProducts has them
MODELS = ["llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "qwen2.5-7b", "Mistral-7B"]
POOL_NAMES = ["a", "p1", "decode-a100", "prefill-h100", "123", "x" * 30, "mixed-l4"]
DOMAINS = ["rack-1", "Rack_2", "zone.a", "us-east-1a"]
# Policy knobs, and values in and out of each knob's range (the schema refuses what the policy would)
KNOBS = [f.name for f in dataclasses.fields(PolicyConfig)]
KNOB_VALUES = [0.5, 1, 1, 1.5, 4, -1, 0]

ints = st.integers
small = st.integers(min_value=0, max_value=6)
quantity = st.sampled_from(["1", "500m", "2Gi", "100Gi", "1.5", "4"])
probe = st.fixed_dictionaries(
    {"periodSeconds": ints(1, 30), "failureThreshold": ints(1, 200)},
    optional={"timeoutSeconds": ints(1, 10)},
)


@st.composite
def pool(draw: st.DrawFn, name: str) -> dict[str, Any]:
    p: dict[str, Any] = {
        "name": name,
        "model": draw(st.sampled_from(MODELS)),
        "gpu": draw(st.sampled_from(GPUS)),
    }
    if p["gpu"] not in WITH_PRODUCTS and draw(st.booleans()):
        p["gpuProducts"] = [f"NVIDIA-{p['gpu']}"]
    lo = draw(small)
    hi = draw(ints(lo, lo + 6))
    p.update(minReplicas=lo, maxReplicas=hi, replicas=draw(ints(lo, hi)))
    opt = {
        "role": st.sampled_from(["prefill", "decode", "mixed"]),
        "tp": st.sampled_from([1, 2, 4, 8]),
        "dp": st.sampled_from([1, 2, 3]),
        "simulated": st.booleans(),
        "maxModelLen": st.one_of(st.none(), ints(1, 32768)),
        "gpuMemoryUtilization": st.sampled_from([0.8, 0.9, 1]),
        "maxNumSeqs": ints(1, 512),
        "blockSize": st.sampled_from([8, 16, 32, 64, 128]),
        "enablePrefixCaching": st.booleans(),
        "costPerHour": st.one_of(st.none(), st.sampled_from([0, 1.5, 4])),
        "domains": st.lists(st.sampled_from(DOMAINS), min_size=1, max_size=3, unique=True),
        "apiKey": st.fixed_dictionaries(
            {"existingSecret": st.sampled_from(["", "vllm-keys"]), "key": st.just("k")}
        ),
        "pdb": st.fixed_dictionaries(
            {"enabled": st.booleans(), "maxUnavailable": st.sampled_from([1, 2, "50%"])}
        ),
        "strategy": st.sampled_from(
            [
                {"type": "Recreate"},
                {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                {"type": "RollingUpdate"},
            ]
        ),
        "drainSeconds": ints(11, 40),
        "terminationGracePeriodSeconds": ints(41, 200),
        "progressDeadlineSeconds": st.one_of(st.none(), ints(1, 3000)),
        "image": st.sampled_from([{}, {"tag": "v0.33.0"}, {"repository": "rocm/vllm", "tag": "latest"}]),
        # -dp=2: the data parallel size again, which the render refuses (the chart writes it from dp); so is
        # --max-loras=2 with `lora` on, and with it off passes through
        "extraArgs": st.lists(
            st.sampled_from(["--enforce-eager", "--seed=1", "-dp=2", "--max-loras=2"]), max_size=2
        ),
        # LoRA adapters; refused: an adapter named as a pool's model, settings without adapters, run-time
        # updating with dp > 1
        "lora": st.sampled_from(
            [
                {},
                {"modules": [{"name": "sql", "path": "/adapters/sql"}], "maxLoras": 2, "maxLoraRank": 64},
                {"modules": [{"name": "chat", "path": "org/chat-lora"}], "runtimeUpdating": True},
                {"runtimeUpdating": True},
                {"modules": [{"name": "llama-3-8b", "path": "/adapters/x"}]},
                {"maxLoras": 4},
            ]
        ),
        "nodeSelector": st.sampled_from([{}, {"pool": "gpu"}]),
        "podLabels": st.sampled_from([{}, {"team": "ml"}]),
        "resources": st.sampled_from([{}, {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi"}}]),
    }
    for key, strategy in opt.items():
        if draw(st.booleans()):
            p[key] = draw(strategy)
    return p


@st.composite
def values(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(POOL_NAMES), min_size=1, max_size=3, unique=True))
    v: dict[str, Any] = {"pools": [draw(pool(n)) for n in names]}
    gw: dict[str, Any] = {}
    if draw(st.booleans()):
        gw["replicas"] = draw(ints(0, 5))
    if draw(st.booleans()):
        gw["port"] = draw(st.sampled_from([8080, 9000, 8000]))
    if draw(st.booleans()):
        gw["service"] = {"type": draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"])), "port": 80}
    if draw(st.booleans()):
        gw["ingress"] = {"enabled": True, "className": "nginx"}
    if draw(st.booleans()):
        gw["httpRoute"] = {"enabled": True, "hostnames": ["llm.example.com"]}
    if draw(st.booleans()):
        lo = draw(ints(1, 4))
        gw["autoscaling"] = {"enabled": True, "minReplicas": lo, "maxReplicas": draw(ints(lo, 10))}
    if draw(st.booleans()):
        gw["pdb"] = {"enabled": draw(st.booleans()), "maxUnavailable": draw(st.sampled_from([1, "25%"]))}
    if draw(st.booleans()):
        gw["probes"] = {"startup": draw(probe), "readiness": draw(probe), "liveness": draw(probe)}
    if draw(st.booleans()):
        gw["drainSeconds"] = draw(ints(0, 20))
    if draw(st.booleans()):
        gw["discovery"] = {
            "resource": draw(st.sampled_from(["endpointslices", "pods"])),
            "resyncSeconds": draw(st.sampled_from([1, 5, 10])),
            "domainLabel": draw(st.sampled_from([None, "topology.kubernetes.io/zone", "example.com/rack"])),
        }
    if draw(st.booleans()):
        gw["peers"] = {
            "enabled": draw(st.booleans()),
            "resyncSeconds": 5,
            "growBackSeconds": draw(ints(0, 120)),
        }
    if gw:
        v["gateway"] = gw
    if draw(st.booleans()):
        v["controller"] = {
            "enabled": draw(st.booleans()),
            "metricsPort": draw(st.sampled_from([0, 9090, 8080])),
            "gatewayMetrics": {"enabled": draw(st.booleans())},
        }
    cfg: dict[str, Any] = {}
    if draw(st.booleans()):
        cfg["routing"] = {"policy": draw(st.sampled_from(["round-robin", "least-loaded", "mosaic"]))}
    if draw(st.booleans()):
        cfg["kv"] = {"enabled": draw(st.booleans())}
        if draw(st.booleans()):
            cfg["kv"]["share"] = draw(st.sampled_from([None, 0.5, 1]))
        if draw(st.booleans()):  # at or below the longest request timeout (default 600 s) is refused
            cfg["kv"]["lease_s"] = draw(st.sampled_from([30, 600, 600.5, 900, 1800]))
    if draw(st.booleans()):
        # Some of each kind the gateway or the controller refuses at start: the chart must refuse them too.
        static = f"static:{draw(st.sampled_from([*names, 'nope']))}={draw(ints(0, 8))}"
        cfg["autoscaler"] = {
            "enabled": draw(st.booleans()),
            "policy": draw(
                st.sampled_from(
                    ["mosaic", "hpa-util:0.7", "hpa-waiting:4", "dynamo:180", "hpa-util:1.5", "fixed", static]
                )
            ),
            "interval_s": draw(st.sampled_from([5, 15])),
        }
        a = cfg["autoscaler"]
        if draw(st.sampled_from([False, False, True])):
            knobs = draw(st.dictionaries(st.sampled_from(KNOBS), st.sampled_from(KNOB_VALUES), max_size=2))
            for knob, value in knobs.items():
                (a if draw(st.booleans()) else a.setdefault("knobs", {}))[knob] = value  # flat or under knobs
        if draw(st.booleans()):  # a lead without a cold start is refused
            (a if draw(st.booleans()) else a.setdefault("knobs", {}))["backlog_lead_s"] = draw(
                st.sampled_from([0, 30])
            )
        if draw(st.booleans()):
            a["cold_start_s"] = draw(st.sampled_from([0, 60]))
        if draw(st.booleans()):  # a node inventory over the pools' GPUs and domains (the topology solver)
            nodes = []
            for p in v["pools"]:
                for d in p.get("domains") or ["rack-9"]:
                    nodes.append(
                        {
                            "name": f"{p['name']}-{d}".lower().replace("_", "-"),
                            "gpu": p["gpu"],
                            "gpus": 8,
                            "domain": d,
                        }
                    )
            # Off the pools' domains (a split pool's GPU also in another pool's domains, or rack-9 for a pool
            # without; one of its domains dropped) `mosaic autoscale` refuses the inventory, and so the chart.
            if draw(st.booleans()):
                del nodes[draw(ints(0, len(nodes) - 1))]
            if nodes:
                a["nodes"] = {"nodes": nodes}
        if draw(st.booleans()):
            cfg["autoscaler"]["actuator"] = draw(st.sampled_from(["kubernetes", "dry-run"]))
    if draw(st.booleans()):
        cfg["limits"] = {"shutdown_grace_s": draw(st.sampled_from([0, 10, 30.5]))}
        if draw(st.booleans()):  # the KV lease (default 900 s) must outlast each of these
            cfg["limits"]["total_timeout_s"] = draw(st.sampled_from([60, 600, 1200]))
        if draw(st.booleans()):
            cfg["limits"]["stall_timeout_s"] = draw(st.sampled_from([30, 900]))
    if draw(st.booleans()):
        cfg["models"] = [{"name": m, "spec": "llama-3-8b"} for m in sorted({p["model"] for p in v["pools"]})]
        if draw(st.sampled_from([False, False, True])):  # a name listed twice is refused
            cfg["models"].append(dict(cfg["models"][0]))
    if cfg:
        v["config"] = cfg
    if draw(st.booleans()):
        v["catalog"] = {
            "gpus": {"B200": {"memory_gb": 192, "hbm_gbps": 8000, "tflops": 2250, "cost_per_hour": 6.5}}
        }
    if draw(st.booleans()):
        v["auth"] = {
            "enabled": draw(st.booleans()),
            "apiKeys": draw(st.lists(st.sampled_from(["k1", "k2"]), max_size=2, unique=True)),
            "existingSecret": draw(st.sampled_from(["", "my-keys"])),
        }
    if draw(st.booleans()):
        v["fullnameOverride"] = draw(st.sampled_from(["", "llm", "mosaic-prod"]))
    if draw(st.booleans()):
        v["simulated"] = draw(st.booleans())
    if draw(st.booleans()):
        v["vllm"] = {"port": draw(st.sampled_from([8000, 8001])), "hfToken": {"value": "hf_x"}}
    if draw(st.booleans()):
        v["monitoring"] = {
            "serviceMonitor": {"enabled": draw(st.booleans())},
            "podMonitor": {"enabled": draw(st.booleans())},
        }
    if draw(st.booleans()):
        v["commonLabels"] = {"env": draw(st.sampled_from(["prod", "x" * 63, "a_b.c"]))}
    if draw(st.booleans()):
        v["nameOverride"] = draw(st.sampled_from(["", "llm", "mosaic", "llm", "n" * 52]))
    if draw(st.booleans()):
        v["fullnameOverride"] = draw(st.sampled_from(["", "llm", "f" * 20, "f" * 52]))
    if draw(st.booleans()):
        labels = draw(st.sampled_from([{"team": "ml"}, {"example.com/tier": "x" * 63}]))
        v.setdefault("gateway", {})["podLabels"] = labels
        v.setdefault("controller", {})["podLabels"] = labels
    if draw(st.booleans()):
        annotations = draw(
            st.sampled_from([{"a": "b"}, {"prometheus.io/scrape": "false"}, {"checksum/config": "x"}])
        )
        v.setdefault("gateway", {})["podAnnotations"] = annotations
        v.setdefault("controller", {})["podAnnotations"] = annotations
    if draw(st.booleans()):
        v.setdefault("auth", {}).update(
            apiKeysKey=draw(st.sampled_from(["api-keys", "keys", "a.b_c"])),
            adminKeysKey=draw(st.sampled_from(["admin-keys", "admin", "keys"])),
        )
    if draw(st.booleans()):
        g = v.setdefault("gateway", {})
        g["preStop"] = draw(st.sampled_from(["exec", "sleep"]))
        g["terminationGracePeriodSeconds"] = draw(st.sampled_from([None, 20, 60]))
        g["topologySpreadConstraints"] = draw(
            st.sampled_from(
                [
                    [],
                    [
                        {
                            "maxSkew": 1,
                            "topologyKey": "topology.kubernetes.io/zone",
                            "whenUnsatisfiable": "DoNotSchedule",
                        }
                    ],
                ]
            )
        )
        g["service"] = {"annotations": {"example.com/lb": "internal"}}
    if draw(st.booleans()):
        interval = draw(st.sampled_from(["5s", "15s", "1m"]))
        timeout = draw(st.sampled_from(["", "10s", "500ms"]))
        v.setdefault("monitoring", {})["serviceMonitor"] = {
            "enabled": True,
            "interval": interval,
            "scrapeTimeout": timeout,
        }
        v["monitoring"]["grafanaDashboard"] = {"enabled": draw(st.booleans())}
    if draw(st.booleans()):
        names = ["MosaicRequestsFailing", "MosaicWorkerPreempting", "MosaicAutoscalerScaleErrors"]
        v.setdefault("monitoring", {})["prometheusRule"] = {
            "enabled": True,
            "selector": draw(st.sampled_from([None, "", 'cluster="eu-1"'])),
            "disabled": draw(st.lists(st.sampled_from(names), unique=True)),
            "overrides": draw(st.sampled_from([{}, {"MosaicRequestsFailing": {"severity": "page: now"}}])),
            "ttftSeconds": draw(st.sampled_from([None, 0.8])),
        }
    if draw(st.booleans()):
        v.setdefault("vllm", {})["modelCache"] = draw(
            st.sampled_from(
                [
                    {"existingClaim": "models"},
                    {"hostPath": "/data/models"},
                    {"sizeLimit": "50Gi", "mountPath": "/cache"},
                ]
            )
        )
        v["vllm"]["hfToken"] = draw(
            st.sampled_from([{"existingSecret": "hf", "key": "token"}, {"value": ""}])
        )
    if draw(st.booleans()):
        v.setdefault("controller", {})["probes"] = {
            "startup": draw(probe),
            "readiness": draw(probe),
            "liveness": draw(probe),
        }
    if draw(st.booleans()):
        v.setdefault("vllm", {})["kvTransfer"] = {
            "sideChannelPort": draw(st.sampled_from([5600, 5601, 8000]))
        }
    if draw(st.booleans()):
        v.setdefault("gateway", {})["ingress"] = {
            "enabled": True,
            "hosts": [
                {
                    "host": "h.example.com",
                    "paths": [{"path": draw(st.sampled_from(["/v1", "/"])), "pathType": "Prefix"}],
                }
            ],
        }
    return v


# --- checks -----------------------------------------------------------------------------------------------


def _render_raw(chart: helm.Chart, vals: dict[str, Any]) -> dict[str, str]:
    return chart.render(vals, name=RELEASE, namespace=NAMESPACE, is_install=True)


def _parse(manifests: dict[str, str]) -> Rendered:
    objects, sources, notes = [], [], ""
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.load_all(text, Loader=_UniqueKeyLoader):  # a SafeLoader
            if doc:
                objects.append(doc)
                sources.append(template)
    return Rendered(tuple(objects), tuple(sources), notes)


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def _templates(r: Rendered) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) for every Deployment."""
    return [(d, d["spec"]["template"]) for d in r.of_kind("Deployment")]


def _check_objects(r: Rendered) -> None:
    seen: set[tuple[str, str]] = set()
    for obj in r.objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        assert (kind, name) not in seen, f"two {kind}s named {name}"
        seen.add((kind, name))
        assert len(name) <= 253 and DNS1123_SUBDOMAIN.match(name), f"{kind} name {name!r}"
        if kind == "Service":
            assert len(name) <= 63 and DNS1035_LABEL.match(name), (
                f"Service name {name!r} is not a DNS-1035 label"
            )
        if kind == "Deployment":  # its name is also a label value (the chart's pods are named after it)
            assert len(name) <= 63 and DNS1123_LABEL.match(name), f"Deployment name {name!r}"
        for key, value in [*(obj["metadata"].get("labels") or {}).items()]:
            assert LABEL_KEY.match(key) and LABEL_VALUE.match(str(value)) and isinstance(value, str), (
                kind,
                key,
                value,
            )
        tmpl = (obj.get("spec") or {}).get("template")
        if isinstance(tmpl, dict):
            for key, value in (tmpl["metadata"].get("labels") or {}).items():
                assert isinstance(value, str) and LABEL_VALUE.match(value), (kind, name, key, value)
        if kind == "Secret":
            for key in obj.get("data") or {}:
                assert SECRET_KEY.match(key), f"Secret {name} key {key!r}"
        if kind not in CRD_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)

    pods = _templates(r)
    for dep, tmpl in pods:
        assert _selects(dep["spec"]["selector"]["matchLabels"], tmpl["metadata"]["labels"]), dep["metadata"][
            "name"
        ]
        for c in tmpl["spec"]["containers"]:
            ports = [p["name"] for p in c.get("ports") or []]
            numbers = [p["containerPort"] for p in c.get("ports") or []]
            assert len(set(numbers)) == len(numbers), f"{dep['metadata']['name']}: one port twice {numbers}"
            for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = ((c.get(probe_name) or {}).get("httpGet") or {}).get("port")
                if isinstance(port, str):
                    assert port in ports, f"{dep['metadata']['name']} {probe_name} port {port} missing"
    for svc in r.of_kind("Service"):
        selected = [t for _, t in pods if _selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert selected, f"Service {svc['metadata']['name']} selects no pods"
        components = {
            t["metadata"]["labels"].get(
                "mosaic.dev/pool", t["metadata"]["labels"]["app.kubernetes.io/component"]
            )
            for t in selected
        }
        assert len(components) == 1, f"Service {svc['metadata']['name']} selects {components}"
        for port in svc["spec"]["ports"]:
            for t in selected:
                names = [p["name"] for c in t["spec"]["containers"] for p in c.get("ports") or []]
                assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    for pdb in r.of_kind("PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(_selects(sel, t["metadata"]["labels"]) for _, t in pods), pdb["metadata"]["name"]
    hpa = r.of_kind("HorizontalPodAutoscaler")
    for h in hpa:
        assert r.find("Deployment", h["spec"]["scaleTargetRef"]["name"])


def _check_config(r: Rendered, vals: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in r.get("ConfigMap", _component(vals, "config"))["data"].items():
            (Path(tmp) / name).write_text(text.replace("/etc/mosaic/", f"{tmp}/"))
        try:
            cfg = load_config(Path(tmp) / "config.yaml")
        except ConfigError as exc:
            raise AssertionError(f"the gateway refuses the rendered config: {exc}") from None
        from server.gateway import Gateway

        env = {"MOSAIC_API_KEYS": "k", "MOSAIC_ADMIN_KEYS": "a"}
        env.update({p.api_key_env: "pk" for p in cfg.pools if p.api_key_env})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)

        async def build() -> None:
            gw = Gateway(cfg)
            await gw.stop()
            controller = r.find("Deployment", _component(vals, "controller"))
            if controller is not None:
                # with the environment the controller's container has, not the gateway's: the key Secret
                # is only mounted on the gateway (its absence made every default controller exit at start)
                given = {
                    e["name"]
                    for c in controller["spec"]["template"]["spec"]["containers"]
                    for e in c.get("env") or []
                }
                for k in env:
                    if k not in given:
                        os.environ.pop(k, None)
                await _build_controller(cfg)

        try:
            asyncio.run(build())
        except ConfigError as exc:
            raise AssertionError(f"`mosaic serve` refuses the rendered config: {exc}") from None
        finally:
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old

    # discovery points at the pools' pods / Services, on their port
    pods = {d["metadata"]["name"]: d for d in r.of_kind("Deployment")}
    for pool in cfg.pools:
        k8s = pool.endpoints.kubernetes
        assert k8s is not None and k8s.namespace == NAMESPACE
        sel = parse_selector(k8s.label_selector)
        if k8s.resource == "pods":
            hits = [d for d in pods.values() if _selects(sel, d["spec"]["template"]["metadata"]["labels"])]
            assert hits and all(d["metadata"]["labels"]["mosaic.dev/pool"] == pool.name for d in hits)
        else:
            svc = r.get("Service", sel["kubernetes.io/service-name"])
            assert svc["metadata"]["labels"]["mosaic.dev/pool"] == pool.name
            assert k8s.port == svc["spec"]["ports"][0]["port"]
    gw_port = next(
        p["containerPort"]
        for p in pods[_component(vals, "gateway")]["spec"]["template"]["spec"]["containers"][0]["ports"]
    )
    assert cfg.gateway.port == gw_port

    controller = r.find("Deployment", _component(vals, "controller"))
    if controller is None:
        return
    a = cfg.autoscaler
    assert a.actuator != "embedded", "mosaic autoscale refuses actuator embedded"
    if a.actuator == "kubernetes":
        from server.commands.autoscale import kubernetes_deployments, kubernetes_domains

        assert a.kubernetes.namespace == NAMESPACE
        targets = set(kubernetes_deployments(cfg).values()) | {
            d for by in kubernetes_domains(cfg).values() for d in by.values()
        }
        assert targets, "mosaic autoscale: no pool to scale"
        assert targets <= set(pods), f"scales Deployments that do not exist: {targets - set(pods)}"
        role = r.find("Role", _component(vals, "controller"))
        if role is not None:
            granted = {
                n
                for rule in role["rules"]
                if "deployments/scale" in rule["resources"] and {"get", "patch"} <= set(rule["verbs"])
                for n in rule.get("resourceNames") or []
            }
            assert targets <= granted, f"RBAC does not grant deployments/scale on {targets - granted}"
    if a.gateways is not None and a.gateways.kubernetes is not None:
        sel = parse_selector(a.gateways.kubernetes.label_selector)
        hits = [n for n, d in pods.items() if _selects(sel, d["spec"]["template"]["metadata"]["labels"])]
        assert hits == [_component(vals, "gateway")]


async def _build_controller(cfg: Any) -> None:
    """What `mosaic autoscale` builds before it first lists anything (server/commands/autoscale.py
    `standalone`, up to `controller_for`): its checks of the config (capacity, node inventory, domains)."""
    from prometheus_client import CollectorRegistry

    from scheduler.actuators.dry_run import DryRunActuator
    from server.autoscaler_setup import controller_for
    from server.commands.autoscale import observer_config
    from server.gateway import Gateway

    a = cfg.autoscaler
    gw = Gateway(observer_config(cfg))
    try:
        controller_for(
            cfg,
            gw.registry,
            CollectorRegistry(),
            actuator_factory=lambda initial: DryRunActuator(initial, keep=a.history),
            managed=frozenset(p.name for p in cfg.pools),
            gateway=dict,
            offload=a.actuator == "kubernetes",
            clock=gw.clock,
        )
    except ConfigError as exc:
        raise AssertionError(f"`mosaic autoscale` refuses the rendered config: {exc}") from None
    finally:
        await gw.stop()


def _component(vals: dict[str, Any], suffix: str) -> str:
    """ "<fullname>-<component>" cut to 63 characters, as the chart's helpers do."""
    return f"{_fullname(vals)}-{suffix}"[:63].rstrip("-")


def _fullname(vals: dict[str, Any]) -> str:
    """The chart's "mosaic.fullname"."""
    if vals.get("fullnameOverride"):
        return str(vals["fullnameOverride"])[:63].rstrip("-")
    name = vals.get("nameOverride") or "mosaic"
    return RELEASE if name in RELEASE else f"{RELEASE}-{name}"[:63].rstrip("-")


def check(chart: helm.Chart, vals: dict[str, Any]) -> None:
    try:
        chart.validate_schema(vals)
    except helm.HelmValuesError:
        return  # refused with the schema's message, naming the key: fine
    try:
        first = _render_raw(chart, vals)
    except helm.HelmRenderError as exc:
        message = str(exc)
        assert "execution error at" in message and not TEMPLATE_BUG.search(message), (
            f"template error: {message}"
        )
        return
    second = _render_raw(chart, vals)
    generated = f"{_fullname(vals)}-api-keys"
    if not (vals.get("auth") or {}).get("apiKeys"):  # a generated key differs per render, by design
        first = {k: v for k, v in first.items() if not k.endswith("secret-api-keys.yaml")}
        second = {k: v for k, v in second.items() if not k.endswith("secret-api-keys.yaml")}
        del generated
    assert first == second, "two renders of the same values differ"
    r = _parse(first)
    _check_objects(r)
    _check_config(r, vals)


@pytest.mark.timeout(300)
@settings(
    max_examples=EXAMPLES,
    derandomize=EXAMPLES <= 100,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(vals=values())
def test_values_are_refused_at_render_or_give_valid_objects_and_a_config_mosaic_accepts(
    chart: helm.Chart, vals: dict[str, Any]
) -> None:
    note(yaml.safe_dump(vals, sort_keys=False))
    check(chart, vals)


# --- what the property found (each failed before its fix) ------------------------------------------------

POOL = {"name": "p", "model": "llama-3-8b", "gpu": "A100-80GB"}


def _refused(chart: helm.Chart, vals: dict[str, Any]) -> str:
    """The message a schema-valid values document is refused with at render (a chart `fail`)."""
    chart.validate_schema(vals)
    with pytest.raises(helm.HelmRenderError) as caught:
        _render_raw(chart, vals)
    return str(caught.value)


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param({**POOL, "gpu": "B200", "simulated": True}, id="simulated"),
        pytest.param({**POOL, "gpu": "B200", "gpuProducts": ["NVIDIA-B200"]}, id="real, own products"),
    ],
)
def test_found_a_gpu_outside_the_catalog_is_refused_at_render(
    chart: helm.Chart, pool: dict[str, Any]
) -> None:
    """A pool's `gpu` that is not in Mosaic's catalog (built-in rows, aliases, `catalog.gpus`) rendered, and every
    gateway and the controller refused the config at start (`pools.0.gpu: unknown GPU 'B200'`: a crash loop).
    The chart checked the pool's model against the catalog, never its GPU."""
    message = _refused(chart, {"pools": [pool]})
    assert 'pools[0] (p): gpu "B200" is not a GPU of Mosaic\'s catalog' in message
    assert "add its row under catalog.gpus" in message
    # with the row, it renders and loads
    check(
        chart,
        {
            "pools": [pool],
            "catalog": {
                "gpus": {"B200": {"memory_gb": 192, "hbm_gbps": 8000, "tflops": 2250, "cost_per_hour": 6.5}}
            },
        },
    )


@pytest.mark.parametrize("gpu", ["h100", "a100", "mi300x", "H100-80GB"])
def test_found_gpu_aliases_and_case_still_load(chart: helm.Chart, gpu: str) -> None:
    """The GPU check accepts what the catalog accepts: aliases and any case."""
    check(chart, {"pools": [{**POOL, "gpu": gpu, "simulated": True}]})


def test_found_a_fixed_kv_share_with_the_default_peers_is_refused_at_render(chart: helm.Chart) -> None:
    """`config.kv.share` rendered next to the chart's own `gateway.peers` (on by default), which the gateway
    refuses (`kv.share: a fixed share and gateway.peers … exclude each other`): every gateway crash-looped."""
    message = _refused(chart, {"pools": [POOL], "config": {"kv": {"share": 0.5}}})
    assert "config.kv.share and gateway.peers.enabled exclude each other" in message
    check(
        chart, {"pools": [POOL], "config": {"kv": {"share": 0.5}}, "gateway": {"peers": {"enabled": False}}}
    )
    check(chart, {"pools": [POOL], "config": {"kv": {"share": 0.5, "enabled": False}}})


def test_found_the_embedded_actuator_is_refused_by_the_schema(chart: helm.Chart) -> None:
    """`config.autoscaler.actuator: embedded` passed the schema, but the chart's pools are never simulated
    in-process: `mosaic autoscale` (the controller) refuses embedded whatever `enabled` says, and with
    `enabled: true` every gateway refused it too. Crash loops; now the schema names the two that work."""
    vals = {"pools": [POOL], "config": {"autoscaler": {"enabled": True, "actuator": "embedded"}}}
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(vals)
    assert "at '/config/autoscaler/actuator'" in str(caught.value)


@pytest.mark.parametrize("component", ["gateway", "controller"])
@pytest.mark.parametrize(
    "annotations",
    [{"prometheus.io/scrape": "false"}, {"checksum/config": "pinned"}],
    ids=["scrape opt-out", "checksum"],
)
def test_found_pod_annotations_of_the_chart_own_keys_are_merged_not_repeated(
    chart: helm.Chart, component: str, annotations: dict[str, str]
) -> None:
    """gateway/controller.podAnnotations naming a key the chart writes itself (the prometheus.io/* scrape
    annotations, checksum/*) rendered that key twice in one mapping, which `helm install` refuses (`key … already
    set in map`). Now the values' annotations are merged over the chart's, as pools' podAnnotations are (the
    documented way to opt a pod out of annotation scraping)."""
    vals = {"pools": [POOL], component: {"podAnnotations": annotations}}
    r = _parse(_render_raw(chart, vals))
    dep = r.get("Deployment", f"{RELEASE}-{component}")
    assert annotations.items() <= dep["spec"]["template"]["metadata"]["annotations"].items()


@pytest.mark.parametrize("component", ["gateway", "controller", "poolDefaults"])
@pytest.mark.parametrize("key", ["app.kubernetes.io/component", "mosaic.dev/pool", "helm.sh/chart"])
def test_found_pod_labels_may_not_set_the_chart_own_keys(chart: helm.Chart, component: str, key: str) -> None:
    """podLabels naming a label the chart writes (component, instance, mosaic.dev/*, …) passed the schema and
    rendered the key twice in the pod template's labels (`helm install` refuses it; with the last one winning,
    the pods would leave their Deployment's selector). commonLabels already refused these keys; podLabels now do."""
    vals = {"pools": [POOL], component: {"podLabels": {key: "x"}}}
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(vals)
    assert f"invalid propertyName '{key}'" in str(caught.value)


@pytest.mark.parametrize(
    "vals",
    [
        pytest.param({"commonLabels": {"env": "a b"}}, id="commonLabels value with a space"),
        pytest.param({"commonLabels": {"env": "x" * 64}}, id="commonLabels value over 63"),
        pytest.param(
            {"gateway": {"podLabels": {"team": "-ml"}}}, id="podLabels value not alphanumeric at the ends"
        ),
        pytest.param({"fullnameOverride": "Mosaic"}, id="fullnameOverride upper case"),
        pytest.param(
            {"fullnameOverride": "1abc"}, id="fullnameOverride starting with a digit (Service names)"
        ),
        pytest.param({"fullnameOverride": "my.release"}, id="fullnameOverride with a dot"),
        pytest.param({"fullnameOverride": "f" * 53}, id="fullnameOverride leaving no room for -controller"),
        pytest.param({"nameOverride": "My_Name"}, id="nameOverride not a DNS label"),
        pytest.param({"auth": {"apiKeysKey": "api keys"}}, id="Secret key with a space"),
        pytest.param(
            {
                "gateway": {
                    "ingress": {"hosts": [{"host": "h", "paths": [{"path": "v1", "pathType": "Prefix"}]}]}
                }
            },
            id="ingress path not absolute",
        ),
    ],
)
def test_found_values_kubernetes_refuses_are_refused_by_the_schema(
    chart: helm.Chart, vals: dict[str, Any]
) -> None:
    """Each of these passed the schema and rendered an object the API server refuses (label values must be
    ≤ 63 characters, alphanumeric at both ends; object names DNS labels, Service names starting with a letter;
    Secret keys [-._a-zA-Z0-9]; Ingress paths absolute), so the install failed half-way, or (a 61-character
    fullnameOverride) a pool named `g` rendered the gateway's own Deployment name."""
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema({"pools": [POOL], **vals})


def test_found_one_secret_key_for_api_and_admin_keys_is_refused(chart: helm.Chart) -> None:
    """auth.apiKeysKey == auth.adminKeysKey with the chart's own Secret rendered one data key twice (install
    refused; with the last one winning, the admin keys would become the client keys)."""
    message = _refused(chart, {"pools": [POOL], "auth": {"apiKeysKey": "keys", "adminKeysKey": "keys"}})
    assert "auth.apiKeysKey and auth.adminKeysKey are both" in message


def test_found_the_nixl_side_channel_on_the_vllm_port_is_refused(chart: helm.Chart) -> None:
    """vllm.kvTransfer.sideChannelPort equal to vllm.port rendered a P/D pod with one container port twice, and
    the NIXL side channel and vLLM's HTTP server would both bind it (vLLM fails to start)."""
    vals = {"pools": [{**POOL, "role": "prefill"}], "vllm": {"port": 5600}}
    assert "vllm.kvTransfer.sideChannelPort 5600 is vllm.port" in _refused(chart, vals)
    check(chart, {"pools": [POOL], "vllm": {"port": 5600}})  # no P/D pool: no side channel, fine


def test_found_the_autoscaler_on_without_the_controller_is_refused_at_render(chart: helm.Chart) -> None:
    """`config.autoscaler.enabled: true` with `controller.enabled: false` rendered no actuator, so the gateway
    took its default, embedded, and refused the config at start (`the embedded actuator scales simulated …
    pools and there is none`): every gateway crash-looped. The chart's actuator is now kubernetes whether
    or not the controller runs, and the render says that nothing would run it."""
    vals = {"pools": [POOL], "controller": {"enabled": False}, "config": {"autoscaler": {"enabled": True}}}
    assert "the kubernetes actuator runs in the controller" in _refused(chart, vals)
    vals["config"]["autoscaler"]["actuator"] = "dry-run"  # decisions logged by the gateways themselves
    check(chart, vals)
    check(
        chart,
        {"pools": [POOL], "controller": {"enabled": False}, "config": {"autoscaler": {"enabled": False}}},
    )
