"""`mosaic worker`: bad input exits 2 with one line naming the valid choices; a real process serves and stops."""

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
import typer
from typer.testing import CliRunner

from server.commands import worker as worker_command
from server.vllm_launcher import build_command
from simulator.lora import LoraModule
from simulator.worker_app import WorkerConfig

H100 = ["--gpu", "H100", "--model", "llama-3-8b"]


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # keeps `worker` a sub-command, as under `mosaic`
        pass

    worker_command.register(app)
    return app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--gpu", "B300", "--model", "llama-3-8b"], "valid GPUs: T4, A10G", id="unknown GPU → valid GPUs"),
        pytest.param(["--gpu", "H100", "--model", "gpt-9"], "valid models: llama-2-7b", id="unknown model → valid models"),
        pytest.param(["--gpu", "T4", "--model", "llama-3-8b"], "does not fit", id="model larger than the GPU → refused"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--role", "both"], "--role must be one of",
                     id="unknown role"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--max-num-seqs", "512", "--max-num-batched-tokens",
                      "256"], "max_num_batched_tokens (256) must be ≥ max_num_seqs (512)", id="budget under seqs"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--time-scale", "0"],
                     "time_scale must be a finite number ≥ 0.001 (at most 1000× slower than real time), got 0", id="time scale 0"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--time-scale", "inf"],
                     "time_scale must be a finite number ≥ 0.001 (at most 1000× slower than real time), got inf", id="time scale inf (froze the clock)"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--error-rate", "1.5"], "error_rate must be in [0, 1]",
                     id="error rate over 1"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--num-gpu-blocks", "4", "--max-model-len", "100"],
                     "exceeds the KV cache capacity", id="max_model_len over the KV capacity"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--max-model-len", "100000"],
                     "User-specified max_model_len (100000) is greater than the derived max_model_len "
                     "(max_position_embeddings=8192 or model_max_length=None in model's config.json). To allow "
                     "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",
                     id="max_model_len past the model's context (vLLM's start-up refusal)"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--data-parallel-size", "0"],
                     "data_parallel_size must be an integer ≥ 1, got 0", id="no engine"),
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b", "--tp", "0"],
                     "tp must be an integer ≥ 1, got 0", id="tp 0 (was a ZeroDivisionError traceback)"),
        pytest.param([*H100, "--lora-modules", "{bad"], "Invalid JSON format for --lora-modules: {bad",
                     id="LoRA module neither name=path nor JSON (vLLM's words)"),
        pytest.param([*H100, "--lora-modules", '{"name": "a", "url": "/p"}'],
                     "Invalid fields for --lora-modules: {\"name\": \"a\", \"url\": \"/p\"} - ",
                     id="LoRA module JSON with an unknown field"),
        pytest.param([*H100, "--lora-modules"], "argument --lora-modules: expected at least one argument",
                     id="--lora-modules without a module"),
        pytest.param([*H100, "--lora-modules", "a=/p", "a=/q"], "The lora adapter 'a' has already been loaded.",
                     id="one adapter name twice"),
        pytest.param([*H100, "--lora-modules", "llama-3-8b=/p"],
                     "The lora adapter 'llama-3-8b' conflicts with a served base model.", id="adapter named as the base model"),
        pytest.param([*H100, "--lora-modules", "a=/p", "--max-loras", "0"], "max_loras must be an integer ≥ 1, got 0",
                     id="max_loras 0"),
        pytest.param([*H100, "--max-loras", "two"], "argument --max-loras: invalid int value: 'two'",
                     id="max_loras not a number"),
        pytest.param([*H100, "--no-enable-lora", "--lora-modules", "a=/p"],
                     "LoRA is not enabled. Use --enable-lora to enable LoRA.", id="adapters with LoRA turned off"),
        pytest.param([*H100, "--lora-modules", "a=/p", "--foo"],
                     "unexpected arguments: --foo (only --engine vllm passes extra args on)", id="LoRA flags and an unknown one"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(app: typer.Typer, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["worker", *args])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_data_parallel_size_goes_to_a_real_vllm_under_its_own_name(
    app: typer.Typer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--engine vllm --data-parallel-size 2` is vLLM's flag too: forwarded, not dropped, and the GPUs listed are
    the engines' together."""
    from server import vllm_worker

    specs: list[object] = []
    monkeypatch.setattr(vllm_worker, "run_foreground", lambda spec, echo: specs.append(spec) or 0)
    result = CliRunner().invoke(
        app, ["worker", "--engine", "vllm", "--model", "m", "--data-parallel-size", "2", "--gpu-ids", "0,1"]
    )
    assert result.exit_code == 0, result.output
    (spec,) = specs
    assert build_command(spec)[7:] == ["--tensor-parallel-size", "1", "--data-parallel-size", "2"]  # type: ignore[arg-type]
    assert spec.gpu_ids == ("0", "1")  # type: ignore[attr-defined]


@pytest.mark.parametrize("gpu_ids", [[], ["--gpu-ids", "0,1"]], ids=["no GPU ids", "with GPU ids"])
def test_no_engine_for_a_real_vllm_exits_2(
    app: typer.Typer, monkeypatch: pytest.MonkeyPatch, gpu_ids: list[str]
) -> None:
    """`--engine vllm --data-parallel-size 0` is refused as the simulated worker refuses it (it ran one engine)."""
    from server import vllm_worker

    monkeypatch.setattr(vllm_worker, "run_foreground", lambda spec, echo: pytest.fail("started vLLM"))
    result = CliRunner().invoke(
        app, ["worker", "--engine", "vllm", "--model", "m", "--data-parallel-size", "0", *gpu_ids]
    )
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert lines == ["error: --data-parallel-size must be ≥ 1, got 0"], result.output


@pytest.mark.parametrize(
    ("args", "modules", "max_loras", "enabled"),
    [
        pytest.param(["--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "x"}',
                      "--max-loras", "2"],
                     (LoraModule("sql", "/a/sql"), LoraModule("chat", "/a/chat", "x")), 2, False,
                     id="name=path and JSON items after one flag, then --max-loras"),
        pytest.param(["--lora-modules", "a=/p", "--lora-modules", "b=/q"], (LoraModule("b", "/q"),), 1, False,
                     id="a later --lora-modules replaces the earlier one, as vLLM's argparse action does"),
        pytest.param(["--lora-modules", "a=/x=y"], (LoraModule("a", "/x=y"),), 1, False,
                     id="name=path splits at the first ="),
        pytest.param(["--enable-lora", "--lora-modules", "a=/p", ""], (LoraModule("a", "/p"),), 1, True,
                     id="--enable-lora accepted, an empty item skipped"),
        pytest.param(["--enable-lora"], (), 1, True, id="--enable-lora alone: LoRA on with no adapter"),
    ],
)  # fmt: skip
def test_lora_flags_reach_the_simulated_worker(
    app: typer.Typer,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    modules: tuple[LoraModule, ...],
    max_loras: int,
    enabled: bool,
) -> None:
    configs: list[WorkerConfig] = []

    async def serve(cfg: WorkerConfig, host: str, port: int, log_level: str) -> None:
        configs.append(cfg)

    monkeypatch.setattr(worker_command, "serve_simulated", serve)
    result = CliRunner().invoke(app, ["worker", *H100, "--port", "0", *args])
    assert result.exit_code == 0, result.output
    (cfg,) = configs
    assert (cfg.lora_modules, cfg.engine.max_loras, cfg.enable_lora) == (modules, max_loras, enabled)


@pytest.mark.parametrize(
    ("args", "env", "on"),
    [
        pytest.param([], None, False, id="off by default"),
        pytest.param(["--allow-runtime-lora-updating"], None, True, id="the simulator's flag"),
        pytest.param([], "true", True, id="vLLM's variable: true"),
        pytest.param([], "1", True, id="vLLM's variable: 1"),
        pytest.param([], "yes", False, id="vLLM's variable: yes is not true to vLLM"),
        pytest.param(["--allow-runtime-lora-updating"], "0", True, id="the flag whatever the variable"),
    ],
)
def test_runtime_lora_updating_from_the_flag_or_vllms_variable(
    app: typer.Typer, monkeypatch: pytest.MonkeyPatch, args: list[str], env: str | None, on: bool
) -> None:
    configs: list[WorkerConfig] = []

    async def serve(cfg: WorkerConfig, host: str, port: int, log_level: str) -> None:
        configs.append(cfg)

    monkeypatch.setattr(worker_command, "serve_simulated", serve)
    if env is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)
    result = CliRunner().invoke(app, ["worker", *H100, "--port", "0", "--enable-lora", *args])
    assert result.exit_code == 0, result.output
    (cfg,) = configs
    assert cfg.allow_runtime_lora_updating is on
    assert cfg.enable_lora  # given, not implied: as in vLLM the variable does not turn LoRA on


def test_the_runtime_lora_flag_is_refused_for_a_real_vllm(app: typer.Typer) -> None:
    """vLLM has no such flag (only its variable, which the foreground vLLM inherits): refused, not dropped."""
    result = CliRunner().invoke(
        app, ["worker", "--engine", "vllm", "--model", "m", "--allow-runtime-lora-updating"]
    )
    assert result.exit_code == 2, result.output
    assert "--allow-runtime-lora-updating: simulated worker only" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--gpu-ids", "0"], "error: --gpu-ids: --engine vllm only", id="--gpu-ids"),
        pytest.param(
            ["--vllm-command", "vllm serve"], "error: --vllm-command: --engine vllm only", id="command"
        ),
    ],
)
def test_vllm_only_flags_are_refused_for_the_simulated_worker(
    app: typer.Typer, args: list[str], message: str
) -> None:
    """Ignored before, as the simulated worker has no use for them: refused like the reverse case."""
    result = CliRunner().invoke(app, ["worker", *H100, "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith(message), result.output


def test_an_empty_vllm_command_is_refused_not_replaced(app: typer.Typer) -> None:
    result = CliRunner().invoke(app, ["worker", "--engine", "vllm", "--model", "m", "--vllm-command", ""])
    assert result.exit_code == 2, result.output
    assert "--vllm-command must not be empty" in result.output


@pytest.mark.parametrize(
    ("args", "tail"),
    [
        pytest.param(["--lora-modules", "a=/p", "b=/q", "--max-loras", "2"],
                     ["--enable-lora", "--lora-modules", "a=/p", "b=/q", "--max-loras", "2"],
                     id="adapters: --enable-lora added, the LoRA flags passed as given"),
        pytest.param(["--", "--enable-lora", "--lora-modules", "a=/p"], ["--enable-lora", "--lora-modules", "a=/p"],
                     id="--enable-lora given after --: not added twice"),
        pytest.param(["--max-loras", "2"], ["--max-loras", "2"], id="no adapters: nothing added"),
    ],
)  # fmt: skip
def test_lora_flags_go_to_a_real_vllm_with_lora_enabled(
    app: typer.Typer, monkeypatch: pytest.MonkeyPatch, args: list[str], tail: list[str]
) -> None:
    from server import vllm_worker

    specs: list[object] = []
    monkeypatch.setattr(vllm_worker, "run_foreground", lambda spec, echo: specs.append(spec) or 0)
    result = CliRunner().invoke(app, ["worker", "--engine", "vllm", "--model", "m", "--port", "8100", *args])
    assert result.exit_code == 0, result.output
    (spec,) = specs
    assert build_command(spec)[7:] == ["--tensor-parallel-size", "1", *tail]  # type: ignore[arg-type]


def test_worker_process_serves_on_a_free_port_and_stops_on_sigterm() -> None:
    mosaic = Path(sys.executable).with_name("mosaic")
    cmd = [
        str(mosaic),
        "worker",
        "--gpu",
        "L4",
        "--model",
        "llama-3-8b",
        "--port",
        "0",
        "--time-scale",
        "100",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ)
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once the port is bound
        match = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert match, line
        url = match.group(1)
        assert "L4" in line and "max_model_len=8192" in line
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "worker never became healthy"
            time.sleep(0.1)
        body = {"model": "llama-3-8b", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
