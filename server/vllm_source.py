"""Discovery source for `launch: vllm` pools: the gateway starts the pool's vLLM processes and lists them.

The gateway builds one `GpuAllocator` for all launched pools of the process (so no two replicas of any pool
share a GPU; each pool draws only from its own `launch.gpu_ids` when given) and one `LaunchedPoolSource` per
such pool (`Gateway._launched_source`):

    allocator = GpuAllocator(detect_gpu_ids(),     # or the pools' gpu_ids when nothing is detected
                             {p.name: p.endpoints.launch.gpu_ids for p in launched_gpu_pools})
    source = LaunchedPoolSource.for_pool(pool.name, served_model=model.name, role=pool.role, tp=pool.tp,
                                         dp=pool.dp, max_model_len=model.max_model_len,
                                         gpu_memory_utilization=pool.gpu_memory_utilization,
                                         max_num_seqs=pool.max_num_seqs, block_size=pool.block_size,
                                         launch=pool.endpoints.launch, allocator=allocator,
                                         api_key=..., drop_env=...)
    registry.add_pool(info, source)               # start(): `launch.replicas` processes are spawned
    actuator = VllmActuator({pool.name: source.launcher})   # the embedded autoscaler scales them

`start()` spawns `launch.replicas` processes; if one cannot be started (too few GPUs, vLLM not installed) the
ones already started are stopped and LaunchError names the pool (`mosaic serve` exits 2 with that line).

`list()` (every `resync_s`) stops drained replicas (soft scale-in, `VllmPoolLauncher.finish_drains`; they
are listed as terminating until then), reaps stopped replicas; replaces a replica whose process died, and one that has
not answered /health within `launch.start_timeout_s` (stopped first: a hung start would hold its GPUs for
good); and lists each live replica as an endpoint. Replacements and failed scale-ups wait out the pool's
backoff (`restart_backoff_s`, doubling per consecutive failure up to `restart_backoff_max_s`; reset once a
replica has answered /health for `restart_backoff_reset_s`); a failing start is logged once per failure streak, not once per retry. Readiness
for routing is the registry's own /health probe (a replica stays `starting` until vLLM answers). `stop()`
stops every replica (SIGTERM, then SIGKILL of its process group after the grace period) without blocking the
event loop. Starts happen on the event-loop thread, which lives as long as the replicas (parent-death signal,
`server.vllm_launcher`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path

from server.discovery import Endpoint
from server.vllm_launcher import LaunchError
from server.vllm_pool import (
    Backoff,
    GpuAllocator,
    LaunchVllmConfig,
    VllmPoolLauncher,
    default_log_dir,
    pool_template,
)

log = logging.getLogger("mosaic.vllm")


class LaunchedPoolSource:
    def __init__(
        self,
        launcher: VllmPoolLauncher,
        replicas: int,
        restart_backoff_s: float = 10.0,
        resync_s: float = 1.0,
        restart_backoff_max_s: float = 300.0,
        restart_backoff_reset_s: float = 600.0,
    ) -> None:
        self.launcher = launcher
        self.initial_replicas = replicas
        self.restart_backoff_s = restart_backoff_s
        self.resync_s: float | None = resync_s
        # One backoff for every start of the pool: replacements here and the autoscaler's scale-ups alike.
        launcher.backoff = Backoff(restart_backoff_s, restart_backoff_max_s, restart_backoff_reset_s)
        self._start_failing = False  # a failed start was logged and no start has succeeded since

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
        runner: str = "generate",
        allocator: GpuAllocator,
        max_num_seqs: int | None = None,
        block_size: int | None = None,
        dp: int = 1,
        api_key: str | None = None,
        drop_env: Iterable[str] = (),
    ) -> LaunchedPoolSource:
        """`dp`: engines per replica (`--data-parallel-size`), each on `tp` GPUs. `api_key`: the pool's key (its `api_key_env`), given to vLLM as VLLM_API_KEY so that vLLM checks
        the key the gateway sends. `drop_env`: variables never passed to vLLM (the gateway's key variables)."""
        template = pool_template(
            model=launch.model or served_model,
            served_model_name=served_model,
            role=role,
            runner=runner,
            tp=tp,
            dp=dp,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization if launch.use_gpus else None,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            extra_args=launch.extra_args,
            vllm_command=launch.argv,
            host=launch.host,
            advertise_host=launch.advertise_host,
            env=launch.env,
            pass_env=launch.pass_env,
            drop_env=drop_env,
            api_key=api_key,
            # SIGTERM lets running requests finish for the grace period less 5 s of exit (then SIGKILL)
            shutdown_timeout_s=max(1, int(launch.stop_grace_s) - 5),
        )
        launcher = VllmPoolLauncher(
            pool,
            template,
            allocator,
            Path(launch.log_dir) if launch.log_dir else default_log_dir(pool),
            stop_grace_s=launch.stop_grace_s,
            use_gpus=launch.use_gpus,
            gpu_ids=launch.gpu_ids,
            start_timeout_s=launch.start_timeout_s,
            # the default folder is shared by every run: keep only what explains a failure
            keep_clean_logs=launch.log_dir is not None,
        )
        return cls(
            launcher,
            launch.replicas,
            launch.restart_backoff_s,
            restart_backoff_max_s=launch.restart_backoff_max_s,
            restart_backoff_reset_s=launch.restart_backoff_reset_s,
        )

    async def start(self) -> None:
        try:
            self.launcher.scale_to(self.initial_replicas)
        except LaunchError as exc:
            # Do not leave the replicas that did start running behind a gateway that is not going to serve.
            await self.stop()
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise LaunchError(
                f"pool {self.launcher.pool}: cannot start its {self.initial_replicas} vLLM replica(s)"
                f" (endpoints.launch): {first}"
            ) from None

    async def list(self) -> list[Endpoint]:
        launcher = self.launcher
        for replica, forced in launcher.finish_drains():
            if forced:
                log.warning(
                    "vLLM %s still busy after %.0f s of draining (autoscaler.drain_timeout_s): stopped anyway",
                    replica.id,
                    launcher.drain_timeout_s,
                )
            else:
                log.info("vLLM %s drained: stopped", replica.id)
        launcher.reap()
        for replica in launcher.prune_dead():
            log.warning(
                "vLLM %s exited with code %s%s; next start in %.0f s; log %s",
                replica.id,
                replica.process.poll(),
                "" if replica.ready_at is not None else " before answering /health",
                max(0.0, launcher.backoff.retry_at - launcher.clock()),
                replica.process.log_path,
            )
        if any(r.ready_at is None for r in launcher.replicas):
            # /health with a short timeout, off the event loop (a loading vLLM may not answer at all)
            for replica in await asyncio.to_thread(launcher.check_ready):
                ready_s = (replica.ready_at or replica.started_at) - replica.started_at
                log.info("vLLM %s ready after %.0f s", replica.id, ready_s)
                self._start_failing = False
        for replica in launcher.overdue():
            launcher.stop_replica(replica.id, failed=True)
            delay = launcher.backoff.fail(launcher.clock())
            log.warning(
                "vLLM %s did not answer /health within %.0f s of its start (launch.start_timeout_s): stopped, "
                "replaced in %.0f s; log %s",
                replica.id,
                launcher.start_timeout_s,
                delay,
                replica.process.log_path,
            )
        missing = len(launcher.replicas) < launcher.desired
        if missing and launcher.backoff.ready(launcher.clock()):
            try:
                launcher.scale_to(launcher.desired)
            except LaunchError as exc:  # e.g. its GPUs are not free yet: try again after the backoff
                wait = max(0.0, launcher.backoff.retry_at - launcher.clock())
                level = logging.DEBUG if self._start_failing else logging.WARNING
                log.log(
                    level,
                    "cannot start vLLM replicas of %s: %s; retrying in %.0f s (backing off; logged once until "
                    "a replica starts)",
                    launcher.pool,
                    str(exc).splitlines()[0],
                    wait,
                )
                self._start_failing = True
        live = [Endpoint(r.id, r.url, ready=r.process.poll() is None) for r in launcher.replicas]
        # draining replicas stay listed as terminating: the registry keeps their in-flight requests' books and
        # the router chooses them no more
        return live + [Endpoint(r.id, r.url, terminating=True) for r in launcher.draining]

    async def stop(self) -> None:
        await asyncio.to_thread(self.launcher.stop_all)
