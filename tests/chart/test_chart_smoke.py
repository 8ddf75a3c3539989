"""End to end on loopback, without a cluster: run exactly the commands the chart's simulated pods run (the
`mosaic worker` arguments of simulated-fleet.yaml) and the gateway on the ConfigMap's config and the
Secret's key, then send requests through the gateway.

The one change from what a cluster would see is discovery: each pool's `endpoints.kubernetes` (which needs
an API server) is replaced by `endpoints.static` with the URL of the worker process started for it.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import pytest
import yaml

from tests.chart.chartkit import EXAMPLES_DIR, RELEASE, container, load_values, render

MOSAIC = str(Path(sys.executable).with_name("mosaic"))
STARTUP_S = 90.0  # generous: CI machines are shared and two processes start cold


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback(args: list[str], port: int) -> list[str]:
    """The pod's arguments with the listen address moved from 0.0.0.0:8000 to 127.0.0.1:<port>."""
    out = list(args)
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(port)
    return out


@contextmanager
def _process(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen([MOSAIC, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{url} exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    pytest.fail(f"{url} not ready within {STARTUP_S} s: {log.read_text()[-2000:]}")


@pytest.fixture
def fleet(chart: helm.Chart, tmp_path: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(gateway URL, API key, rendered config) with every simulated pool of simulated-fleet.yaml running."""
    values = load_values(EXAMPLES_DIR / "simulated-fleet.yaml")
    values["simulator"] = {"timeScale": 20.0}  # 20× real time: the smoke test takes seconds
    rendered = render(chart, values)
    config = rendered.config()
    key = base64.b64decode(rendered.get("Secret", f"{RELEASE}-api-keys")["data"]["api-keys"]).decode()
    with ExitStack() as stack:
        workers = []
        for pool in config["pools"]:
            dep = rendered.get("Deployment", f"{RELEASE}-{pool['name']}")
            port = _free_port()
            log = tmp_path / f"{pool['name']}.log"
            args = _loopback([str(a) for a in container(dep)["args"]], port)
            workers.append((f"http://127.0.0.1:{port}", stack.enter_context(_process(args, log)), log))
            pool["endpoints"] = {"static": [f"http://127.0.0.1:{port}"]}

        # The gateway starts alongside the workers (as pods do); with the strict readiness setting /ready
        # waits until every model has a ready worker (the chart's default only waits for discovery).
        config["readiness"] = {"require_all_models": True}
        config_path = tmp_path / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        gateway = rendered.get("Deployment", f"{RELEASE}-gateway")
        port = _free_port()
        args = _loopback([str(a) for a in container(gateway)["args"]], port)
        args[args.index("--config") + 1] = str(config_path)
        env = {**os.environ, "MOSAIC_API_KEYS": key}  # what the pod's secretKeyRef provides
        log = tmp_path / "gateway.log"
        proc = stack.enter_context(_process(args, log, env))
        url = f"http://127.0.0.1:{port}"
        for worker_url, worker_proc, worker_log in workers:
            _wait_ready(f"{worker_url}/health", worker_proc, worker_log)
        _wait_ready(f"{url}/ready", proc, log)
        yield url, key, config


def test_requests_flow_through_the_charts_gateway_to_its_simulated_pools(
    fleet: tuple[str, str, dict[str, Any]],
) -> None:
    url, key, config = fleet
    model = config["pools"][0]["model"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
    with httpx.Client(base_url=url, timeout=30.0) as client:
        denied = client.post("/v1/chat/completions", json=body)
        assert denied.status_code == 401, denied.text  # the generated key is enforced
        assert set(denied.json()["error"]) >= {"message", "type", "code"}
        headers = {"Authorization": f"Bearer {key}"}
        models = client.get("/v1/models", headers=headers).json()
        assert model in {m["id"] for m in models["data"]}
        for prompt_words in (
            3,
            400,
        ):  # short (mixed or decode-only) and long enough for the P/D threshold (256)
            body["messages"][0]["content"] = " ".join(["hello"] * prompt_words)
            reply = client.post("/v1/chat/completions", json=body, headers=headers)
            assert reply.status_code == 200, reply.text
            data = reply.json()
            assert data["model"] == model and data["usage"]["completion_tokens"] >= 1
        metrics = client.get("/metrics").text
        assert 'mosaic_requests_total{model="' in metrics


def test_the_helm_test_pods_script_passes_against_the_charts_gateway(
    chart: helm.Chart, fleet: tuple[str, str, dict[str, Any]]
) -> None:
    """`helm test`'s Pod (templates/tests/gateway-test.yaml), its script run as the Pod would run it, with
    the Service URL replaced by the loopback gateway's and the Secret's key as its secretKeyRef provides it."""
    url, key, _ = fleet
    values = load_values(EXAMPLES_DIR / "simulated-fleet.yaml")
    (c,) = render(chart, values).get("Pod", f"{RELEASE}-gateway-test")["spec"]["containers"]
    assert c["command"][:2] == ["python", "-c"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert set(env) == {"MOSAIC_URL", "MOSAIC_MODELS", "MOSAIC_API_KEYS"}

    def run(api_keys: str) -> subprocess.CompletedProcess[str]:
        pod_env = {**os.environ, "MOSAIC_URL": url, "MOSAIC_MODELS": str(env["MOSAIC_MODELS"])}
        pod_env["MOSAIC_API_KEYS"] = api_keys
        return subprocess.run(
            [sys.executable, "-c", c["command"][2]], env=pod_env, capture_output=True, text=True, timeout=60
        )

    passed = run(key)
    assert passed.returncode == 0, passed.stderr
    assert f"ok {url}/ready: 200" in passed.stdout
    assert f"ok {url}/v1/models without a key: 401" in passed.stdout
    failed = run("not-a-key")  # a key the gateway does not know: the test fails, saying why
    assert failed.returncode == 1 and f"FAIL {url}/v1/models: 401" in failed.stderr
