"""Per-pool PodDisruptionBudgets, images and security contexts.

- `pdb` (on by default): one PodDisruptionBudget per pool that selects exactly that pool's pods — every
  per-domain Deployment's, no other pool's, no gateway's — so a node drain evicts at most `maxUnavailable` of
  them at a time; unready pods may always be evicted (`unhealthyPodEvictionPolicy: AlwaysAllow`).
- `image`: a pool's vLLM image merged over `vllm.image` (an AMD pool on a ROCm build); simulated pools keep
  the Mosaic image.
- `podSecurityContext` / `securityContext`: on a real pool's pods and vLLM container (IPC_LOCK for RDMA).
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.chart.chartkit import RELEASE, container, pod_labels, pod_spec, render, selects

RACK = "example.com/rack"
VALUES: dict[str, Any] = {
    "gateway": {"discovery": {"domainLabel": RACK}},
    "pools": [
        {
            "name": "mi300-prefill",
            "model": "llama-3-8b",
            "gpu": "MI300X",
            "role": "prefill",
            "gpuResource": "amd.com/gpu",
            "gpuProducts": ["AMD-Instinct-MI300X"],
            "image": {"repository": "rocm/vllm", "tag": "rocm6.4_vllm_0.32.0"},
            "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
            "podSecurityContext": {"fsGroup": 1000},
            "pdb": {"maxUnavailable": "50%"},
        },
        {
            "name": "a100-decode",
            "model": "llama-3-8b",
            "gpu": "A100-80GB",
            "role": "decode",
            "replicas": 2,
            "domains": ["rack-1", "rack-2"],
        },
        {"name": "l4", "model": "llama-3-8b", "gpu": "L4", "pdb": {"enabled": False}},
        {"name": "sim", "model": "llama-3-8b", "gpu": "L4", "simulated": True, "image": {"tag": "x"}},
    ],
}


def _pool_of(deployment: dict[str, Any]) -> str:
    return pod_labels(deployment)["mosaic.dev/pool"]


def test_each_pool_has_one_budget_over_exactly_its_pods(chart: helm.Chart) -> None:
    out = render(chart, VALUES)
    budgets = {b["metadata"]["name"]: b for b in out.of_kind("PodDisruptionBudget")}
    gateway_budget = f"{RELEASE}-gateway"
    assert set(budgets) == {
        gateway_budget,
        f"{RELEASE}-mi300-prefill",
        f"{RELEASE}-a100-decode",
        f"{RELEASE}-sim",
    }
    deployments = out.of_kind("Deployment")
    for name, budget in budgets.items():
        spec = budget["spec"]
        # unready pods never hold a drain. Before, the gateway's budget had the default IfHealthyBudget: with
        # every gateway pod unready (discovery failing at start) no eviction was allowed and a drain hung.
        assert spec["unhealthyPodEvictionPolicy"] == "AlwaysAllow", name
        if name == gateway_budget:
            continue
        covered = {
            d["metadata"]["name"]
            for d in deployments
            if selects(spec["selector"]["matchLabels"], pod_labels(d))
        }
        pool = name.removeprefix(f"{RELEASE}-")
        assert covered == {
            d["metadata"]["name"] for d in deployments if d["metadata"]["name"].startswith(name)
        }
        assert all(_pool_of(d) == pool for d in deployments if d["metadata"]["name"] in covered)
    # both domain Deployments of the decode pool under its one budget
    decode = budgets[f"{RELEASE}-a100-decode"]["spec"]
    assert decode["maxUnavailable"] == 1
    assert sum(selects(decode["selector"]["matchLabels"], pod_labels(d)) for d in deployments) == 2
    assert budgets[f"{RELEASE}-mi300-prefill"]["spec"]["maxUnavailable"] == "50%"


def test_a_pool_image_and_security_contexts(chart: helm.Chart) -> None:
    out = render(chart, VALUES)
    amd = out.get("Deployment", f"{RELEASE}-mi300-prefill")
    vllm = container(amd)
    assert vllm["image"] == "rocm/vllm:rocm6.4_vllm_0.32.0"
    assert vllm["imagePullPolicy"] == "IfNotPresent"  # vllm.image's, merged under the pool's
    assert vllm["resources"]["limits"]["amd.com/gpu"] == 1
    # the pool's contexts merged key by key over poolDefaults' hardened ones: IPC_LOCK added back after ALL dropped
    assert vllm["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    assert pod_spec(amd)["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}, "fsGroup": 1000}
    # the other real pools: the shared vllm.image, poolDefaults' contexts
    other = out.get("Deployment", f"{RELEASE}-l4")
    assert container(other)["image"] == "vllm/vllm-openai:v0.32.0"
    assert container(other)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod_spec(other)["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    # a simulated pool runs the Mosaic image whatever its `image` says
    assert container(out.get("Deployment", f"{RELEASE}-sim"))["image"].startswith(
        "ghcr.io/mosaic-serve/mosaic:"
    )


@pytest.mark.parametrize("kube", ["1.27.0", kubernetes_validate.utils.latest_version()])
def test_the_budgets_validate(chart: helm.Chart, kube: str) -> None:
    for budget in render(chart, VALUES).of_kind("PodDisruptionBudget"):
        kubernetes_validate.validate(budget, kube, strict=True)


@pytest.mark.parametrize(
    ("pool", "field"),
    [
        ({"pdb": {"maxUnavailable": -1}}, "maxUnavailable"),
        ({"pdb": {"maxUnavailable": "half"}}, "maxUnavailable"),
        ({"pdb": {"minAvailable": 1}}, "minAvailable"),
        ({"image": {"repository": ""}}, "repository"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ],
)
def test_bad_pool_values_are_refused_by_the_schema(
    chart: helm.Chart, pool: dict[str, Any], field: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema({"pools": [{"name": "p", "model": "llama-3-8b", "gpu": "L4", **pool}]})
    assert field in str(caught.value)
