"""`mosaic serve`: bad input exits 2 with one line; with no config it serves the embedded fleet, prints the
URL and a curl line that works, and drains on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from server.cli import build_app
from server.commands.serve import curl_line

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--config", "/nonexistent/mosaic.yaml"], "cannot read config file", id="missing config file"
        ),
        pytest.param(["--port", "70000"], "--port must be in 0..65535", id="port out of range"),
        pytest.param(
            ["--time-scale", "0"],
            "--time-scale must be a finite number ≥ 0.001, got 0",
            id="time scale not positive",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(build_app(), ["serve", *args])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0]


def test_invalid_config_names_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "mosaic.yaml"
    cfg.write_text("pools:\n  - {name: a, model: llama-3-8b, gpu: B200, endpoints: {static: [http://x:1]}}\n")
    result = CliRunner().invoke(build_app(), ["serve", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "pools.0.gpu: unknown GPU 'B200'" in result.output


def test_kubernetes_endpoints_without_a_cluster_config_exit_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the discovery's config load failed inside uvicorn's lifespan (traceback, exit 3)."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod either
    config = ROOT / "docs" / "examples" / "gateway" / "kubernetes.yaml"
    result = CliRunner().invoke(build_app(), ["serve", "--config", str(config), "--port", "0"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cannot load Kubernetes config for kubernetes endpoints" in lines[0]


def test_curl_line_mentions_the_key_only_when_needed() -> None:
    assert "Authorization" not in curl_line("http://h:1", "m", needs_key=False)
    keyed = curl_line("http://h:1", "m", needs_key=True).splitlines()
    assert len(keyed) == 2 and "Authorization: Bearer $MOSAIC_API_KEY" in keyed[0]
    assert keyed[1] == "# MOSAIC_API_KEY: one of the gateway's keys (mosaic replay and profile read it too)"
    assert len(curl_line("http://h:1", "m", needs_key=False).splitlines()) == 1


def test_serve_embedded_default_end_to_end() -> None:
    mosaic = ROOT / ".venv" / "bin" / "mosaic"
    cmd = [str(mosaic)] if mosaic.exists() else [sys.executable, "-m", "server.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*cmd, "serve", "--port", "0", "--time-scale", "100"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert proc.stdout is not None
        url_line = proc.stdout.readline()
        curl = proc.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+)", url_line)
        assert (
            match and "embedded simulated fleet" in url_line and "mixed-l4 (L4, mixed, 2 workers)" in url_line
        )
        url = match.group(1)
        assert curl.startswith(f"curl {url}/v1/chat/completions")
        body = re.search(r"-d '(.*)'$", curl.strip())
        assert body is not None
        r = httpx.post(
            f"{url}/v1/chat/completions",
            content=body.group(1),
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        # uvicorn drains, then re-raises the signal so supervisors see a SIGTERM exit (its default behaviour)
        assert proc.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
