"""`mosaic worker --engine vllm` backend (`server.vllm_worker`): options → spec, and the foreground lifecycle
(start, /health, one line with the URL, SIGTERM → vLLM stopped, exit 0) with a stand-in and with real vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import vllm_env

from server.vllm_launcher import build_command, free_port, health_ok, pid_alive
from server.vllm_worker import worker_spec

FAKE_VLLM = f"{sys.executable} {Path(__file__).parent / 'fixtures' / 'fake_vllm.py'}"


@pytest.mark.parametrize(
    ("kwargs", "argv_tail", "gpus"),
    [
        pytest.param(
            {"gpu_ids": "0,1", "role": "prefill"},
            [
                "--tensor-parallel-size",
                "2",
                "--kv-transfer-config",
                '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}',
            ],
            ("0", "1"),
            id="--gpu-ids 0,1 with --tp left at 1 → TP2 on GPUs 0,1",
        ),
        pytest.param(
            {
                "tp": 4,
                "max_model_len": 8192,
                "gpu_memory_utilization": 0.85,
                "extra_args": ["--", "--enable-prefix-caching"],
            },
            [
                "--tensor-parallel-size",
                "4",
                "--max-model-len",
                "8192",
                "--gpu-memory-utilization",
                "0.85",
                "--enable-prefix-caching",
            ],
            (),
            id="pool flags, extra args after -- appended",
        ),
        pytest.param(
            {"gpu_ids": "0,1,2,3", "dp": 2},
            ["--tensor-parallel-size", "2", "--data-parallel-size", "2"],
            ("0", "1", "2", "3"),
            id="--gpu-ids 0-3 with --data-parallel-size 2 → two engines of TP2 (not TP4 × 2 on 4 GPUs)",
        ),
        pytest.param(
            {"runner": "pooling", "extra_args": ["--", "--convert", "embed"]},
            ["--tensor-parallel-size", "1", "--runner", "pooling", "--convert", "embed"],
            (),
            id="--runner pooling reaches vLLM (an embeddings server)",
        ),
    ],
)
def test_worker_spec(kwargs: dict[str, object], argv_tail: list[str], gpus: tuple[str, ...]) -> None:
    spec = worker_spec(model="/models/m", port=8100, **kwargs)  # type: ignore[arg-type]
    argv = build_command(spec)
    assert argv[:7] == ["vllm", "serve", "/models/m", "--host", "127.0.0.1", "--port", "8100"]
    assert argv[7:] == argv_tail
    assert spec.gpu_ids == gpus


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"gpu_ids": "0,1", "tp": 4}, "--gpu-ids 0,1 lists 2 GPU(s) but --tp is 4", id="TP disagrees"
        ),
        pytest.param(
            {"gpu_ids": "0,1,2", "dp": 2},
            "--gpu-ids 0,1,2 lists 3 GPU(s) but --tp 1 × --data-parallel-size 2 = 2",
            id="GPUs not shared equally by the engines",
        ),
        pytest.param(
            {"role": "both"}, "--role 'both': expected one of mixed, prefill, decode", id="bad role"
        ),
        pytest.param({"gpu_ids": "0,,2"}, "expected a comma-separated list", id="empty GPU id"),
        pytest.param({"vllm_command": "  "}, "--vllm-command must not be empty", id="empty command"),
        pytest.param(
            {"gpu_memory_utilization": 2.0}, "vllm worker: gpu_memory_utilization: 2.0", id="bad util"
        ),
        pytest.param(
            {"extra_args": ["--", "--pipeline-parallel-size", "2"]},
            "--pipeline-parallel-size: vLLM's --pipeline-parallel-size is not supported: Mosaic does not model "
            "pipeline parallelism (the server would need --tp × pp × --data-parallel-size GPUs",
            id="PP after --: not modelled",
        ),
        pytest.param(
            {"extra_args": ["--", "-pp=2"]}, "-pp=2: vLLM's --pipeline-parallel-size", id="PP short"
        ),
        pytest.param(
            {"extra_args": ["--", "--prefill-context-parallel-size", "2"]},
            "--prefill-context-parallel-size: vLLM's --prefill-context-parallel-size is not supported: Mosaic "
            "does not model prefill context parallelism (the server would need --tp × pcp × "
            "--data-parallel-size GPUs",
            id="PCP after --: not modelled",
        ),
        pytest.param(
            {"extra_args": ["--", "-pcp=2"]}, "-pcp=2: vLLM's --prefill-context-parallel-size", id="PCP short"
        ),
        pytest.param(
            {"gpu_ids": "0,1", "extra_args": ["--", "-tp", "4"]},
            "-tp: give the worker's --tp instead, before -- (it writes vLLM's --tensor-parallel-size and checks "
            "--gpu-ids against --tp × --data-parallel-size)",
            id="TP after -- would override the --gpu-ids check",
        ),
        pytest.param(
            {"extra_args": ["--", "--data_parallel_size=2"]},
            "--data_parallel_size=2: give the worker's --data-parallel-size instead, before --",
            id="DP after --",
        ),
    ],
)
def test_worker_spec_refuses(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        worker_spec(model="m", port=8000, **kwargs)  # type: ignore[arg-type]


def test_worker_spec_reads_a_vllm_config_file_for_parallel_sizes(tmp_path: Path) -> None:
    """`-- --config FILE`: vLLM reads the file's keys as its flags, before the command line's."""
    file = tmp_path / "vllm.yaml"
    file.write_text("max-num-seqs: 8\n", encoding="utf-8")
    worker_spec(model="m", port=8000, extra_args=["--", "--config", str(file)])
    file.write_text("pipeline-parallel: 2\n", encoding="utf-8")
    with pytest.raises(ValueError) as caught:
        worker_spec(model="m", port=8000, extra_args=["--", "--config", str(file)])
    assert str(caught.value).startswith(f"--config {file} sets pipeline-parallel: vLLM's --pipeline-parallel")
    with pytest.raises(ValueError) as caught:
        worker_spec(model="m", port=8000, extra_args=["--", "--config", f"{tmp_path}/absent.yaml"])
    assert str(caught.value).startswith(f"--config {tmp_path}/absent.yaml: cannot read vLLM's config file")


def test_worker_spec_reads_a_prefill_context_parallel_size_from_a_vllm_config_file(tmp_path: Path) -> None:
    file = tmp_path / "vllm.yaml"
    file.write_text("prefill_context_parallel_size: 2\n", encoding="utf-8")
    with pytest.raises(ValueError) as caught:
        worker_spec(model="m", port=8000, extra_args=["--", "--config", str(file)])
    assert str(caught.value).startswith(
        f"--config {file} sets prefill_context_parallel_size: vLLM's --prefill-context-parallel-size is not "
        "supported"
    )


MOSAIC = str(Path(sys.executable).with_name("mosaic"))


class WorkerRun:
    """`mosaic worker --engine vllm ARGS` in its own process, as a user runs it. Its output is drained by a
    thread into `lines`, so vLLM never blocks on a full pipe."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [MOSAIC, "worker", "--engine", "vllm", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=vllm_env.REPO_ROOT,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._drain)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_serving(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith("mosaic worker: vLLM (") and " serving " in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError("worker never reported serving:\n" + self.tail())

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def wait(self, timeout_s: float = 60) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code

    def stop(self, timeout_s: float = 60) -> tuple[int, float]:
        """SIGTERM (if running); → (exit code, seconds to exit)."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code, time.monotonic() - started


def test_foreground_lifecycle_with_a_stand_in() -> None:
    port = free_port()
    run = WorkerRun(
        [
            "--model",
            "/models/m",
            "--port",
            str(port),
            "--role",
            "decode",
            "--gpu-ids",
            "3",
            "--max-num-seqs",
            "64",
            "--advertise-host",
            "10.9.9.9",
            "--vllm-command",
            FAKE_VLLM,
            "--",
            "--enable-chunked-prefill",
        ]
    )
    try:
        assert (
            run.wait_serving(60)
            == f"mosaic worker: vLLM (decode) serving /models/m at http://127.0.0.1:{port}"
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/launch", timeout=10) as resp:
            launched = json.loads(resp.read())
        assert launched["env"]["CUDA_VISIBLE_DEVICES"] == "3"
        assert launched["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.9.9.9"  # --advertise-host, not --host
        assert launched["argv"][-5:] == [
            "--kv-transfer-config",
            '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}',
            "--max-num-seqs",
            "64",
            "--enable-chunked-prefill",
        ]
    finally:
        code, _ = run.stop()
    assert code == 0, run.tail()
    assert run.lines[-1] == "mosaic worker: vLLM stopped"
    assert not health_ok(f"http://127.0.0.1:{port}")


def test_vllm_that_cannot_start_exits_1() -> None:
    run = WorkerRun(
        [
            "--model",
            "m",
            "--port",
            str(free_port()),
            "--vllm-command",
            f"{sys.executable} -c 'raise SystemExit(3)'",
        ]
    )
    assert run.wait() == 1
    assert "mosaic worker: vLLM exited with code 3 before /health answered" in run.lines


@pytest.mark.parametrize(
    ("args", "line"),
    [
        pytest.param(
            ["--engine", "vllm", "--model", "m", "--gpu-ids", "0,1", "--tp", "4"],
            "error: --gpu-ids 0,1 lists 2 GPU(s) but --tp is 4",
            id="vllm: GPU ids disagree with --tp",
        ),
        pytest.param(
            ["--engine", "vllm", "--model", "m", "--role", "both"],
            "error: --role 'both': expected one of mixed, prefill, decode",
            id="vllm: bad role",
        ),
        pytest.param(
            ["--engine", "vllm", "--model", "m", "--time-scale", "10"],
            "error: --time-scale: simulated worker only (--engine sim); --engine vllm would ignore it "
            "(vLLM flags go after --)",
            id="vllm: --time-scale refused, not ignored",
        ),
        pytest.param(
            ["--engine", "vllm", "--model", "m", "--seed", "3", "--gpu", "H100"],
            "error: --gpu, --seed: simulated worker only (--engine sim); --engine vllm would ignore them "
            "(vLLM flags go after --)",
            id="vllm: --seed and --gpu refused",
        ),
        pytest.param(
            ["--engine", "vllm", "--model", "m", "--vllm-command", "'vllm serve"],
            'error: --vllm-command "\'vllm serve": No closing quotation',
            id="vllm: unbalanced quote in --vllm-command",
        ),
        pytest.param(
            ["--engine", "tpu", "--model", "m"],
            "error: --engine must be sim or vllm, got 'tpu'",
            id="unknown engine",
        ),
        pytest.param(
            ["--model", "llama-3-8b"],
            "error: --gpu is required for the simulated worker",
            id="sim: --gpu still required",
        ),
        pytest.param(
            ["--gpu", "H100", "--model", "llama-3-8b", "--", "--foo"],
            "error: unexpected arguments: --foo (only --engine vllm passes extra args on)",
            id="sim: no extra args",
        ),
        pytest.param(
            ["--engine", "vllm", "--model", "m", "--", "-pp", "2"],
            "error: -pp: vLLM's --pipeline-parallel-size is not supported: Mosaic does not model pipeline "
            "parallelism (the server would need --tp × pp × --data-parallel-size GPUs, and the gateway books a "
            "pool's capacity and GPUs from tp × dp only); use --tp instead",
            id="vllm: a pipeline parallel size after --",
        ),
        pytest.param(
            ["--engine", "vllm", "--model", "m", "--", "-pcp", "2"],
            "error: -pcp: vLLM's --prefill-context-parallel-size is not supported: Mosaic does not model prefill "
            "context parallelism (the server would need --tp × pcp × --data-parallel-size GPUs, and the gateway "
            "books a pool's capacity and GPUs from tp × dp only); use --tp instead",
            id="vllm: a prefill context parallel size after --",
        ),
        pytest.param(
            ["--engine", "vllm", "--model", "m", "--runner", "pooling", "--role", "decode"],
            "error: vllm worker: runner: pooling serves whole requests, role must be mixed, not decode",
            id="vllm: a pooling decode worker",
        ),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args: list[str], line: str) -> None:
    done = subprocess.run([MOSAIC, "worker", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [line]


def group_members(pgid: int) -> list[str]:
    """Live (non-zombie) processes of a process group."""
    out = subprocess.run(["ps", "-e", "-o", "pgid=,stat=,pid="], capture_output=True, text=True).stdout
    return [
        pid
        for g, stat, pid in (line.split() for line in out.splitlines())
        if int(g) == pgid and "Z" not in stat
    ]


@pytest.mark.real_vllm
@pytest.mark.timeout(600)
def test_cpu_vllm_start_serve_stop() -> None:
    """`mosaic worker --engine vllm` with the real CPU build, mixed role: /health, a completion, SIGTERM → exit 0,
    no process of its group left."""
    reason = vllm_env.missing_reason()
    if reason is not None:
        pytest.skip(reason)
    port = free_port()
    cmd = f"{vllm_env.VENV_PYTHON} {vllm_env.CPU_CLI} serve"
    run = WorkerRun(
        [
            "--model",
            str(vllm_env.MODEL_DIR),
            "--port",
            str(port),
            "--served-model-name",
            "tiny-llama",
            "--max-model-len",
            "512",
            "--vllm-command",
            cmd,
            "--",
            *vllm_env.BASE_SERVER_ARGS,
        ],
        env=vllm_env.server_env(),
    )
    try:
        started = time.monotonic()
        run.wait_serving(540)
        start_s = time.monotonic() - started
        body = json.dumps(
            {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert json.loads(resp.read())["usage"]["completion_tokens"] == 3
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{exc}: {exc.read()!r}\n{run.tail()}") from None
        vllm_pid = int(
            subprocess.run(
                ["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True
            ).stdout.split()[0]
        )
    finally:
        code, stop_s = run.stop(timeout_s=90)
    assert code == 0, run.tail()
    assert not health_ok(f"http://127.0.0.1:{port}")
    assert not pid_alive(vllm_pid)
    # SIGKILLed stragglers of the group may take a moment to be reaped (PID 1 reaps the orphans).
    deadline = time.monotonic() + 15
    while (leftover := group_members(vllm_pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover == [], f"processes left in vLLM's group: {leftover}"
    print(f"\ncpu vLLM: healthy after {start_s:.1f} s, stopped in {stop_s:.1f} s")
