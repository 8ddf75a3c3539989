"""Start real `vllm serve` processes: the exact command line a pool needs, `/health` wait, clean stop.

Command built by `build_command(spec)` (vLLM 0.32 flags):

    [*spec.vllm_command, MODEL, --host H, --port P, [--served-model-name N], --tensor-parallel-size TP,
     [--max-model-len L], [--gpu-memory-utilization U],
     [--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"|"kv_consumer"}'],
     *spec.extra_args]

`kv_role` follows the pool role: `prefill` → `kv_producer`, `decode` → `kv_consumer`, `mixed` → no KV
connector at all. vLLM 0.32's NixlConnector warns that `kv_both` is deprecated and asks for exactly this
split. Environment (`build_env`): `CUDA_VISIBLE_DEVICES` from the assigned GPU ids (one process never shares a
GPU with another, see `server/vllm_pool.py`), `VLLM_NIXL_SIDE_CHANNEL_HOST`/`_PORT` for P/D roles (the
NIXL handshake port must be unique per instance on a host; TP rank r uses port + r), and usage stats off.

Process handling: the server runs in its own session (process group) so a stop can sweep the engine-core
children vLLM spawns; `stop()` sends SIGTERM to the PID (vLLM exits in a few seconds), then SIGKILLs the
group if it has not exited by the deadline. Standard library only, so the CPU test environment's script
can use it from any Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self

ROLES = ("mixed", "prefill", "decode")
# vLLM 0.32 NixlConnector: "set kv_role='kv_producer' for prefill instances and 'kv_consumer' for decode".
KV_ROLE_BY_ROLE: Mapping[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}
DEFAULT_VLLM_COMMAND: tuple[str, ...] = ("vllm", "serve")
DEFAULT_NIXL_SIDE_CHANNEL_PORT = 5600


class LaunchError(RuntimeError):
    """A vLLM process could not be started, died while starting, or never became healthy."""


@dataclass(frozen=True, slots=True)
class VllmLaunchSpec:
    """Everything that decides one `vllm serve` process. Validated on construction (ValueError names the field)."""

    model: str
    port: int
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    role: str = "mixed"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    gpu_ids: tuple[str, ...] = ()  # → CUDA_VISIBLE_DEVICES; () leaves the variable as inherited
    nixl_side_channel_port: int | None = None  # P/D roles only; None → vLLM's default 5600
    nixl_side_channel_host: str | None = None  # None → the bind host
    extra_args: tuple[str, ...] = ()
    vllm_command: tuple[str, ...] = DEFAULT_VLLM_COMMAND
    env: Mapping[str, str] = field(default_factory=dict)  # extra variables (e.g. VLLM_CPU_KVCACHE_SPACE)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must not be empty")
        if self.role not in ROLES:
            raise ValueError(f"role: {self.role!r} is not one of {', '.join(ROLES)}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: {self.port} is not in 1..65535")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} must be ≥ 1")
        if self.gpu_ids and len(self.gpu_ids) != self.tensor_parallel_size:
            raise ValueError(
                f"gpu_ids: {len(self.gpu_ids)} GPUs given for tensor_parallel_size {self.tensor_parallel_size}"
            )
        if len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise ValueError(f"gpu_ids: {','.join(self.gpu_ids)} repeats a GPU")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: {self.max_model_len} must be ≥ 1")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: {self.gpu_memory_utilization} is not in (0, 1]")
        if not self.vllm_command:
            raise ValueError("vllm_command: must not be empty")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def kv_transfer_config(role: str) -> dict[str, str] | None:
    """The `--kv-transfer-config` object for a pool role; None for mixed workers (no KV connector)."""
    kv_role = KV_ROLE_BY_ROLE.get(role)
    return None if kv_role is None else {"kv_connector": "NixlConnector", "kv_role": kv_role}


def build_command(spec: VllmLaunchSpec) -> list[str]:
    """The exact argv for `spec` (see the module docstring for the layout)."""
    cmd = [*spec.vllm_command, spec.model, "--host", spec.host, "--port", str(spec.port)]
    if spec.served_model_name:
        cmd += ["--served-model-name", spec.served_model_name]
    cmd += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    kv_config = kv_transfer_config(spec.role)
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))]
    return cmd + list(spec.extra_args)


def build_env(spec: VllmLaunchSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment: `base` (default: ours) + GPU assignment + NIXL side channel + spec.env."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if spec.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_ids)
    if spec.role in KV_ROLE_BY_ROLE:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.nixl_side_channel_host or spec.host
        port = spec.nixl_side_channel_port or DEFAULT_NIXL_SIDE_CHANNEL_PORT
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    env.update(spec.env)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (bind to 0, read it back, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def health_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET {url}/health answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def log_tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.is_file():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


class VllmProcess:
    """One running `vllm serve`; `start` → `wait_healthy` → `stop`. Usable as a context manager."""

    def __init__(
        self,
        spec: VllmLaunchSpec,
        popen: subprocess.Popen[bytes],
        log_path: Path | None,
        log_file: IO[bytes] | None,
    ) -> None:
        self.spec = spec
        self._popen = popen
        self.log_path = log_path
        self._log_file = log_file

    @classmethod
    def start(
        cls,
        spec: VllmLaunchSpec,
        log_path: Path | None = None,
        base_env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Self:
        """Spawn the process (does not wait for health). Output goes to `log_path`, else to our own stdout/stderr."""
        log_file: IO[bytes] | None = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = log_path.open("wb")
        try:
            popen = subprocess.Popen(
                build_command(spec),
                env=build_env(spec, base_env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,  # None: inherit (a foreground `mosaic worker --engine vllm` shows vLLM's log)
                stderr=subprocess.STDOUT if log_file is not None else None,
                start_new_session=True,  # own process group: stop() can sweep vLLM's spawned children
            )
        except OSError as exc:
            if log_file is not None:
                log_file.close()
            raise LaunchError(f"cannot run {spec.vllm_command[0]!r}: {exc}") from exc
        return cls(spec, popen, log_path, log_file)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def url(self) -> str:
        return self.spec.url

    def poll(self) -> int | None:
        return self._popen.poll()

    def wait_healthy(self, timeout_s: float = 600.0, interval_s: float = 0.5) -> float:
        """Block until /health is 200; returns the seconds waited. LaunchError (with the log tail) if the process
        exits first or the deadline passes (the process is then left running: call stop())."""
        started = time.monotonic()
        while True:
            if health_ok(self.url):
                return time.monotonic() - started
            code = self._popen.poll()
            if code is not None:
                raise LaunchError(
                    f"vllm exited with code {code} before {self.url}/health answered\n"
                    f"{log_tail(self.log_path)}"
                )
            if time.monotonic() - started > timeout_s:
                raise LaunchError(
                    f"{self.url}/health not 200 after {timeout_s:.0f} s\n{log_tail(self.log_path)}"
                )
            time.sleep(interval_s)

    def terminate(self) -> None:
        """Send SIGTERM without waiting (a later `stop()` or `poll()` reaps it)."""
        if self._popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the PID, wait up to `timeout_s`, then SIGKILL its process group. Returns the exit code.
        Idempotent."""
        try:
            if self._popen.poll() is None:
                self._popen.send_signal(signal.SIGTERM)
                try:
                    self._popen.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    _killpg(self._popen.pid)
                    self._popen.wait(timeout=10)
            _killpg(self._popen.pid)  # stragglers of the group (spawned engine processes), if any
            return int(self._popen.returncode)
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(pid: int, timeout_s: float = 30.0) -> bool:
    """Stop a server started by another process (PID file): SIGTERM, wait, then SIGKILL its group.
    Returns True when the process is gone. The group is the server's own (it was started in a new session)."""
    if not pid_alive(pid):
        return True
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    _killpg(pid)
    # A zombie whose parent is gone is reaped by init; give it a moment.
    for _ in range(50):
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return not pid_alive(pid)


def parse_gpu_ids(text: str) -> tuple[str, ...]:
    """`"0,1"` → `("0", "1")`; empty parts are refused (ValueError naming the input)."""
    parts = tuple(p.strip() for p in text.split(","))
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"gpu ids {text!r}: expected a comma-separated list such as 0,1")
    return parts


def detect_gpu_ids(
    env: Mapping[str, str] | None = None, nvidia_smi: Sequence[str] = ("nvidia-smi",)
) -> tuple[str, ...]:
    """Local GPUs Mosaic may hand out: CUDA_VISIBLE_DEVICES when set, else nvidia-smi's indices, else none."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(p.strip() for p in visible.split(",") if p.strip())
    try:
        out = subprocess.run(
            [*nvidia_smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())
