"""`mosaic autoscale`: bad input exits 2 with one line; a dry-run controller over a real simulated worker prints
its decisions as JSON lines; the chart's controller gets a pool → Deployment mapping its RBAC allows."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from typer.testing import CliRunner

from server.cli import build_app
from server.config import load_config
from simulator.worker_app import WorkerConfig
from simulator.worker_server import RunningWorker, start_worker_server
from tests.chart.chartkit import CHART_DIR, EXAMPLES_DIR, NAMESPACE, RELEASE, load_values, render

ROOT = Path(__file__).resolve().parents[2]
SIM_POOL = {"name": "l4", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"simulated": {"replicas": 1}}}


def _write(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "mosaic.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _static(autoscaler: dict[str, Any], **pool: Any) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "l4",
                "model": "llama-3-8b",
                "gpu": "L4",
                "endpoints": {"static": ["http://127.0.0.1:9"]},
                **pool,
            }
        ],
        "autoscaler": autoscaler,
    }


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param(None, "cannot read config file", id="missing config file"),
        pytest.param(
            {"pools": [SIM_POOL], "autoscaler": {"actuator": "embedded"}},
            "mosaic autoscale needs kubernetes or dry-run",
            id="the embedded actuator belongs to mosaic serve",
        ),
        pytest.param(
            {"pools": [SIM_POOL]},
            "mosaic.yaml: no autoscaler section: mosaic autoscale needs one with actuator kubernetes or dry-run",
            id="no autoscaler section: said so, not blamed on an actuator never written",
        ),
        pytest.param(
            _static({"policy": "hpa-utl"}),
            "autoscaler.policy: unknown policy 'hpa-utl'",
            id="misspelt policy names the field and the valid ones",
        ),
        pytest.param(
            _static({"knobs": {"utilisation_target": 0.5}}),
            "unknown knob 'utilisation_target'",
            id="unknown policy knob",
        ),
        pytest.param(
            _static({"actuator": "kubernetes"}),
            "no pool to scale",
            id="kubernetes actuator with no Deployment to scale",
        ),
        pytest.param(
            _static({"actuator": "kubernetes", "kubernetes": {"deployments": {"l4": "mosaic-l4"}}}),
            "cannot load Kubernetes config",
            id="kubernetes actuator outside a cluster, no kubeconfig",
        ),
        pytest.param(
            _static({"actuator": "dry-run", "nodes": {"nodes": [{"name": "h1", "gpu": "B200", "gpus": 8}]}}),
            "autoscaler.nodes: nodes[0] (h1): GPU 'B200' is neither in the catalog nor offered (L4)",
            id="a node GPU neither in the catalog nor run by a pool: a typo, not a shortage (exited 0)",
        ),
        pytest.param(
            {**_static({"actuator": "dry-run"}), "slo": {"tpot_ms": 1}},
            "cannot decode llama-3-8b within TPOT 1 ms: one sequence's decode step takes",
            id="a pool that cannot meet the TPOT SLO at all",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path: Path, config: dict[str, Any] | None, message: str) -> None:
    path = "/nonexistent/mosaic.yaml" if config is None else _write(tmp_path, config)
    result = CliRunner().invoke(
        build_app(), ["autoscale", "--config", path], env={"KUBECONFIG": "/nonexistent"}
    )
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


@pytest.fixture
def worker() -> Iterator[RunningWorker]:
    """A simulated vLLM worker on 127.0.0.1 served from a background event loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = WorkerConfig(gpu="L4", model="llama-3-8b", time_scale=50)
    running = asyncio.run_coroutine_threadsafe(start_worker_server(cfg), loop).result(30)
    try:
        yield running
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_dry_run_controller_prints_each_decision(tmp_path: Path, worker: RunningWorker) -> None:
    path = _write(
        tmp_path,
        _static(
            {"actuator": "dry-run", "policy": "static:l4=2", "interval_s": 0.2},
            endpoints={"static": [worker.url]},
        ),
    )
    mosaic = ROOT / ".venv" / "bin" / "mosaic"
    cmd = [str(mosaic)] if mosaic.exists() else [sys.executable, "-m", "server.cli"]
    proc = subprocess.run(
        [*cmd, "autoscale", "--config", path, "--cycles", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    decisions = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [d["targets"] for d in decisions] == [{"l4": 2}, {"l4": 2}]
    # cycle 1: the worker is up (1) and the static policy wants 2 → recorded, not applied; cycle 2: nothing new
    assert [(a["before"], a["after"], a["applied"]) for a in decisions[0]["actions"]] == [(1, 2, False)]
    assert decisions[1]["actions"] == []
    # the full record: what the policy observed, admission queue included (empty: no gateway scraped)
    assert decisions[0]["observation"]["pools"]["l4"]["ready"] == 1
    assert decisions[0]["observation"]["admission_queue"] == {}
    assert "placement" not in decisions[0]  # no node inventory configured
    assert "mosaic autoscale: policy static:l4=2, actuator dry-run" in proc.stderr


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.mark.parametrize("values_file", [None, "heterogeneous-pd.yaml", "multi-model.yaml"])
def test_chart_maps_every_pool_to_a_deployment_the_controller_may_scale(
    chart: helm.Chart, values_file: str | None, tmp_path: Path
) -> None:
    rendered = render(chart, load_values(EXAMPLES_DIR / values_file) if values_file else {})
    config = rendered.config()
    scaler = config["autoscaler"]
    assert scaler["actuator"] == "kubernetes"
    assert scaler["kubernetes"]["namespace"] == NAMESPACE
    mapping = scaler["kubernetes"]["deployments"]
    assert set(mapping) == {p["name"] for p in config["pools"]}
    deployments = {d["metadata"]["name"] for d in rendered.pool_deployments()}
    assert set(mapping.values()) == deployments
    assert all(name == f"{RELEASE}-{pool}" for pool, name in mapping.items())
    role = rendered.get("Role", f"{RELEASE}-controller")
    scale_rule = next(r for r in role["rules"] if r["resources"] == ["deployments/scale"])
    assert set(scale_rule["resourceNames"]) == deployments and set(scale_rule["verbs"]) == {"get", "patch"}
    for name, text in rendered.get("ConfigMap", f"{RELEASE}-config")["data"].items():  # as the pod mounts it
        (tmp_path / name).write_text(text.replace("/etc/mosaic/", f"{tmp_path}/"))
    assert load_config(tmp_path / "config.yaml").autoscaler.kubernetes.deployments == mapping


def test_chart_keeps_the_users_autoscaler_settings(chart: helm.Chart) -> None:
    user = {"policy": "hpa-waiting:4", "interval_s": 10, "actuator": "dry-run", "knobs": {"pd_ratio": 0.3}}
    scaler = render(chart, {"config": {"autoscaler": user}}).config()["autoscaler"]
    assert {k: scaler[k] for k in user} == user  # a dry run on the cluster stays a dry run
    assert scaler["kubernetes"]["deployments"]


def test_kubernetes_controller_patches_deployments_in_the_pod_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from server.commands.autoscale import _run
    from tests.autoscaling.test_controller import FakeAppsApi

    monkeypatch.setenv("POD_NAMESPACE", "llm")
    cfg = load_config(
        _write(
            tmp_path,
            _static(
                {
                    "actuator": "kubernetes",
                    "policy": "static:l4=2",
                    "interval_s": 0.05,
                    "kubernetes": {"deployments": {"l4": "mosaic-l4"}},
                }
            ),
        )
    )
    api = FakeAppsApi(replicas=1)
    asyncio.run(_run(cfg, 2, True, api))
    assert ("patch", "mosaic-l4", "llm", {"spec": {"replicas": 2}}) in api.calls
    assert sum(c[0] == "patch" for c in api.calls) == 1  # the second cycle reads 2 and leaves it
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(a["before"], a["after"], a["applied"]) for a in lines[0]["actions"]] == [(1, 2, True)]


def test_controller_needs_no_vllm_key_and_no_api_key(tmp_path: Path, worker: RunningWorker) -> None:
    # the pool's workers want a key the controller's environment does not have: it only reads /health and
    # /metrics (which vLLM does not guard), so it starts and decides (mosaic serve would exit 2 here); and
    # the gateway's API keys (auth.api_keys_env, which the chart's shared config always names) are not in
    # its environment either: it serves no API (it exited 2 there, so the chart's controller crash-looped)
    config = _static(
        {"actuator": "dry-run", "policy": "static:l4=2", "interval_s": 0.2},
        endpoints={"static": [worker.url]},
        api_key_env="MOSAIC_TEST_KEY_NOBODY_SET",
    )
    config["auth"] = {
        "api_keys_env": "MOSAIC_TEST_API_KEYS_UNSET",
        "admin_keys_env": "MOSAIC_TEST_ADMIN_UNSET",
    }
    path = _write(tmp_path, config)
    mosaic = ROOT / ".venv" / "bin" / "mosaic"
    cmd = [str(mosaic)] if mosaic.exists() else [sys.executable, "-m", "server.cli"]
    unset = {"MOSAIC_TEST_KEY_NOBODY_SET", "MOSAIC_TEST_API_KEYS_UNSET", "MOSAIC_TEST_ADMIN_UNSET"}
    env = {k: v for k, v in os.environ.items() if k not in unset}
    proc = subprocess.run(
        [*cmd, "autoscale", "--config", path, "--cycles", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    (decision,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert decision["observation"]["pools"]["l4"]["ready"] == 1  # it scraped the worker
