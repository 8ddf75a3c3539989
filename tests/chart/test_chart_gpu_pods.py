"""Real (vLLM) pools' Deployments as a GPU fleet needs them:

- a progress deadline that covers a normal first start (the startup probe's budget plus scheduling and the
  image pull), not Kubernetes' 600 s;
- an in-place rollout by default (a surge pod would need free GPUs), configurable per pool;
- pod templates that no monitoring toggle changes (each change restarts every GPU pod, a model reload each);
- an `ephemeral-storage` request for the emptyDir model cache, so the scheduler picks a node with the disk;
- the GPU toleration and the GPU-product node term kept under a pool's own tolerations and node affinity;
- hardened security contexts (overridable) and every cache on the cache volume.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.chart.chartkit import RELEASE, container, env_map, pod_spec, render

KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
REAL = {"name": "l4", "model": "llama-3-8b", "gpu": "L4"}
SIM = {"name": "sim", "model": "llama-3-8b", "gpu": "L4", "simulated": True}
GPU_TERM = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-L4"]}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _deployment(chart: helm.Chart, values: dict[str, Any] | None = None, **pool: Any) -> dict[str, Any]:
    """The one Deployment of a real L4 pool with `pool`'s keys, under `values`."""
    dep = render(chart, {**(values or {}), "pools": [{**REAL, **pool}]}).get("Deployment", f"{RELEASE}-l4")
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(dep, version, strict=True)
    return dep


# ---- progress deadline ----


@pytest.mark.parametrize(
    ("values", "pool", "expected"),
    [
        pytest.param({}, {}, 1800 + 900, id="default: 10 s x 180 startup + 900 s to schedule and pull"),
        pytest.param(
            {"vllm": {"probes": {"startup": {"periodSeconds": 10, "failureThreshold": 360}}}},
            {},
            3600 + 900,
            id="follows a longer startup budget (a 400B model)",
        ),
        pytest.param({}, {"progressDeadlineSeconds": 5400}, 5400, id="the pool's own value"),
        pytest.param({"poolDefaults": {"progressDeadlineSeconds": 4000}}, {}, 4000, id="poolDefaults' value"),
    ],
)
def test_a_gpu_pools_progress_deadline_covers_a_first_start(
    chart: helm.Chart, values: dict[str, Any], pool: dict[str, Any], expected: int
) -> None:
    """Before: no progressDeadlineSeconds, so Kubernetes' 600 s; a first start (pull + 30 min startup budget)
    was reported ProgressDeadlineExceeded: `kubectl rollout status` failed, Argo CD showed Degraded."""
    dep = _deployment(chart, values, **pool)
    assert dep["spec"]["progressDeadlineSeconds"] == expected
    startup = container(dep)["startupProbe"]
    if not pool and "poolDefaults" not in values:
        assert expected > startup["periodSeconds"] * startup["failureThreshold"]


def test_a_simulated_pool_keeps_the_kubernetes_deadline_unless_set(chart: helm.Chart) -> None:
    rendered = render(chart, {"pools": [SIM, {**SIM, "name": "sim2", "progressDeadlineSeconds": 900}]})
    assert "progressDeadlineSeconds" not in rendered.get("Deployment", f"{RELEASE}-sim")["spec"]
    assert rendered.get("Deployment", f"{RELEASE}-sim2")["spec"]["progressDeadlineSeconds"] == 900


# ---- rollout strategy ----


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        pytest.param(
            None,
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            id="default: in place, one at a time",
        ),
        pytest.param(
            {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            id="surge where spare GPUs exist",
        ),
        pytest.param(
            {"rollingUpdate": {"maxUnavailable": "50%"}},
            {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "50%"}},
            id="merged over the default",
        ),
        pytest.param({"type": "Recreate"}, {"type": "Recreate"}, id="Recreate drops rollingUpdate"),
    ],
)
def test_a_gpu_pools_rollout_strategy_is_configurable(
    chart: helm.Chart, strategy: dict[str, Any] | None, expected: dict[str, Any]
) -> None:
    """Before: maxSurge 0 / maxUnavailable 1 were hard-coded (and `strategy` refused by the schema)."""
    dep = _deployment(chart, **({} if strategy is None else {"strategy": strategy}))
    assert dep["spec"]["strategy"] == expected


def test_simulated_pools_roll_as_any_deployment_unless_they_set_a_strategy(chart: helm.Chart) -> None:
    own = {**SIM, "name": "own", "strategy": {"type": "Recreate"}}
    rendered = render(chart, {"pools": [SIM, own]})
    assert "strategy" not in rendered.get("Deployment", f"{RELEASE}-sim")["spec"]
    assert rendered.get("Deployment", f"{RELEASE}-own")["spec"]["strategy"] == {"type": "Recreate"}


def test_a_rollout_that_can_never_replace_a_pod_fails_the_render(chart: helm.Chart) -> None:
    strategy = {"rollingUpdate": {"maxSurge": "0%", "maxUnavailable": 0}}
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"pools": [{**REAL, "strategy": strategy}]})
    assert "pools[0] (l4): strategy.rollingUpdate has maxSurge 0 and maxUnavailable 0" in str(caught.value)
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema({"pools": [{**REAL, "strategy": {"type": "Surge"}}]})
    assert "at '/pools/0/strategy/type': value must be one of 'RollingUpdate', 'Recreate'" in str(
        refused.value
    )


# ---- pod templates and monitoring toggles ----

TOGGLES = [
    {"scrapeAnnotations": False},
    {"serviceMonitor": {"enabled": True}},
    {"podMonitor": {"enabled": True}},
    {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}, "scrapeAnnotations": False},
]


@pytest.mark.parametrize("monitoring", TOGGLES)
def test_monitoring_toggles_leave_the_pool_pod_templates_alone(
    chart: helm.Chart, monitoring: dict[str, Any]
) -> None:
    """Before: turning a ServiceMonitor/PodMonitor or scrapeAnnotations on or off added or removed the
    prometheus.io annotations on the pool pod templates, which restarted every GPU pod."""

    def templates(values: dict[str, Any]) -> dict[str, Any]:
        rendered = render(chart, {**values, "pools": [REAL, SIM]})
        return {d["metadata"]["name"]: d["spec"]["template"] for d in rendered.pool_deployments()}

    assert templates({"monitoring": monitoring}) == templates({})
    for template in templates({"monitoring": monitoring}).values():
        notes = template["metadata"]["annotations"]
        assert (notes["prometheus.io/scrape"], notes["prometheus.io/port"], notes["prometheus.io/path"]) == (
            "true",
            "8000",
            "/metrics",
        )


def test_a_pools_pod_annotations_win_over_the_charts(chart: helm.Chart) -> None:
    """The opt-out for a cluster whose Prometheus scrapes by annotation next to an operator monitor. Before,
    the pool's annotations were appended after the chart's: a duplicate mapping key, which strict decoders
    (kubectl apply, the API server's strict field validation) refuse."""
    pool = {**REAL, "podAnnotations": {"prometheus.io/scrape": "false", "team": "llm"}}
    manifest = chart.render({"pools": [pool]}, name=RELEASE, namespace="llm", is_install=True)
    assert manifest["mosaic/templates/pools.yaml"].count("prometheus.io/scrape") == 1
    dep = _deployment(chart, podAnnotations=pool["podAnnotations"])
    assert dep["spec"]["template"]["metadata"]["annotations"] == {
        "mosaic.dev/model": "llama-3-8b",
        "mosaic.dev/tp": "1",
        "prometheus.io/scrape": "false",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
        "team": "llm",
    }


# ---- disk for the emptyDir model cache ----


@pytest.mark.parametrize(
    ("cache", "resources", "expected"),
    [
        pytest.param({}, {}, "100Gi", id="emptyDir of the default sizeLimit"),
        pytest.param({"sizeLimit": "250Gi"}, {}, "250Gi", id="follows sizeLimit"),
        pytest.param({}, {"requests": {"ephemeral-storage": "50Gi"}}, "50Gi", id="the pool's own request"),
        pytest.param(
            {}, {"limits": {"ephemeral-storage": "300Gi"}}, None, id="a limit alone: Kubernetes requests it"
        ),
        pytest.param({"existingClaim": "weights"}, {}, None, id="a PVC is not node disk"),
        pytest.param({"hostPath": "/mnt/models"}, {}, None, id="nor is a host path"),
    ],
)
def test_an_emptydir_model_cache_is_requested_as_ephemeral_storage(
    chart: helm.Chart, cache: dict[str, Any], resources: dict[str, Any], expected: str | None
) -> None:
    """Before: a 100Gi emptyDir and no ephemeral-storage request: the scheduler placed vLLM on nodes without
    the disk, whose kubelet then evicted it mid-download."""
    dep = _deployment(chart, {"vllm": {"modelCache": cache}}, resources=resources)
    requests = container(dep)["resources"]["requests"]
    assert requests.get("ephemeral-storage") == expected
    assert requests["cpu"] == "4" and requests["nvidia.com/gpu"] == 1  # poolDefaults' and the GPUs kept
    limits = container(dep)["resources"]["limits"]
    assert limits.get("ephemeral-storage") == (resources.get("limits") or {}).get("ephemeral-storage")


def test_simulated_workers_request_no_model_cache_disk(chart: helm.Chart) -> None:
    dep = render(chart, {"pools": [SIM]}).get("Deployment", f"{RELEASE}-sim")
    assert "ephemeral-storage" not in container(dep)["resources"].get("requests", {})


# ---- tolerations and node affinity ----


@pytest.mark.parametrize(
    ("values", "pool", "expected"),
    [
        pytest.param({}, {}, [GPU_TOLERATION], id="default: the GPU taint"),
        pytest.param(
            {},
            {
                "tolerations": [
                    {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
                ]
            },
            [
                GPU_TOLERATION,
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
            ],
            id="a pool's own are added",
        ),
        pytest.param(
            {"poolDefaults": {"tolerations": [{"key": "spot", "operator": "Exists"}]}},
            {},
            [GPU_TOLERATION, {"key": "spot", "operator": "Exists"}],
            id="poolDefaults' are added",
        ),
        pytest.param({}, {"tolerations": [GPU_TOLERATION]}, [GPU_TOLERATION], id="not twice"),
        pytest.param(
            {},
            {"gpuResource": "amd.com/gpu", "gpuProducts": ["AMD-Instinct-MI300X"]},
            [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            id="the pool's GPU resource's taint",
        ),
    ],
)
def test_a_pools_tolerations_add_to_the_gpu_toleration(
    chart: helm.Chart, values: dict[str, Any], pool: dict[str, Any], expected: list[dict[str, Any]]
) -> None:
    """Before: a pool's tolerations replaced the nvidia.com/gpu one, so its pods stayed Pending on GPU nodes."""
    assert pod_spec(_deployment(chart, values, **pool))["tolerations"] == expected


ZONE = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east-1a"]}
PREFERRED = [
    {
        "weight": 50,
        "preference": {"matchExpressions": [{"key": "cost", "operator": "In", "values": ["spot"]}]},
    }
]
ANTI = {
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {}}}
    ]
}


@pytest.mark.parametrize(
    ("affinity", "expected"),
    [
        pytest.param(
            {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": PREFERRED}},
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [GPU_TERM]}]
                    },
                    "preferredDuringSchedulingIgnoredDuringExecution": PREFERRED,
                }
            },
            id="preferred terms kept, the GPU term required",
        ),
        pytest.param(
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [ZONE]},
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}
                                ]
                            },
                        ]
                    }
                },
                "podAntiAffinity": ANTI,
            },
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [ZONE, GPU_TERM]},
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}
                                ],
                                "matchExpressions": [GPU_TERM],
                            },
                        ]
                    }
                },
                "podAntiAffinity": ANTI,
            },
            id="the GPU term ANDed into each required term; pod anti-affinity kept",
        ),
        pytest.param(
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "nvidia.com/gpu.product",
                                        "operator": "In",
                                        "values": ["NVIDIA-L4-24GB"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "nvidia.com/gpu.product",
                                        "operator": "In",
                                        "values": ["NVIDIA-L4-24GB"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            id="a term on the product label itself is the pool's choice",
        ),
    ],
)
def test_a_pools_node_affinity_is_merged_with_the_gpu_term(
    chart: helm.Chart, affinity: dict[str, Any], expected: dict[str, Any]
) -> None:
    """Before: any nodeAffinity of the pool's replaced the required GPU-product term, so a zone preference
    alone let an L4 pool's pods land on any GPU node (or a CPU node without the taint)."""
    assert pod_spec(_deployment(chart, affinity=affinity))["affinity"] == expected


@pytest.mark.parametrize(
    ("gpu", "products"),
    [
        pytest.param("H100", ["NVIDIA-H100-80GB-HBM3"], id="a catalog alias: its GPU's row (H100-SXM)"),
        pytest.param("a100", ["NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"], id="an alias in lower case"),
        pytest.param("l40s", ["NVIDIA-L40S"], id="a catalog name in another case"),
    ],
)
def test_a_gpu_named_as_the_catalog_matches_it_finds_its_product_values(
    chart: helm.Chart, gpu: str, products: list[str]
) -> None:
    """The gateway resolves `H100`, `A100` or `l40s` (aliases, any case); the chart looked up
    `vllm.gpuProducts` by the exact name and failed the render ("no GPU product label values")."""
    terms = pod_spec(_deployment(chart, gpu=gpu))["affinity"]["nodeAffinity"]
    expressions = terms["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert expressions["matchExpressions"] == [{**GPU_TERM, "values": products}]


def test_a_gpu_without_product_values_is_placed_by_the_pools_own_affinity(chart: helm.Chart) -> None:
    """The escape hatch of the GPU-name check: no products to add, the pool's node affinity as written."""
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [ZONE]}]}}}  # fmt: skip
    values = {"catalog": {"gpus": {"B200": {"memory_gb": 192, "hbm_gbps": 8000, "tflops": 2250, "cost_per_hour": 6.5}}}}  # fmt: skip
    dep = _deployment(chart, values, gpu="B200", affinity=own)
    assert pod_spec(dep)["affinity"] == own


# ---- security contexts and caches ----


def test_vllm_pods_are_hardened_by_default(chart: helm.Chart) -> None:
    """Before: empty security contexts (privilege escalation allowed, the runtime's capabilities, no seccomp)."""
    dep = _deployment(chart)
    assert pod_spec(dep)["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert container(dep)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }  # no runAsNonRoot: the official vllm/vllm-openai image runs as root


def test_a_pool_can_override_the_security_contexts(chart: helm.Chart) -> None:
    dep = _deployment(
        chart,
        podSecurityContext={"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
        securityContext={"allowPrivilegeEscalation": True, "capabilities": {"add": ["SYS_PTRACE"]}},
    )
    assert pod_spec(dep)["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "fsGroup": 1000,
    }
    assert container(dep)["securityContext"] == {
        "allowPrivilegeEscalation": True,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]},
    }


@pytest.mark.parametrize(
    "security",
    [
        pytest.param({"privileged": True}, id="privileged"),
        pytest.param({"capabilities": {"add": ["CAP_SYS_ADMIN"]}}, id="CAP_SYS_ADMIN"),
    ],
)
def test_a_privileged_pool_does_not_inherit_no_privilege_escalation(
    chart: helm.Chart, security: dict[str, Any]
) -> None:
    """Kubernetes' API server refuses `allowPrivilegeEscalation: false` beside `privileged: true` or an added
    CAP_SYS_ADMIN (a check the OpenAPI schema has not): poolDefaults' false made such a pool's Deployment fail
    half-way through `helm install`. The pool's container may escalate; the rest of the defaults stay."""
    sc = container(_deployment(chart, securityContext=security))["securityContext"]
    assert sc["allowPrivilegeEscalation"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {k: v for k, v in sc.items() if k in security} == {
        k: ({**v, "drop": ["ALL"]} if k == "capabilities" else v) for k, v in security.items()
    }


def test_a_pool_that_forbids_escalation_and_asks_for_privilege_fails_the_render(chart: helm.Chart) -> None:
    pool = {**REAL, "securityContext": {"privileged": True, "allowPrivilegeEscalation": False}}
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"pools": [pool]})
    assert "pools[0] (l4): securityContext sets allowPrivilegeEscalation false beside privileged" in str(
        caught.value
    )


@pytest.mark.parametrize("mount", ["/models", "/cache"])
def test_every_vllm_cache_is_on_the_cache_volume(chart: helm.Chart, mount: str) -> None:
    """Before: only HF_HOME; HOME (/root in the image) held vLLM's, Triton's and FlashInfer's caches, which a
    pool hardened to a non-root user could not write."""
    c = container(_deployment(chart, {"vllm": {"modelCache": {"mountPath": mount}}}))
    env = {name: e["value"] for name, e in env_map(c).items() if "value" in e}
    assert {k: env[k] for k in ("HF_HOME", "HOME", "XDG_CACHE_HOME", "VLLM_CACHE_ROOT")} == {
        "HF_HOME": f"{mount}/hf",
        "HOME": f"{mount}/home",
        "XDG_CACHE_HOME": f"{mount}/cache",
        "VLLM_CACHE_ROOT": f"{mount}/cache/vllm",
    }
    assert {"name": "model-cache", "mountPath": mount} in c["volumeMounts"]
