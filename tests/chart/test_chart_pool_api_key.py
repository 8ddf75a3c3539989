"""`pools[].apiKey`: a pool whose vLLM servers require a key (`vllm serve --api-key`, read from VLLM_API_KEY)
gets it from a Secret on every vLLM container of the pool (per-domain Deployments included), and the gateway
gets the same Secret key under the variable the config's `api_key_env` names, which Mosaic turns into the
`Authorization: Bearer` header it sends that pool (server/dispatch.py `worker_auth_headers`). The controller
gets none: it sends workers no requests, and `mosaic autoscale` ignores api_key_env
(tests/autoscaling/test_autoscale_cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from server.config import ConfigError
from server.dispatch import worker_auth_headers
from tests.chart.chartkit import RELEASE, Rendered, container, env_map, render

RACK = "example.com/rack"
SECRETS = {
    ("vllm-keys", "prefill"): "pk-123",
    ("vllm-keys", "decode"): "dk-456",
    ("shared", "api-key"): "sk-789",
}
VALUES: dict[str, Any] = {
    "gateway": {"discovery": {"domainLabel": RACK}},
    "pools": [
        {
            "name": "h100-prefill",
            "model": "llama-3-8b",
            "gpu": "H100-SXM",
            "role": "prefill",
            "apiKey": {"existingSecret": "vllm-keys", "key": "prefill"},
        },
        {
            "name": "a100-decode",
            "model": "llama-3-8b",
            "gpu": "A100-80GB",
            "role": "decode",
            "replicas": 2,
            "domains": ["rack-1", "rack-2"],
            "apiKey": {"existingSecret": "vllm-keys", "key": "decode"},
        },
        {"name": "l4", "model": "llama-3-8b", "gpu": "L4"},  # no key: vLLM open, nothing sent
    ],
}
KEYED = {"h100-prefill": "MOSAIC_POOL_H100_PREFILL_API_KEY", "a100-decode": "MOSAIC_POOL_A100_DECODE_API_KEY"}


def _ref(entry: dict[str, Any]) -> tuple[str, str]:
    ref = entry["valueFrom"]["secretKeyRef"]
    assert "optional" not in ref  # a missing Secret keeps the pod from starting rather than running keyless
    return ref["name"], ref["key"]


def _pod_env(c: dict[str, Any]) -> dict[str, str]:
    """The worker keys the kubelet would set from the Secrets in SECRETS (the clients' keys left out)."""
    keys = [
        e for e in c.get("env") or [] if e["name"] == "VLLM_API_KEY" or e["name"].startswith("MOSAIC_POOL_")
    ]
    return {e["name"]: SECRETS[_ref(e)] for e in keys}


def _rendered(chart: helm.Chart, values: dict[str, Any] = VALUES) -> Rendered:
    return render(chart, values)


def test_every_vllm_container_of_a_keyed_pool_reads_the_key_from_its_secret(chart: helm.Chart) -> None:
    rendered = _rendered(chart)
    expected = {"h100-prefill": ("vllm-keys", "prefill"), "a100-decode": ("vllm-keys", "decode")}
    for pool, ref in expected.items():
        deps = rendered.deployments_of_pool(pool)
        assert len(deps) == (2 if pool == "a100-decode" else 1)  # the per-domain Deployments, each
        for dep in deps:
            c = container(dep)
            assert c["name"] == "vllm"
            assert _ref(env_map(c)["VLLM_API_KEY"]) == ref
            # the env, not --api-key: the key stays off the command line (visible in the pod spec and ps)
            assert not any("api-key" in str(a) for a in c["args"])
    (open_pool,) = rendered.deployments_of_pool("l4")
    assert "VLLM_API_KEY" not in env_map(container(open_pool))


def test_the_gateway_gets_each_key_under_the_name_its_config_carries(
    chart: helm.Chart, tmp_path: Path
) -> None:
    rendered = _rendered(chart)
    config = rendered.load_config(tmp_path)  # Mosaic's own loader
    assert {p.name: p.api_key_env for p in config.pools} == {**KEYED, "l4": None}
    gateway = container(rendered.get("Deployment", f"{RELEASE}-gateway"))
    env = env_map(gateway)
    assert _ref(env[KEYED["h100-prefill"]]) == ("vllm-keys", "prefill")
    assert _ref(env[KEYED["a100-decode"]]) == ("vllm-keys", "decode")
    assert not [n for n in env if n.startswith("MOSAIC_POOL_") and n not in KEYED.values()]


def test_the_pods_env_makes_the_headers_each_vllm_pool_expects(
    chart: helm.Chart, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end over the names: the variables the gateway's pod spec sets from the Secrets are the ones
    the config names, and Mosaic sends each pool the key its vLLM containers got; the controller has none."""
    rendered = _rendered(chart)
    config = rendered.load_config(tmp_path)
    for name in KEYED.values():
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="MOSAIC_POOL_H100_PREFILL_API_KEY is unset"):
        worker_auth_headers(config)  # what a pod without the variables would do: exit 2 at start
    controller_env = _pod_env(container(rendered.get("Deployment", f"{RELEASE}-controller")))
    assert not [n for n in controller_env if n.startswith("MOSAIC_POOL_") or n == "VLLM_API_KEY"]
    for name, value in _pod_env(container(rendered.get("Deployment", f"{RELEASE}-gateway"))).items():
        monkeypatch.setenv(name, value)
    vllm_keys = {
        pool: _pod_env(container(dep))["VLLM_API_KEY"]
        for pool in KEYED
        for dep in rendered.deployments_of_pool(pool)
    }
    assert worker_auth_headers(config) == {
        pool: (b"authorization", f"Bearer {key}".encode()) for pool, key in vllm_keys.items()
    }


def test_no_keyed_pool_renders_no_key_anywhere(chart: helm.Chart, tmp_path: Path) -> None:
    rendered = render(chart, {})
    assert all(p.api_key_env is None for p in rendered.load_config(tmp_path).pools)
    for dep in rendered.of_kind("Deployment"):
        assert not [n for n in env_map(container(dep)) if n == "VLLM_API_KEY" or n.startswith("MOSAIC_POOL_")]


def test_pool_defaults_key_every_pool_and_a_pool_can_opt_out(chart: helm.Chart, tmp_path: Path) -> None:
    values = {
        "poolDefaults": {"apiKey": {"existingSecret": "shared"}},
        "pools": [
            {"name": "a", "model": "llama-3-8b", "gpu": "L4"},
            {"name": "b", "model": "llama-3-8b", "gpu": "L4", "apiKey": {"existingSecret": ""}},
        ],
    }
    rendered = render(chart, values)
    assert {p.name: p.api_key_env for p in rendered.load_config(tmp_path).pools} == {
        "a": "MOSAIC_POOL_A_API_KEY",
        "b": None,
    }
    assert _ref(env_map(container(rendered.get("Deployment", f"{RELEASE}-a")))["VLLM_API_KEY"]) == (
        "shared",
        "api-key",  # the default key name
    )
    assert "VLLM_API_KEY" not in env_map(container(rendered.get("Deployment", f"{RELEASE}-b")))


def test_simulated_workers_get_no_key_but_the_gateway_still_sends_it(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """`mosaic worker` checks no key (like the HF token, nothing it would not use is rendered for it); the
    gateway is configured as for vLLM, so switching `simulated` off needs no other change."""
    values = {
        "simulated": True,
        "pools": [{"name": "l4", "model": "llama-3-8b", "gpu": "L4", "apiKey": {"existingSecret": "shared"}}],
    }
    rendered = render(chart, values)
    worker = container(rendered.get("Deployment", f"{RELEASE}-l4"))
    assert worker["name"] == "worker" and "VLLM_API_KEY" not in env_map(worker)
    assert rendered.load_config(tmp_path).pools[0].api_key_env == "MOSAIC_POOL_L4_API_KEY"
    env = env_map(container(rendered.get("Deployment", f"{RELEASE}-gateway")))
    assert _ref(env["MOSAIC_POOL_L4_API_KEY"]) == ("shared", "api-key")


def test_keyed_objects_are_valid_for_the_api(chart: helm.Chart) -> None:
    for obj in _rendered(chart).of_kind("Deployment"):
        kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)


@pytest.mark.parametrize(
    ("api_key", "message"),
    [
        pytest.param("vllm-keys", "at '/pools/0/apiKey': got string, want object", id="a bare Secret name"),
        pytest.param(
            {"name": "vllm-keys", "key": "decode"},
            "additional properties 'name' not allowed",
            id="name instead of existingSecret",
        ),
        pytest.param(
            {"existingSecret": "vllm-keys", "key": "decode key"},
            "at '/pools/0/apiKey/key': 'decode key' does not match pattern",
            id="a key Kubernetes refuses",
        ),
        pytest.param(
            {"existingSecret": "VLLM_Keys"},
            "at '/pools/0/apiKey/existingSecret': 'VLLM_Keys' does not match pattern",
            id="a Secret name that is no DNS subdomain",
        ),
        pytest.param({"existingSecret": "vllm-keys", "key": ""}, "at '/pools/0/apiKey/key'", id="empty key"),
    ],
)
def test_schema_refuses_a_bad_api_key(chart: helm.Chart, api_key: object, message: str) -> None:
    values = {"pools": [{"name": "l4", "model": "llama-3-8b", "gpu": "L4", "apiKey": api_key}]}
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert message in str(caught.value)
