"""Discovery source for `launch: vllm` pools: the gateway starts the pool's vLLM processes and lists them.

The gateway builds one `GpuAllocator` for all launched pools of the process (so no two replicas of any pool
share a GPU) and one `LaunchedPoolSource` per such pool:

    allocator = GpuAllocator(detect_gpu_ids())
    source = LaunchedPoolSource.for_pool(pool.name, served_model=model.name, role=pool.role, tp=pool.tp,
                                         max_model_len=model.max_model_len,
                                         gpu_memory_utilization=pool.gpu_memory_utilization,
                                         launch=pool.endpoints.launch, allocator=allocator)
    registry.add_pool(info, source)               # start(): `launch.replicas` processes are spawned
    actuator = VllmActuator({pool.name: source.launcher})   # the embedded autoscaler scales them

`list()` (every `resync_s`) reaps stopped replicas, replaces a replica whose process died (after
`restart_backoff_s`), and lists each live replica as an endpoint; readiness is the registry's own /health
probe (a replica stays `starting` until vLLM answers). `stop()` stops every replica (SIGTERM, then SIGKILL
of its process group after the grace period) without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import tempfile
import time
from pathlib import Path

from server.discovery import Endpoint
from server.vllm_launcher import LaunchError
from server.vllm_pool import GpuAllocator, LaunchVllmConfig, VllmPoolLauncher, pool_template

log = logging.getLogger("mosaic.vllm")


class LaunchedPoolSource:
    def __init__(
        self,
        launcher: VllmPoolLauncher,
        replicas: int,
        restart_backoff_s: float = 10.0,
        resync_s: float = 1.0,
    ) -> None:
        self.launcher = launcher
        self.initial_replicas = replicas
        self.restart_backoff_s = restart_backoff_s
        self.resync_s: float | None = resync_s
        self._died_at: float | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    @classmethod
    def for_pool(
        cls,
        pool: str,
        *,
        served_model: str,
        role: str,
        tp: int,
        max_model_len: int | None,
        gpu_memory_utilization: float | None,
        launch: LaunchVllmConfig,
        allocator: GpuAllocator,
    ) -> LaunchedPoolSource:
        template = pool_template(
            model=launch.model or served_model,
            served_model_name=served_model,
            role=role,
            tp=tp,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization if launch.use_gpus else None,
            extra_args=launch.extra_args,
            vllm_command=shlex.split(launch.vllm_command),
            host=launch.host,
            env=launch.env,
        )
        tmp = None
        if launch.log_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix=f"mosaic-vllm-{pool}-")
        log_dir = Path(launch.log_dir) if launch.log_dir else Path(tmp.name)  # type: ignore[union-attr]
        launcher = VllmPoolLauncher(
            pool, template, allocator, log_dir, stop_grace_s=launch.stop_grace_s, use_gpus=launch.use_gpus
        )
        source = cls(launcher, launch.replicas, launch.restart_backoff_s)
        source._tmp = tmp
        return source

    async def start(self) -> None:
        started, _ = self.launcher.scale_to(self.initial_replicas)
        for replica in started:
            log.info(
                "launched vLLM %s at %s on GPUs %s (log %s)",
                replica.id,
                replica.url,
                ",".join(replica.gpu_ids) or "-",
                replica.process.log_path,
            )

    async def list(self) -> list[Endpoint]:
        self.launcher.reap()
        dead = self.launcher.prune_dead()
        now = time.monotonic()
        for replica in dead:
            log.warning(
                "vLLM %s exited with code %s; see %s",
                replica.id,
                replica.process.poll(),
                replica.process.log_path,
            )
            self._died_at = now
        # Replace replicas that died, once the backoff has passed (a crash loop restarts at most this often).
        backoff_over = self._died_at is None or now - self._died_at >= self.restart_backoff_s
        if len(self.launcher.replicas) < self.launcher.desired and backoff_over:
            try:
                self.launcher.scale_to(self.launcher.desired)
            except LaunchError as exc:  # e.g. its GPUs are not free yet: try again on the next resync
                log.warning("cannot replace vLLM replicas of %s: %s", self.launcher.pool, exc)
        return [Endpoint(r.id, r.url, ready=r.process.poll() is None) for r in self.launcher.replicas]

    async def stop(self) -> None:
        await asyncio.to_thread(self.launcher.stop_all)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
