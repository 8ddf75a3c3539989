"""Building the live autoscaler: the pools' `PoolSpec`s, which pools an actuator manages, and the controllers
`mosaic serve` (in-process) and `mosaic autoscale` (standalone) run.

Pools an actuator manages: `embedded` → the simulated pools (`server.embedded_actuator.EmbeddedActuator`)
and launched vLLM pools (`server.vllm_pool.VllmActuator`); `kubernetes` → the pools mapped to a Deployment
(`autoscaler.kubernetes.deployments`, default every `endpoints.kubernetes` pool under its own name) or to
one Deployment per network domain (`autoscaler.kubernetes.domains`);
`dry-run` → every pool (nothing is applied). Other pools keep their size: the policy sees them with
min = max = their observed count (the controller pins them each cycle, `AutoscalerController._pin`; at
build time their configured count, or 0 for a pool whose size only discovery knows, such as a kubernetes
pool not in `autoscaler.kubernetes.deployments`), so their capacity counts and is never changed.

With `autoscaler.nodes`, `controller_for` gives the controller a `server.autoscale_placement.PlacementBook`
and the embedded actuator its `TopologyPlacer` (it records its simulated workers' nodes itself); `mosaic
autoscale` hands the same placer to the kubernetes actuator, which places the per-domain pools.

Capacities (`PoolSpec`): decode tokens/s within the TPOT SLO (`slo.tpot_ms`, default 100 ms) at
`autoscaler.context_tokens` per sequence and prefill tokens/s, from the perf model
(`scheduler.autoscaler.capacity`, shared with the cluster simulator); $/h from the worker capacity.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from placement.catalog import Catalog, load_catalog
from placement.perf_model import PerfModel
from scheduler.actuators.base import Actuator
from scheduler.actuators.dry_run import DryRunActuator
from scheduler.autoscaler.capacity import instance_capacity, no_decode_reason
from scheduler.autoscaler.signals import PoolSpec
from server.autoscale_placement import PlacementBook
from server.autoscale_signals import SignalReader
from server.autoscaling import ActuatorFactory, AutoscalerController, AutoscalerMetrics, PoolActuators
from server.config import ConfigError, MosaicConfig, PoolConfig
from server.gateway_signals import GatewaySource, RegistrySource
from server.registry import PoolInfo, Registry

if TYPE_CHECKING:
    from server.gateway import Gateway

DEFAULT_TPOT_S = 0.1  # sizing SLO when the config sets none (the cluster simulator's default too)


def pool_spec(
    config: MosaicConfig, pool: PoolConfig, info: PoolInfo, catalog: Catalog, fixed: int | None = None
) -> PoolSpec:
    """The policy's view of one pool (module docstring); `fixed` pins an unmanaged pool's size."""
    perf = PerfModel(
        catalog.gpu(pool.gpu), catalog.model(config.model_config_for(pool.model).spec_name), pool.tp
    )
    tpot_s = config.slo.tpot_ms / 1e3 if config.slo.tpot_ms else DEFAULT_TPOT_S
    # sized per engine (its sequences, its KV), then times the worker's engines (data parallelism)
    kv_tokens = info.capacity.engine_kv_blocks * info.capacity.block_size
    cap = instance_capacity(
        perf,
        tpot_s=tpot_s,
        context=config.autoscaler.context_tokens,
        max_num_seqs=pool.max_num_seqs,
        kv_tokens=kv_tokens,
    ).times(pool.dp)
    # (a pooling pool is never scaled: its decode capacity is not a reason to refuse the autoscaler)
    if pool.role != "prefill" and cap.decode_tps <= 0 and pool.runner == "generate":
        why = no_decode_reason(perf, tpot_s, config.autoscaler.context_tokens, kv_tokens)
        raise ConfigError(
            f"autoscaler: pool {pool.name}: {pool.gpu} cannot decode {pool.model} within TPOT "
            f"{tpot_s * 1e3:g} ms: {why}"
        )
    lo, hi = (fixed, fixed) if fixed is not None else (pool.min_replicas, pool.max_replicas)
    return PoolSpec(
        name=pool.name,
        model=pool.model,
        role=pool.role,
        gpu=info.gpu,
        cost_per_hour=info.capacity.cost_per_hour,
        min_replicas=lo,
        max_replicas=hi if hi is not None else max(64, lo),
        decode_tps_capacity=cap.decode_tps if pool.role != "prefill" else 0.0,
        decode_tps_by_context=cap.decode_by_context if pool.role != "prefill" else (),
        prefill_tps_capacity=cap.prefill_tps,
    )


def configured_count(pool: PoolConfig) -> int | None:
    """The size an unmanaged pool keeps: its static URLs, simulated or launched replicas; None when unknown."""
    ep = pool.endpoints
    if ep.static is not None:
        return len(ep.static)
    if ep.simulated is not None:
        return ep.simulated.replicas
    launch = getattr(ep, "launch", None)
    return getattr(launch, "replicas", None)


def time_scales(config: MosaicConfig) -> dict[str, float]:
    return {
        p.name: p.endpoints.simulated.time_scale for p in config.pools if p.endpoints.simulated is not None
    }


def pool_specs(
    config: MosaicConfig, registry: Registry, managed: frozenset[str], catalog: Catalog
) -> list[PoolSpec]:
    """Unmanaged pools pinned (min = max): at their configured count, else 0 until the controller pins them
    at their observed count (module docstring), never at free bounds nobody applies."""
    infos = {p.name: p for p in registry.pools()}
    return [
        pool_spec(config, p, infos[p.name], catalog, None if p.name in managed else configured_count(p) or 0)
        for p in config.pools
    ]


def scalable(config: MosaicConfig, pools: frozenset[str]) -> frozenset[str]:
    """`pools` less the pooling ones (embeddings): the policy's signal, decode tokens/s, is one they never
    produce, so an actuator managing one would only ever scale it down. Left unmanaged, they are pinned at
    their configured or observed count."""
    pooling = {p.name for p in config.pools if p.runner == "pooling"}
    return frozenset(pools - pooling)


def in_process(config: MosaicConfig) -> bool:
    """`mosaic serve` runs the controller itself (the kubernetes actuator runs in `mosaic autoscale`)."""
    return config.autoscaler.enabled and config.autoscaler.actuator in ("embedded", "dry-run")


def _launched_idle(gw: Gateway, pool: str) -> Callable[[str], bool]:
    """Replica id of launched `pool` → nothing routed to it is unfinished at the gateway (an open routing
    decision, P/D peers' included, or an in-flight request)."""

    decisions = gw.open_decisions

    def idle(replica_id: str) -> bool:
        wid = f"{pool}/{replica_id}"
        if decisions is not None and decisions.count(wid):
            return False
        rec = gw.registry.get(wid)
        return rec is None or rec.inflight_requests == 0

    return idle


def in_process_controller(gw: Gateway) -> AutoscalerController:
    """The controller `mosaic serve` runs (`in_process(config)`): the embedded actuator over the gateway's
    simulated pools (soft scale-in through `gw.open_decisions`), or dry-run over every pool."""
    config = gw.config
    a = config.autoscaler
    factory: ActuatorFactory
    if a.actuator == "embedded":
        from server.embedded import SimulatedPoolSource
        from server.embedded_actuator import EmbeddedActuator
        from server.vllm_pool import VllmActuator, VllmPoolLauncher

        sims = {name: src for name, src in gw.sources.items() if isinstance(src, SimulatedPoolSource)}
        launchers = {name: getattr(src, "launcher", None) for name, src in gw.sources.items()}
        launched = {name: lp for name, lp in launchers.items() if isinstance(lp, VllmPoolLauncher)}
        managed = frozenset(sims) | frozenset(launched)
        built: list[AutoscalerController] = []  # the controller, once built: its placer goes to the actuator

        def factory(initial: Mapping[str, int]) -> Actuator:
            book = built[0].placement if built else None
            embedded = EmbeddedActuator(
                sims,
                gw.registry,
                decisions=gw.open_decisions,
                cold_start_s=a.cold_start_s,
                drain_timeout_s=a.drain_timeout_s,
                keep_events=a.history,
                clock=gw.clock,
                placer=book.placer if book is not None else None,
                on_error=(lambda pool: built[0].metrics.errors.labels(pool).inc()) if built else None,
            )
            for name, lp in launched.items():  # soft scale-in: drained at the gateway, then SIGTERM
                lp.idle = _launched_idle(gw, name)
                lp.drain_timeout_s = a.drain_timeout_s
            vllm = VllmActuator(launched)
            return PoolActuators({**dict.fromkeys(sims, embedded), **dict.fromkeys(launched, vllm)})
    else:
        managed = frozenset(p.name for p in config.pools)

        def factory(initial: Mapping[str, int]) -> Actuator:
            return DryRunActuator(initial, keep=a.history)

    controller = controller_for(
        config,
        gw.registry,
        gw.metrics.registry,
        actuator_factory=factory,
        managed=managed,
        clock=gw.clock,
    )
    if a.actuator == "embedded":
        built.append(controller)
    return controller


def controller_for(
    config: MosaicConfig,
    registry: Registry,
    metrics_registry: CollectorRegistry,
    *,
    actuator_factory: ActuatorFactory,
    managed: frozenset[str],
    gateway: GatewaySource | None = None,
    offload: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> AutoscalerController:
    """A controller over `registry`; its busy-proxy sampling hooks into the registry's scrape rounds.

    `gateway`: where the gateway-side signals come from; None → this process's own gateway metrics in
    `metrics_registry` (`mosaic serve`); `mosaic autoscale` passes its `GatewayScraper`."""
    reader = SignalReader(
        registry,
        config.scrape.stale_after_s,
        clock,
        time_scales(config),
        gateway if gateway is not None else RegistrySource(metrics_registry, clock),
        cold_start_s=config.autoscaler.cold_start_s,
    )
    catalog = load_catalog(config.catalog)
    managed = scalable(config, managed)
    specs = pool_specs(config, registry, managed, catalog)
    placement = PlacementBook.from_config(config, specs, catalog, metrics_registry)
    registry.on_refresh.append(reader.on_scrape)
    return AutoscalerController(
        config,
        registry,
        reader,
        AutoscalerMetrics(metrics_registry),
        specs,
        actuator_factory,
        managed,
        offload=offload,
        clock=clock,
        placement=placement,
    )
