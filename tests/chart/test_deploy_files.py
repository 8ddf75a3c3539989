"""deploy/: the compose file, Prometheus config, Grafana provisioning and Dockerfile agree with each other and
with Mosaic (configs parse with its loader, commands with its CLI, pins satisfy pyproject). No Docker daemon
is needed: these are the checks that catch a renamed service, a missing file or a stale pin.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from placement.catalog import load_catalog
from server.config import load_config
from tests.chart.chartkit import CHART_DIR, REPO_ROOT, parse_mosaic_args

DEPLOY = REPO_ROOT / "deploy"
CATALOG = load_catalog()


def _compose() -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _services(profile: str | None = None) -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = _compose()["services"]
    if profile is None:
        return services
    return {n: s for n, s in services.items() if profile in s.get("profiles", [])}


def _bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((DEPLOY / source).resolve(), target))
    return mounts


def _gateway_config(service: dict[str, Any]) -> Path:
    return next(src for src, target in _bind_mounts(service) if target == "/etc/mosaic/config.yaml")


def test_profiles_split_simulated_and_gpu_services() -> None:
    assert set(_services("sim")) == {"gateway-sim", "sim-h100-prefill", "sim-a100-decode", "sim-l4-mixed"}
    assert set(_services("gpu")) == {"gateway", "vllm-prefill", "vllm-decode"}
    unprofiled = {n for n, s in _services().items() if not s.get("profiles")}
    assert unprofiled == {"prometheus", "grafana"}
    for name, service in _services().items():
        assert ":" in service["image"] and not service["image"].endswith(":latest"), (
            f"{name}: pin the image tag"
        )


def test_every_bind_mount_exists() -> None:
    for name, service in _services().items():
        for source, _ in _bind_mounts(service):
            assert source.exists(), f"{name}: {source} does not exist"


@pytest.mark.parametrize("gateway", ["gateway-sim", "gateway"])
def test_gateway_configs_parse_and_point_at_services_of_their_profile(gateway: str) -> None:
    service = _services()[gateway]
    (profile,) = service["profiles"]
    config = load_config(_gateway_config(service))
    peers = _services(profile)
    for pool in config.pools:
        assert pool.endpoints.static, f"{pool.name}: compose pools use static URLs"
        for url in pool.endpoints.static:
            parts = urlsplit(url)
            assert parts.hostname in peers and parts.port == 8000, url
            assert parts.hostname in service["depends_on"], f"{gateway} must wait for {parts.hostname}"
    assert config.auth.api_keys_env in service["environment"]
    assert (config.gateway.host, config.gateway.port) == ("0.0.0.0", 8080) and service["ports"] == [
        "8080:8080"
    ]
    parse_mosaic_args([str(a) for a in service["command"]])


def test_simulated_workers_match_their_pools_and_parse_with_the_cli() -> None:
    config = load_config(_gateway_config(_services()["gateway-sim"]))
    commands = []
    for pool in config.pools:
        assert pool.endpoints.static is not None
        host = urlsplit(pool.endpoints.static[0]).hostname or ""
        args = [str(a) for a in _services()[host]["command"]]
        assert args[0] == "worker"
        assert args[args.index("--gpu") + 1] == pool.gpu and args[args.index("--role") + 1] == pool.role
        # The worker is timed by the catalog row the gateway sizes the pool with.
        assert CATALOG.model(args[args.index("--model") + 1]) == CATALOG.model(pool.model)
        assert args[args.index("--port") + 1] == "8000"
        assert args[args.index("--served-model-name") + 1] == pool.model
        commands.append(args)
    for args in commands:
        parse_mosaic_args(args)


def test_vllm_pair_uses_nixl_on_distinct_gpus() -> None:
    gpus = []
    for name, role in (("vllm-prefill", "kv_producer"), ("vllm-decode", "kv_consumer")):
        service = _services()[name]
        args = service["command"]
        assert json.loads(args[args.index("--kv-transfer-config") + 1]) == {
            "kv_connector": "NixlConnector",
            "kv_role": role,
        }
        assert service["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == name
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        gpus += device["device_ids"]
    assert sorted(gpus) == ["0", "1"]


def test_prometheus_scrapes_every_metrics_endpoint_and_nothing_else() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    serving = {
        f"{n}:8080" if n.startswith("gateway") else f"{n}:8000"
        for n in _services()
        if n.startswith(("gateway", "sim-", "vllm-"))
    }
    assert targets == serving
    assert _bind_mounts(_services()["prometheus"])[0] == (
        (DEPLOY / "prometheus.yml").resolve(),
        "/etc/prometheus/prometheus.yml",
    )


def test_grafana_provisions_the_charts_dashboard() -> None:
    grafana = _services()["grafana"]
    mounts = dict((target, source) for source, target in _bind_mounts(grafana))
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/mosaic.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert mounts[path] == (CHART_DIR / "dashboards").resolve()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[path] / Path(home).relative_to(path)).is_file()
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    # deploy/ keeps a link to the chart's copy, so there is one dashboard, not two that drift.
    link = DEPLOY / "grafana/dashboards/mosaic.json"
    assert link.is_symlink() and link.resolve() == (CHART_DIR / "dashboards/mosaic.json").resolve()


def _dockerfile_stages() -> list[list[str]]:
    stages: list[list[str]] = []
    for line in (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            stages.append([])
        if stages and line and not line.startswith("#"):
            stages[-1].append(line)
    return stages


def test_dockerfile_is_multi_stage_slim_and_non_root() -> None:
    stages = _dockerfile_stages()
    assert len(stages) >= 2
    for stage in stages:
        assert re.match(r"FROM python:\$\{PYTHON_VERSION\}-slim AS \w+", stage[0]), stage[0]
    runtime = stages[-1]
    users = [line.split()[1] for line in runtime if line.startswith("USER ")]
    assert users == ["10001:10001"]  # the chart's runAsUser/runAsGroup
    assert any("--from=build /opt/mosaic /opt/mosaic" in line for line in runtime)
    assert not any(line.startswith("RUN pip") or "pip install" in line for line in runtime), (
        "no installs in the runtime stage"
    )
    build = " ".join(stages[0])
    assert "pip install --requirement deploy/constraints.txt" in build and "pip check" in build
    for line in stages[0]:
        if line.startswith("COPY ") and "--from" not in line:
            for source in line.split()[1:-1]:
                assert (REPO_ROOT / source).exists(), f"COPY {source}: missing"
    assert re.search(
        r"ARG PYTHON_VERSION=3\.11\b", (DEPLOY / "Dockerfile").read_text()
    )  # the venv the pins came from


def _pins() -> dict[str, str]:
    pins = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_runtime_requirement_within_its_specifier() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = [
        Requirement(r) for r in [*project["dependencies"], *project["optional-dependencies"]["k8s"]]
    ]
    pins = _pins()
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is a runtime requirement but deploy/constraints.txt does not pin it"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{req.name}=={pins[name]} violates {req}"
        )
    assert not {"pytest", "ruff", "helm-python-sdk", "kubernetes-validate", "hypothesis"} & set(pins), (
        "dev tools leaked into the image"
    )
