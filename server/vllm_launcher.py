"""Start real `vllm serve` processes: the exact command line a pool needs, `/health` wait, clean stop.

Command built by `build_command(spec)` (vLLM 0.32 flags):

    [*spec.vllm_command, MODEL, --host H, --port P, [--served-model-name N], --tensor-parallel-size TP,
     [--data-parallel-size DP], [--max-model-len L], [--gpu-memory-utilization U], [--max-num-seqs S],
     [--block-size B], [--runner pooling],
     [--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer"|"kv_consumer"}'],
     [--shutdown-timeout S], *spec.extra_args]

`--data-parallel-size` only when DP > 1 (vLLM's default is 1). An engine setting of ours that `extra_args`
also gives is left out (the operator's value wins; vLLM would otherwise see it twice); the parallel sizes
are not settings a pool may override there (`server.vllm_pool.LaunchVllmConfig` refuses them: the gateway
sizes GPUs, ports and capacity from the pool's `tp` and `dp`). `kv_role` follows the pool role: `prefill`
→ `kv_producer`, `decode` → `kv_consumer`, `mixed` → no KV connector at all. vLLM 0.32's NixlConnector
warns that `kv_both` is deprecated and asks for exactly this split.

Environment (`build_env`): by default only an allowlist of the parent's variables is inherited
(`INHERITED_ENV_NAMES`, `INHERITED_ENV_PREFIXES`: what vLLM, CUDA, NCCL, UCX/NIXL, torch and the Hugging
Face hub read), never `VLLM_API_KEY` (vLLM 0.32 turns on its own bearer auth when it is set) nor a name in
`spec.drop_env`; `spec.pass_env` names more variables to inherit, `spec.env` sets variables outright, and
`spec.api_key` becomes the child's `VLLM_API_KEY`. Then `CUDA_VISIBLE_DEVICES` from the assigned GPU ids,
TP × DP of them (one process never shares a GPU with another, see `server/vllm_pool.py`; vLLM 0.32 gives
data-parallel engine r the visible devices r·TP .. r·TP + TP − 1), `VLLM_NIXL_SIDE_CHANNEL_HOST`
(the host *advertised* to peers: `nixl_side_channel_host`, else `default_advertise_host(host)`, never a
wildcard such as 0.0.0.0) and `_PORT` for P/D roles (in vLLM 0.32 each engine listens on port + its
data-parallel index, so the port must be unique per instance on a host), and usage stats off.

Process handling: the server runs in its own session (process group) so a stop can sweep the engine-core
children vLLM spawns; `stop()` sends SIGTERM to the PID (vLLM exits in a few seconds), then SIGKILLs the
group if it has not exited by the deadline. On Linux the child also asks for `PR_SET_PDEATHSIG` = SIGTERM,
so a parent killed with SIGKILL (no chance to run `stop()`) still takes its vLLM servers down: vLLM's API
server stops its engine-core processes on SIGTERM. The kernel sends that signal when the *thread* that
forked the child exits, not the process: start servers from a thread that lives as long as they do (the
gateway starts them on its event-loop thread; `mosaic worker --engine vllm` on its main thread), never from
a short-lived worker thread. Standard library only, so the CPU test environment's script can use it from
any Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self

ROLES = ("mixed", "prefill", "decode")
RUNNERS = ("generate", "pooling")  # vLLM's --runner values a pool may run (its `auto` is not one: explicit)
# vLLM 0.32 NixlConnector: "set kv_role='kv_producer' for prefill instances and 'kv_consumer' for decode".
KV_ROLE_BY_ROLE: Mapping[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer"}
DEFAULT_VLLM_COMMAND: tuple[str, ...] = ("vllm", "serve")
DEFAULT_NIXL_SIDE_CHANNEL_PORT = 5600
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})

# What a launched vLLM inherits from the process that starts it. An allowlist, not a denylist: the gateway's
# environment holds secrets under names nobody can list in advance (MOSAIC_API_KEYS, the admin keys, cloud
# credentials such as AWS_SECRET_ACCESS_KEY, whatever `auth.api_keys_env` names), and vLLM has no use for
# them. What vLLM does need: the basics (PATH, HOME, locale, temp dirs, proxies and CA bundles for model
# downloads), the dynamic loader (LD_*), the GPU stack (CUDA_*, NVIDIA_*, NCCL_*, cuBLAS/cuDNN, ROCm/HIP),
# the P/D transfer stack (UCX_*, NIXL_*), CPU threading (OMP_*, KMP_*, MKL_*), torch and its compilers
# (TORCH*, TRITON_*, FLASHINFER_*), Python (PYTHON*, VIRTUAL_ENV), Ray (multi-node), and its own settings
# (VLLM_*, HF_*/HUGGING_FACE_* incl. HF_TOKEN for gated models, TRANSFORMERS_*). Anything else: name it in
# the pool's `launch.pass_env` (inherited) or `launch.env` (set).
INHERITED_ENV_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE",
        "TMPDIR", "TMP", "TEMP", "VIRTUAL_ENV", "CONDA_PREFIX", "CPATH", "LIBRARY_PATH", "CC", "CXX",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
        "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy",
        "all_proxy", "DO_NOT_TRACK", "TOKENIZERS_PARALLELISM",
    }
)  # fmt: skip
INHERITED_ENV_PREFIXES = (
    "LC_", "LD_", "XDG_", "PYTHON", "CUDA_", "NVIDIA_", "NCCL_", "CUBLAS_", "CUDNN_", "NVTE_", "ROCM_",
    "HIP_", "HSA_", "UCX_", "NIXL_", "OMP_", "KMP_", "MKL_", "TORCH", "TRITON_", "FLASHINFER_", "RAY_",
    "GLOO_", "VLLM_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_",
    # PYTORCH_CUDA_ALLOC_CONF (expandable segments) and its HIP/NVML kin; ROCR_VISIBLE_DEVICES (AMD GPU
    # mask); HUGGINGFACE_HUB_CACHE; ModelScope; tiktoken's offline encodings; NVSHMEM and libfabric (EFA,
    # under NIXL); OpenTelemetry (vLLM's tracing)
    "PYTORCH_", "ROCR_", "HUGGINGFACE_", "MODELSCOPE_", "TIKTOKEN_", "NVSHMEM_", "FI_", "OTEL_",
)  # fmt: skip
# Never inherited, whatever the lists above say: vLLM 0.32 reads VLLM_API_KEY and then answers 401 to every
# request without that key, so a key meant for something else turns a launched server's auth on behind the
# gateway's back (requests fail while /health, which vLLM does not guard, says ready). A launched pool's key
# is `spec.api_key` (from the pool's `api_key_env`), which the gateway also sends.
NEVER_INHERITED_ENV = frozenset({"VLLM_API_KEY"})

# PR_SET_PDEATHSIG from <linux/prctl.h>: the signal the kernel sends a process when its parent thread dies.
_PR_SET_PDEATHSIG = 1


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
    # vLLM's --runner: "pooling" is passed (an embeddings server); "generate" leaves vLLM's `auto`, which
    # picks generation for a causal LM (a causal LM served for embeddings also needs `--convert embed`)
    runner: str = "generate"
    tensor_parallel_size: int = 1  # GPUs per engine
    # engines behind the one API server (--data-parallel-size), each on its own tensor_parallel_size GPUs
    data_parallel_size: int = 1
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None  # → --max-num-seqs (the gateway sizes a worker's capacity from it)
    block_size: int | None = None  # → --block-size (idem: KV blocks per request)
    gpu_ids: tuple[str, ...] = ()  # → CUDA_VISIBLE_DEVICES, TP × DP ids; () leaves it as inherited
    nixl_side_channel_port: int | None = None  # P/D roles only; None → vLLM's default 5600
    nixl_side_channel_host: str | None = None  # advertised to peers; None → default_advertise_host(host)
    # → --shutdown-timeout: seconds vLLM 0.32 lets running requests finish after SIGTERM (its default, 0,
    # aborts them); None leaves vLLM's default
    shutdown_timeout_s: int | None = None
    extra_args: tuple[str, ...] = ()
    vllm_command: tuple[str, ...] = DEFAULT_VLLM_COMMAND
    env: Mapping[str, str] = field(default_factory=dict)  # extra variables (e.g. VLLM_CPU_KVCACHE_SPACE)
    pass_env: tuple[str, ...] = ()  # more variables inherited from the parent, beyond the allowlist
    drop_env: frozenset[str] = frozenset()  # never inherited (e.g. the gateway's own key variables)
    api_key: str | None = field(default=None, repr=False)  # → the child's VLLM_API_KEY (kept out of repr)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must not be empty")
        if self.role not in ROLES:
            raise ValueError(f"role: {self.role!r} is not one of {', '.join(ROLES)}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner: {self.runner!r} is not one of {', '.join(RUNNERS)}")
        if self.runner == "pooling" and self.role != "mixed":  # no KV connector hands over an embedding
            raise ValueError(f"runner: pooling serves whole requests, role must be mixed, not {self.role}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: {self.port} is not in 1..65535")
        if not self.host or self.host.startswith("[") or any(c.isspace() for c in self.host):
            raise ValueError(f"host: {self.host!r} is not an address (IPv6 without brackets, e.g. ::1)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} must be ≥ 1")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size: {self.data_parallel_size} must be ≥ 1")
        if self.gpu_ids and len(self.gpu_ids) != self.gpu_count:
            dp = f" × data_parallel_size {self.data_parallel_size}" if self.data_parallel_size > 1 else ""
            raise ValueError(
                f"gpu_ids: {len(self.gpu_ids)} GPUs given for tensor_parallel_size {self.tensor_parallel_size}{dp}"
            )
        if len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise ValueError(f"gpu_ids: {','.join(self.gpu_ids)} repeats a GPU")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: {self.max_model_len} must be ≥ 1")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: {self.gpu_memory_utilization} is not in (0, 1]")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: {self.max_num_seqs} must be ≥ 1")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size: {self.block_size} must be ≥ 1")
        if not self.vllm_command or not self.vllm_command[0]:
            raise ValueError("vllm_command: must not be empty")

    @property
    def gpu_count(self) -> int:
        """GPUs the process needs: TP ranks of each of its DP engines."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def url(self) -> str:
        """Where this process is reached from the machine that started it (a wildcard bind → loopback)."""
        return http_url(connect_host(self.host), self.port)


def connect_host(host: str) -> str:
    """The address to reach a server bound to `host` from this machine: loopback for a wildcard bind."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def http_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 literal in brackets (`http://[::1]:8000`; without them the URL is invalid)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def default_advertise_host(bind_host: str) -> str:
    """The host NIXL peers are told to reach this server at. A specific bind address is itself; a wildcard
    (0.0.0.0, ::) is not an address a peer can dial, so this machine's primary IPv4 address is used (the
    source address of its default route, found without sending a packet), else 127.0.0.1 (no route: only
    local peers could reach it anyway)."""
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.1", 9))  # TEST-NET-1: UDP connect only picks a route, nothing is sent
        address = str(sock.getsockname()[0])
        if address and address != "0.0.0.0":
            return address
    return "127.0.0.1"


def kv_transfer_config(role: str) -> dict[str, str] | None:
    """The `--kv-transfer-config` object for a pool role; None for mixed workers (no KV connector)."""
    kv_role = KV_ROLE_BY_ROLE.get(role)
    return None if kv_role is None else {"kv_connector": "NixlConnector", "kv_role": kv_role}


def _gives(args: Sequence[str], flag: str) -> bool:
    """`flag` appears in `args` as `--flag V` or `--flag=V`."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def build_command(spec: VllmLaunchSpec) -> list[str]:
    """The exact argv for `spec` (see the module docstring for the layout)."""
    cmd = [*spec.vllm_command, spec.model, "--host", spec.host, "--port", str(spec.port)]
    if spec.served_model_name:
        cmd += ["--served-model-name", spec.served_model_name]
    cmd += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.data_parallel_size > 1:
        cmd += ["--data-parallel-size", str(spec.data_parallel_size)]
    if spec.max_model_len is not None:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    if spec.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    # Engine settings the gateway sizes capacity from, and the drain on SIGTERM: passed unless extra_args
    # already gives them.
    for flag, value in (
        ("--max-num-seqs", spec.max_num_seqs),
        ("--block-size", spec.block_size),
        ("--shutdown-timeout", spec.shutdown_timeout_s),
        ("--runner", "pooling" if spec.runner == "pooling" else None),
    ):
        if value is not None and not _gives(spec.extra_args, flag):
            cmd += [flag, str(value)]
    kv_config = kv_transfer_config(spec.role)
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))]
    return cmd + list(spec.extra_args)


def inherited(name: str) -> bool:
    """Whether a variable of the parent's environment goes to vLLM by default (see INHERITED_ENV_*)."""
    if name in NEVER_INHERITED_ENV:
        return False
    return name in INHERITED_ENV_NAMES or name.startswith(INHERITED_ENV_PREFIXES)


def build_env(
    spec: VllmLaunchSpec, base: Mapping[str, str] | None = None, *, filtered: bool = True
) -> dict[str, str]:
    """The process environment: `base` (default: ours), filtered to what vLLM needs unless `filtered` is
    False (the caller's environment as is, VLLM_API_KEY included), + GPU assignment + NIXL side channel +
    spec.env + spec.api_key."""
    source = os.environ if base is None else base
    if filtered:
        passed = set(spec.pass_env) - NEVER_INHERITED_ENV
        env = {k: v for k, v in source.items() if (inherited(k) or k in passed) and k not in spec.drop_env}
    else:
        env = dict(source)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if spec.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_ids)
    if spec.role in KV_ROLE_BY_ROLE:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.nixl_side_channel_host or default_advertise_host(spec.host)
        port = spec.nixl_side_channel_port or DEFAULT_NIXL_SIDE_CHANNEL_PORT
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    env.update(spec.env)
    if spec.api_key is not None:
        env["VLLM_API_KEY"] = spec.api_key
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (bind to 0, read it back, close). Nothing holds it afterwards:
    `server.vllm_pool` keeps its own reservations of ports handed out."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
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
        *,
        filter_env: bool = True,
        detached: bool = False,
    ) -> Self:
        """Spawn the process (does not wait for health). Output goes to `log_path`, else to our own stdout/stderr.
        `filter_env=False` hands vLLM the whole environment (a foreground command the user runs themselves).
        `detached`: the server outlives this process (no parent-death signal; stopped by PID later)."""
        log_file: IO[bytes] | None = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = log_path.open("wb")
        try:
            popen = subprocess.Popen(
                build_command(spec),
                env=build_env(spec, base_env, filtered=filter_env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log_file,  # None: inherit (a foreground `mosaic worker --engine vllm` shows vLLM's log)
                stderr=subprocess.STDOUT if log_file is not None else None,
                start_new_session=True,  # own process group: stop() can sweep vLLM's spawned children
                # our SIGKILL must not leave vLLM running on the GPUs (unless it is meant to outlive us)
                preexec_fn=None if detached else _parent_death_signal(),
            )
        except OSError as exc:
            if log_file is not None:
                log_file.close()
            hint = (
                " (is vLLM installed? `mosaic worker --vllm-command`, or a pool's launch.vllm_command, names it)"
                if isinstance(exc, FileNotFoundError)
                else ""
            )
            raise LaunchError(f"cannot run {spec.vllm_command[0]!r}: {exc.strerror or exc}{hint}") from exc
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


def _parent_death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` asking Linux to SIGTERM the child when the thread that forks it dies (PR_SET_PDEATHSIG);
    None elsewhere. prctl is looked up here, in the parent, so that between fork and exec the child runs no
    import and no library loading (a forked child of a threaded process must not need locks other threads
    may have held): just prctl and getppid."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: no signal will ever come, so stop now
            os._exit(1)

    return set_parent_death_signal


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
