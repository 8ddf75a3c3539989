"""Simulated pools started in-process, and the embedded default fleet `mosaic serve` runs with no config.

The default (`default_config()`): one model, `llama-3-8b`, on three GPU types in three roles —

| pool | GPU | role | replicas | why |
|---|---|---|---|---|
| prefill-h100 | H100-SXM | prefill | 1 | compute-bound prefill on the fastest FLOPs |
| decode-a100 | A100-80GB | decode | 2 | bandwidth-bound decode on cheaper HBM with plenty of KV room |
| mixed-l4 | L4 | mixed | 2 | a cheap GDDR card taking short requests end to end |

Prompts of at least `routing.pd_threshold_tokens` (256) go prefill-h100 → decode-a100 (P/D two-hop with
simulated KV transfer); shorter ones go to a decode or mixed worker, split by capacity. Workers are
`simulator.worker_server.start_worker_server` instances on 127.0.0.1 (free ports) in the gateway's own
event loop, each running the engine model at `time_scale` × real time (1 = realistic latencies).

A `SimulatedPoolSource` is a discovery source: `start()` launches the replicas, `list()` reports them,
`scale_to(n)` adds or stops replicas at run time (the registry re-lists every `resync_s`), `stop()` stops
them all. The embedded autoscaler actuator (`server.embedded_actuator`) uses the finer hooks:
`start_replica(cold_start_s)` (listed not-ready until the cold start has passed, so the registry holds it
as `starting`), `set_draining(index)` (listed terminating: routed nothing new) and `stop_replica(index)`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from server.config import ModelConfig, MosaicConfig, PoolConfig, SimulatedSource, validate_config
from server.discovery import Endpoint
from simulator.engine import EngineConfig
from simulator.engine_types import LONG_MAX_MODEL_LEN_ENV, vllm_env_flag
from simulator.lora import LoraModule
from simulator.worker_app import FaultConfig, WorkerConfig
from simulator.worker_server import RunningWorker, start_worker_server

DEFAULT_MODEL = "llama-3-8b"


def default_config(time_scale: float = 1.0, seed: int = 0, **sections: Any) -> MosaicConfig:
    """The embedded heterogeneous fleet (module docstring); extra top-level sections merge in."""

    def sim(replicas: int, offset: int) -> dict[str, Any]:
        return {"simulated": {"replicas": replicas, "time_scale": time_scale, "seed": seed + offset}}

    data: dict[str, Any] = {
        "models": [{"name": DEFAULT_MODEL}],
        "pools": [
            {
                "name": "prefill-h100",
                "model": DEFAULT_MODEL,
                "gpu": "H100-SXM",
                "role": "prefill",
                "endpoints": sim(1, 0),
            },
            {
                "name": "decode-a100",
                "model": DEFAULT_MODEL,
                "gpu": "A100-80GB",
                "role": "decode",
                "endpoints": sim(2, 10),
            },
            {
                "name": "mixed-l4",
                "model": DEFAULT_MODEL,
                "gpu": "L4",
                "role": "mixed",
                "endpoints": sim(2, 20),
            },
        ],
        **sections,
    }
    return validate_config(data, "embedded default")


class SimulatedPoolSource:
    """Discovery source that owns a pool's simulated workers (see module docstring)."""

    def __init__(
        self,
        pool: PoolConfig,
        model: ModelConfig,
        sim: SimulatedSource,
        catalog_path: str | None = None,
        resync_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.model = model
        self.sim = sim
        self.catalog_path = catalog_path
        self.resync_s: float | None = resync_s
        self.workers: dict[int, RunningWorker] = {}
        self.ready_at: dict[int, float] = {}  # cold start: listed not-ready before this clock time
        self.draining: set[int] = set()  # listed terminating: the registry routes them nothing new
        self.domains: dict[
            int, str
        ] = {}  # network domain of each worker's node (set by the embedded actuator)
        self.clock = clock
        self._next = 0
        self._lock = asyncio.Lock()

    def worker_config(self, index: int) -> WorkerConfig:
        pool, sim = self.pool, self.sim
        extra: dict[str, Any] = {"kv_link_gbps": sim.kv_link_gbps} if sim.kv_link_gbps else {}
        return WorkerConfig(
            gpu=pool.gpu,
            model=self.model.spec_name,
            role=pool.role,
            runner=pool.runner,
            tp=pool.tp,
            time_scale=sim.time_scale,
            seed=sim.seed + index,
            engine=EngineConfig(
                max_num_seqs=pool.max_num_seqs,
                block_size=pool.block_size,
                gpu_memory_utilization=pool.gpu_memory_utilization,
                max_model_len=self.model.max_model_len,
                max_loras=sim.max_loras,
                # the gateway's environment is its simulated workers' (vLLM reads it from its own)
                allow_long_max_model_len=vllm_env_flag(os.environ, LONG_MAX_MODEL_LEN_ENV),
            ),
            served_model_name=self.model.name,
            catalog_path=self.catalog_path,
            faults=FaultConfig(error_rate=sim.error_rate),
            engine_id=f"{pool.name}-{index}",
            data_parallel_size=pool.dp,
            lora_modules=tuple(LoraModule(m.name, m.module_path) for m in sim.lora_modules),
            enable_lora=sim.allow_runtime_lora_updating,  # adapters turn LoRA on by themselves
            allow_runtime_lora_updating=sim.allow_runtime_lora_updating,
            **extra,
        )

    async def start(self) -> None:
        await self.scale_to(self.sim.replicas)

    async def scale_to(self, replicas: int) -> None:
        """Start or stop replicas until `replicas` run (newest stopped first)."""
        while len(self.workers) < replicas:
            await self.start_replica()
        while len(self.workers) > replicas:
            await self.stop_replica(max(self.workers))

    async def start_replica(self, cold_start_s: float = 0.0) -> int:
        """Start one worker; it is listed ready only `cold_start_s` from now. Returns its index."""
        async with self._lock:
            index = self._next
            self._next += 1
            self.workers[index] = await start_worker_server(self.worker_config(index))
            if cold_start_s > 0:
                self.ready_at[index] = self.clock() + cold_start_s
            return index

    def set_draining(self, index: int, draining: bool = True) -> None:
        (self.draining.add if draining else self.draining.discard)(index)

    async def stop_replica(self, index: int) -> None:
        """Stop one worker now (open streams are cut: drain it first) and stop listing it."""
        async with self._lock:
            worker = self.workers.pop(index, None)
            self.ready_at.pop(index, None)
            self.draining.discard(index)
            self.domains.pop(index, None)
        if worker is not None:
            await worker.stop()

    def endpoint_name(self, index: int) -> str:
        return f"sim-{index}"

    async def list(self) -> list[Endpoint]:
        now = self.clock()
        return [
            Endpoint(
                self.endpoint_name(i),
                w.url,
                ready=self.ready_at.get(i, now) <= now,
                terminating=i in self.draining,
                domain=self.domains.get(i),
            )
            for i, w in sorted(self.workers.items())
        ]

    async def stop(self) -> None:
        async with self._lock:
            workers, self.workers = list(self.workers.values()), {}
        for w in workers:
            await w.stop()


def simulated_source(config: MosaicConfig, pool: PoolConfig) -> SimulatedPoolSource:
    assert pool.endpoints.simulated is not None
    return SimulatedPoolSource(
        pool, config.model_config_for(pool.model), pool.endpoints.simulated, config.catalog
    )
