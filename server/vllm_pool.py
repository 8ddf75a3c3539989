"""`launch: vllm` pools: Mosaic starts real `vllm serve` processes on this machine's GPUs and scales them.

One process per replica; each gets `tp` GPUs from a `GpuAllocator` shared by every launched pool, so no two
processes ever see the same GPU (`CUDA_VISIBLE_DEVICES`). Lowest free ids first, which keeps a TP group on
adjacent GPUs (usually the same NVLink/PCIe switch). Ports: a free loopback port per replica, and for P/D
roles a block of `tp` free ports for the NIXL side channel (rank r listens on base + r).

`VllmPoolLauncher` is non-blocking so the gateway's event loop and the embedded autoscaler can call it: a
replica starts as a process (health is the registry's job, or `wait_ready`); a stop sends SIGTERM and the
process is reaped on later calls (`reap`), SIGKILLed with its process group if still alive after
`stop_grace_s`. `VllmActuator` adapts pools to the autoscaler's `Actuator` protocol
(`scale(pool, replicas, now)`, `replicas(pool)`).

Config: a pool's `endpoints: {launch: ...}` is a `LaunchVllmConfig` (the gateway builds a
`server.vllm_source.LaunchedPoolSource` from it):

```yaml
pools:
  - name: decode-h100
    model: llama-3-8b              # served name; models[].max_model_len → --max-model-len
    gpu: H100
    role: decode                   # → --kv-transfer-config with kv_role kv_consumer
    tp: 2                          # → --tensor-parallel-size 2, two GPUs per replica
    gpu_memory_utilization: 0.9
    min_replicas: 1
    max_replicas: 3
    endpoints:
      launch:                      # or just `launch: vllm` for all defaults
        model: meta-llama/Meta-Llama-3-8B-Instruct   # weights (default: the model name)
        replicas: 2                # started with the gateway
        gpu_ids: ["0", "1", "2", "3"]                 # default: CUDA_VISIBLE_DEVICES, else nvidia-smi
        extra_args: [--enable-prefix-caching]
```
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from scheduler.actuators.base import ScaleAction
from server.vllm_launcher import LaunchError, VllmLaunchSpec, VllmProcess, free_port


class LaunchVllmConfig(BaseModel):
    """A pool's `endpoints.launch`: `launch: vllm` (all defaults) or a mapping with these keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["vllm"] = "vllm"
    model: str | None = None  # weights to serve: a path or HF name; None → the pool's model name
    replicas: int = Field(default=1, ge=0)  # started with the gateway; the autoscaler moves it in min..max
    gpu_ids: list[str] | None = None  # GPUs Mosaic may hand out; None → CUDA_VISIBLE_DEVICES, else nvidia-smi
    use_gpus: bool = True  # false: no GPU assignment (vLLM's CPU build)
    vllm_command: str = "vllm serve"  # split like a shell would
    extra_args: list[str] = Field(default_factory=list)  # appended to every replica's command line
    env: dict[str, str] = Field(default_factory=dict)
    host: str = "127.0.0.1"
    log_dir: str | None = None  # per-replica logs; None → a temporary folder
    stop_grace_s: float = Field(default=30.0, ge=0)
    restart_backoff_s: float = Field(default=10.0, ge=0)  # a replica that died is replaced after this

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: object) -> object:
        return {"engine": data} if isinstance(data, str) else data


class GpuAllocator:
    """Local GPU ids handed out without overlap, each to one owner (a replica id)."""

    def __init__(self, gpu_ids: Sequence[str]) -> None:
        if len(set(gpu_ids)) != len(gpu_ids):
            raise ValueError(f"gpu ids {','.join(gpu_ids)}: a GPU is listed twice")
        self._order = tuple(gpu_ids)
        self._owner: dict[str, str] = {}

    @property
    def free(self) -> tuple[str, ...]:
        return tuple(g for g in self._order if g not in self._owner)

    def owned_by(self, owner: str) -> tuple[str, ...]:
        return tuple(g for g in self._order if self._owner.get(g) == owner)

    def allocate(self, owner: str, count: int) -> tuple[str, ...]:
        """`count` free GPUs (lowest ids first) for `owner`; LaunchError naming the shortfall when too few."""
        if self.owned_by(owner):
            raise LaunchError(f"{owner} already holds GPUs {','.join(self.owned_by(owner))}")
        free = self.free
        if count > len(free):
            raise LaunchError(
                f"{owner} needs {count} GPU(s), {len(free)} free of {len(self._order)}"
                f" (in use: {', '.join(f'{g}→{o}' for g, o in sorted(self._owner.items())) or 'none'})"
            )
        chosen = free[:count]
        for gpu in chosen:
            self._owner[gpu] = owner
        return chosen

    def release(self, owner: str) -> tuple[str, ...]:
        released = self.owned_by(owner)
        for gpu in released:
            del self._owner[gpu]
        return released


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 50) -> int:
    """A base port such that base .. base+count-1 are all free now (NIXL side channel: one per TP rank)."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count - 1 > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base + 1, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise LaunchError(f"no block of {count} free ports found on {host}")


@dataclass(slots=True)
class LaunchedReplica:
    id: str
    pool: str
    url: str
    gpu_ids: tuple[str, ...]
    process: VllmProcess
    stopping_since: float | None = None  # monotonic time SIGTERM was sent


Starter = Callable[[VllmLaunchSpec, Path], VllmProcess]


def _default_starter(spec: VllmLaunchSpec, log_path: Path) -> VllmProcess:
    return VllmProcess.start(spec, log_path=log_path)


class VllmPoolLauncher:
    """The replicas of one launched pool. `template` carries every flag but port, GPUs and side-channel port."""

    def __init__(
        self,
        pool: str,
        template: VllmLaunchSpec,
        allocator: GpuAllocator,
        log_dir: Path,
        *,
        stop_grace_s: float = 30.0,
        use_gpus: bool = True,
        starter: Starter = _default_starter,
    ) -> None:
        self.pool = pool
        self.template = template
        self.allocator = allocator
        self.log_dir = log_dir
        self.stop_grace_s = stop_grace_s
        self.use_gpus = use_gpus  # False: CPU build (no GPU assignment), e.g. the CPU test environment
        self._starter = starter
        self._serial = 0
        self.desired = 0  # the count last asked for by scale_to (replicas that die are replaced up to it)
        self._live: list[LaunchedReplica] = []
        self._stopping: list[LaunchedReplica] = []

    @property
    def replicas(self) -> tuple[LaunchedReplica, ...]:
        """Replicas started and not being stopped, oldest first."""
        return tuple(self._live)

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(r.url for r in self._live)

    def start_replica(self) -> LaunchedReplica:
        """Allocate GPUs and ports and spawn the process (does not wait for /health)."""
        self._serial += 1
        replica_id = f"{self.pool}-{self._serial}"
        tp = self.template.tensor_parallel_size
        gpu_ids = self.allocator.allocate(replica_id, tp) if self.use_gpus else ()
        # Ports are probed on loopback when the server binds every interface.
        probe = "127.0.0.1" if self.template.host in ("0.0.0.0", "::") else self.template.host
        try:
            side = None if self.template.role == "mixed" else free_port_block(tp, probe)
            spec = dataclasses.replace(
                self.template, port=free_port(probe), gpu_ids=gpu_ids, nixl_side_channel_port=side
            )
            process = self._starter(spec, self.log_dir / f"{replica_id}.log")
        except Exception:
            self.allocator.release(replica_id)
            raise
        replica = LaunchedReplica(replica_id, self.pool, spec.url, gpu_ids, process)
        self._live.append(replica)
        return replica

    def wait_ready(self, replica: LaunchedReplica, timeout_s: float = 900.0) -> float:
        return replica.process.wait_healthy(timeout_s)

    def stop_replica(self, replica_id: str) -> None:
        """SIGTERM now; the process is reaped by `reap()` (GPUs are released once it has exited)."""
        replica = next((r for r in self._live if r.id == replica_id), None)
        if replica is None:
            raise KeyError(replica_id)
        self._live.remove(replica)
        replica.stopping_since = time.monotonic()
        replica.process.terminate()
        self._stopping.append(replica)

    def reap(self) -> int:
        """Finish stops: exited processes release their GPUs; those past the grace period are killed.
        Returns how many are still stopping."""
        now = time.monotonic()
        for replica in list(self._stopping):
            overdue = now - (replica.stopping_since or now) > self.stop_grace_s
            if replica.process.poll() is not None or overdue:
                replica.process.stop(timeout_s=0.0 if overdue else 5.0)
                self.allocator.release(replica.id)
                self._stopping.remove(replica)
        return len(self._stopping)

    def prune_dead(self) -> list[LaunchedReplica]:
        """Live replicas whose process exited on its own: removed, GPUs released. Returns them."""
        dead = [r for r in self._live if r.process.poll() is not None]
        for replica in dead:
            self._live.remove(replica)
            replica.process.stop(timeout_s=0.0)
            self.allocator.release(replica.id)
        return dead

    def scale_to(self, replicas: int) -> tuple[list[LaunchedReplica], list[str]]:
        """Start or stop (newest first) until `replicas` are live. Returns (started, stopped ids)."""
        self.desired = replicas
        self.reap()
        started: list[LaunchedReplica] = []
        stopped: list[str] = []
        while len(self._live) < replicas:
            started.append(self.start_replica())
        while len(self._live) > replicas:
            victim = self._live[-1].id
            self.stop_replica(victim)
            stopped.append(victim)
        return started, stopped

    def stop_all(self, timeout_s: float = 30.0) -> None:
        """Blocking: stop every replica (shutdown path)."""
        for replica in list(self._live):
            self.stop_replica(replica.id)
        deadline = time.monotonic() + timeout_s
        while self.reap() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.stop_grace_s = 0.0
        self.reap()


class VllmActuator:
    """The autoscaler's `Actuator` for launched pools: `scale` starts/stops processes without blocking."""

    def __init__(self, pools: dict[str, VllmPoolLauncher]) -> None:
        self._pools = pools

    def replicas(self, pool: str) -> int:
        launcher = self._pools.get(pool)
        return 0 if launcher is None else len(launcher.replicas)

    def scale(self, pool: str, replicas: int, now: float) -> ScaleAction:
        launcher = self._pools.get(pool)
        if launcher is None:
            return ScaleAction(
                now, pool, 0, replicas, applied=False, error=f"pool {pool!r} is not launched here"
            )
        before = len(launcher.replicas)
        try:
            launcher.scale_to(replicas)
        except LaunchError as exc:  # e.g. not enough free GPUs: keep what started, report the rest
            return ScaleAction(now, pool, before, len(launcher.replicas), applied=False, error=str(exc))
        return ScaleAction(now, pool, before, replicas, applied=True)


def pool_template(
    *,
    model: str,
    served_model_name: str,
    role: str,
    tp: int,
    max_model_len: int | None,
    gpu_memory_utilization: float | None,
    extra_args: Sequence[str] = (),
    vllm_command: Sequence[str] = ("vllm", "serve"),
    host: str = "127.0.0.1",
    env: Mapping[str, str] | None = None,
) -> VllmLaunchSpec:
    """The per-pool template a `launch: vllm` pool's replicas are made from (port filled in per replica)."""
    return VllmLaunchSpec(
        model=model,
        port=8000,
        host=host,
        served_model_name=served_model_name,
        role=role,
        tensor_parallel_size=tp,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        extra_args=tuple(extra_args),
        vllm_command=tuple(vllm_command),
        env=dict(env or {}),
    )
