"""The live autoscaler: a controller loop driving a `ScalingPolicy` with wall-clock time, acting through an actuator.

Every `autoscaler.interval_s` the controller

1. reads each managed pool's desired count from its actuator (`Actuator.replicas`),
2. builds an `Observation` from the registry's scraped worker stats and the gateway's own metrics
   (`server.autoscale_signals.SignalReader`),
3. asks the policy (`scheduler.autoscaler.factory.build_policy`, the same objects `mosaic simulate` runs)
   for targets, and
4. applies each changed target of a managed pool through the actuator, recording the decision (targets,
   reasons, signals) and the scale actions in bounded histories for `GET /admin/autoscaler` and as metrics.

Pools an actuator manages: `embedded` → the simulated pools; `kubernetes` → the pools mapped to a
Deployment (`autoscaler.kubernetes.deployments`, default every `endpoints.kubernetes` pool under its own
name); `dry-run` → every pool (nothing is applied). Other pools keep their size: the policy sees them
with min = max = their configured count, so their capacity counts and is never changed.

Capacities (`PoolSpec`): decode tokens/s within the TPOT SLO (`slo.tpot_ms`, default 100 ms) at
`autoscaler.context_tokens` per sequence and prefill tokens/s, from the perf model
(`scheduler.autoscaler.capacity`, shared with the cluster simulator); $/h from the worker capacity.

Metrics (`mosaic_` namespace, in the gateway's registry):

| metric | type | labels |
|---|---|---|
| mosaic_autoscaler_desired_replicas | gauge | pool: the last decision's target |
| mosaic_autoscaler_replicas | gauge | pool, state (ready, starting, draining) as observed |
| mosaic_autoscaler_scale_events_total | counter | pool, direction (up, down) |
| mosaic_autoscaler_scale_errors_total | counter | pool |
| mosaic_autoscaler_signal | gauge | name: the policy's signals (`<model>/decode_demand_tps`, ...) and `ttft_p90_s`, `tpot_p90_s`, `request_rate` |
| mosaic_autoscaler_pool_signal | gauge | pool, name (decode_tokens_per_s, prompt_tokens_per_s, num_waiting, gpu_utilization) |
| mosaic_autoscaler_cycles_total, mosaic_autoscaler_cycle_errors_total | counter | |
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from scheduler.actuators.base import Actuator, ScaleAction
from scheduler.actuators.dry_run import DryRunActuator
from scheduler.autoscaler.capacity import instance_capacity
from scheduler.autoscaler.factory import build_policy
from scheduler.autoscaler.signals import Observation, PoolSpec, ScalingDecision, ScalingPolicy
from scheduler.fleet import WorkerState
from server.autoscale_signals import SignalReader
from server.config import ConfigError, MosaicConfig, PoolConfig
from server.registry import PoolInfo, Registry

if TYPE_CHECKING:
    from server.gateway import Gateway

log = logging.getLogger("mosaic.autoscaler")
ActuatorFactory = Callable[[Mapping[str, int]], Actuator]  # initial replica counts of the managed pools → actuator

DEFAULT_TPOT_S = 0.1  # sizing SLO when the config sets none (the cluster simulator's default too)
POOL_SIGNALS = ("decode_tokens_per_s", "prompt_tokens_per_s", "num_waiting", "gpu_utilization")


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.desired = Gauge("mosaic_autoscaler_desired_replicas", "Replicas the autoscaler's last decision wants", ["pool"], registry=r)
        self.replicas = Gauge("mosaic_autoscaler_replicas", "Replicas observed at the last cycle, by state", ["pool", "state"], registry=r)
        self.events = Counter("mosaic_autoscaler_scale_events", "Scale actions applied (or recorded, dry-run)", ["pool", "direction"], registry=r)
        self.errors = Counter("mosaic_autoscaler_scale_errors", "Scale actions the actuator refused or failed", ["pool"], registry=r)
        self.signal = Gauge("mosaic_autoscaler_signal", "Signals of the last decision", ["name"], registry=r)
        self.pool_signal = Gauge("mosaic_autoscaler_pool_signal", "Per-pool signals of the last observation", ["pool", "name"], registry=r)
        self.cycles = Counter("mosaic_autoscaler_cycles", "Controller cycles run", registry=r)
        self.cycle_errors = Counter("mosaic_autoscaler_cycle_errors", "Controller cycles that failed", registry=r)


def pool_spec(config: MosaicConfig, pool: PoolConfig, info: PoolInfo, fixed: int | None = None) -> PoolSpec:
    """The policy's view of one pool (module docstring); `fixed` pins an unmanaged pool's size."""
    catalog = load_catalog(config.catalog)
    perf = PerfModel(catalog.gpu(pool.gpu), catalog.model(config.model_config_for(pool.model).spec_name), pool.tp)
    tpot_s = config.slo.tpot_ms / 1e3 if config.slo.tpot_ms else DEFAULT_TPOT_S
    cap = instance_capacity(perf, tpot_s=tpot_s, context=config.autoscaler.context_tokens,
                            max_num_seqs=pool.max_num_seqs, kv_tokens=info.capacity.kv_blocks * info.capacity.block_size)
    if pool.role != "prefill" and cap.decode_tps <= 0:
        raise ConfigError(f"autoscaler: pool {pool.name}: {pool.gpu} cannot decode {pool.model} within TPOT "
                          f"{tpot_s * 1e3:g} ms at {config.autoscaler.context_tokens} tokens of context")
    lo, hi = (fixed, fixed) if fixed is not None else (pool.min_replicas, pool.max_replicas)
    return PoolSpec(
        name=pool.name, model=pool.model, role=pool.role, gpu=info.gpu, cost_per_hour=info.capacity.cost_per_hour,
        min_replicas=lo, max_replicas=hi if hi is not None else max(64, lo),
        decode_tps_capacity=cap.decode_tps if pool.role != "prefill" else 0.0, prefill_tps_capacity=cap.prefill_tps,
    )


def configured_count(pool: PoolConfig) -> int | None:
    ep = pool.endpoints
    if ep.static is not None:
        return len(ep.static)
    if ep.simulated is not None:
        return ep.simulated.replicas
    return None


def time_scales(config: MosaicConfig) -> dict[str, float]:
    return {p.name: p.endpoints.simulated.time_scale for p in config.pools if p.endpoints.simulated is not None}


class AutoscalerController:
    """One policy, one actuator, the pools it manages. `start()` runs the loop; `cycle()` runs one."""

    def __init__(
        self,
        config: MosaicConfig,
        registry: Registry,
        reader: SignalReader,
        metrics: AutoscalerMetrics,
        actuator_factory: ActuatorFactory,
        managed: frozenset[str],
        *,
        offload: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.settings = config.autoscaler
        self.registry = registry
        self.reader = reader
        self.metrics = metrics
        self.managed = managed
        self.offload = offload  # blocking actuator (Kubernetes API calls): run its calls in a thread
        self.clock = clock
        self.policy_config = self.settings.policy_config(config.slo)
        infos = {p.name: p for p in registry.pools()}
        self.specs = [pool_spec(config, p, infos[p.name], None if p.name in managed else configured_count(p))
                      for p in config.pools]
        self._actuator_factory = actuator_factory
        self.actuator: Actuator | None = None
        self.policy: ScalingPolicy | None = None
        self.decisions: deque[dict[str, Any]] = deque(maxlen=self.settings.history)
        self.actions: deque[dict[str, Any]] = deque(maxlen=self.settings.history)
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def build(self) -> None:
        """Build actuator and policy once the registry has listed the fleet (initial counts come from it)."""
        if self.policy is not None:
            return
        initial = {s.name: self._seen(s.name) for s in self.specs}
        self.actuator = self._actuator_factory({p: n for p, n in initial.items() if p in self.managed})
        self.policy = build_policy(self.settings.policy, self.specs, self.policy_config, initial)
        self.reader.observe(self.clock(), {})  # baseline for the counters the first cycle differences

    def _seen(self, pool: str) -> int:
        return sum(1 for r in self.registry.records() if r.pool.name == pool and r.state() is not WorkerState.DRAINING)

    def start(self) -> None:
        self.build()
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        close = getattr(self.actuator, "aclose", None)
        if close is not None:
            await close()

    async def run(self, cycles: int = 0, on_cycle: Callable[[dict[str, Any]], None] | None = None) -> None:
        """A cycle every `interval_s` (the first one interval after start, so rates have a baseline);
        `cycles` > 0 stops after that many. `on_cycle` gets each recorded decision."""
        self.build()
        done = 0
        while not cycles or done < cycles:
            await asyncio.sleep(self.settings.interval_s)
            done += 1
            try:
                await self.cycle()
            except Exception:  # the loop must survive a bad cycle (API server down, ...)
                self.metrics.cycle_errors.inc()
                log.exception("autoscaler cycle failed")
                continue
            if on_cycle is not None:
                on_cycle(self.decisions[-1])

    # ------------------------------------------------------------------ one cycle
    async def cycle(self) -> ScalingDecision:
        self.build()
        assert self.policy is not None
        now = self.clock()
        desired = await self._desired()
        obs = self.reader.observe(now, desired)
        decision = self.policy.decide(obs)
        actions = []
        for pool, target in sorted(decision.targets.items()):
            if pool in desired and pool in obs.pools and target != obs.pools[pool].provisioned:
                actions.append(await self._apply(pool, target, now))
        self._record(obs, decision, actions)
        return decision

    async def _desired(self) -> dict[str, int]:
        assert self.actuator is not None
        out: dict[str, int] = {}
        for pool in sorted(self.managed):
            try:
                out[pool] = await self._call(self.actuator.replicas, pool)
            except Exception as exc:  # unmanaged this cycle: the policy sees what the registry sees
                log.warning("autoscaler: cannot read the replica count of pool %s: %s", pool, exc)
        return out

    async def _apply(self, pool: str, target: int, now: float) -> ScaleAction:
        assert self.actuator is not None
        try:
            action = await self._call(self.actuator.scale, pool, target, now)
        except Exception as exc:
            action = ScaleAction(now, pool, -1, -1, applied=False, error=f"{type(exc).__name__}: {exc}")
        if action.error is not None:
            self.metrics.errors.labels(pool).inc()
            log.warning("autoscaler: scaling pool %s to %d failed: %s", pool, target, action.error)
        elif action.after != action.before:
            self.metrics.events.labels(pool, "up" if action.after > action.before else "down").inc()
            log.info("autoscaler: pool %s %d → %d%s", pool, action.before, action.after,
                     "" if action.applied else " (dry run)")
        return action

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args) if self.offload else fn(*args)

    def _record(self, obs: Observation, decision: ScalingDecision, actions: list[ScaleAction]) -> None:
        m = self.metrics
        m.cycles.inc()
        wall = round(time.time(), 3)
        for pool, target in decision.targets.items():
            m.desired.labels(pool).set(target)
        for pool, po in obs.pools.items():
            for state in ("ready", "starting", "draining"):
                m.replicas.labels(pool, state).set(getattr(po, state))
            for name in POOL_SIGNALS:
                m.pool_signal.labels(pool, name).set(float(getattr(po, name)))
        signals = {**decision.signal, "request_rate": obs.request_rate}
        for name in ("ttft_p90_s", "tpot_p90_s"):
            value = getattr(obs, name)
            if value is not None:
                signals[name] = value
        for name, value in signals.items():
            m.signal.labels(name).set(value)
        for a in actions:
            self.actions.append({"time": wall, **asdict(a)})
        self.decisions.append({
            "time": wall,
            "targets": dict(decision.targets),
            "reasons": dict(decision.reasons),
            "signals": {k: round(v, 6) for k, v in signals.items()},
            "observation": {
                "pools": {name: asdict(po) for name, po in obs.pools.items()},
                "admission_queue": dict(obs.admission_queue),
                "ttft_p90_s": obs.ttft_p90_s, "tpot_p90_s": obs.tpot_p90_s, "request_rate": obs.request_rate,
                "mean_input_tokens": obs.mean_input_tokens, "mean_output_tokens": obs.mean_output_tokens,
            },
            "actions": [asdict(a) for a in actions],
        })

    # ------------------------------------------------------------------ reporting
    def describe(self, last: int = 20) -> dict[str, Any]:
        """For `GET /admin/autoscaler`: settings, pools as the policy sees them, recent decisions and actions."""
        events = getattr(self.actuator, "events", None)
        return {
            "enabled": True,
            "config": self.settings.model_dump(mode="json"),
            "policy_config": asdict(self.policy_config),
            "managed_pools": sorted(self.managed),
            "pools": [asdict(s) for s in self.specs],
            "decisions": list(self.decisions)[-last:],
            "actions": list(self.actions)[-last:],
            "actuator_events": list(events)[-last:] if events is not None else [],
        }


# ---------------------------------------------------------------------------------------------- builders


def in_process(config: MosaicConfig) -> bool:
    """`mosaic serve` runs the controller itself (the kubernetes actuator runs in `mosaic autoscale`)."""
    return config.autoscaler.enabled and config.autoscaler.actuator in ("embedded", "dry-run")


def in_process_controller(gw: Gateway) -> AutoscalerController:
    """The controller `mosaic serve` runs (`in_process(config)`): the embedded actuator over the gateway's
    simulated pools (soft scale-in through `gw.open_decisions`), or dry-run over every pool."""
    config = gw.config
    a = config.autoscaler
    factory: ActuatorFactory
    if a.actuator == "embedded":
        from server.embedded import SimulatedPoolSource
        from server.embedded_actuator import EmbeddedActuator

        sims = {name: src for name, src in gw.sources.items() if isinstance(src, SimulatedPoolSource)}
        managed = frozenset(sims)

        def factory(initial: Mapping[str, int]) -> Actuator:
            return EmbeddedActuator(sims, gw.registry, decisions=gw.open_decisions, cold_start_s=a.cold_start_s,
                                    drain_timeout_s=a.drain_timeout_s, keep_events=a.history, clock=gw.clock)
    else:
        managed = frozenset(p.name for p in config.pools)

        def factory(initial: Mapping[str, int]) -> Actuator:
            return DryRunActuator(initial, keep=a.history)

    return controller_for(config, gw.registry, gw.metrics.registry, actuator_factory=factory, managed=managed,
                          admission=gw.admission.depths, clock=gw.clock)


def controller_for(
    config: MosaicConfig,
    registry: Registry,
    metrics_registry: CollectorRegistry,
    *,
    actuator_factory: ActuatorFactory,
    managed: frozenset[str],
    admission: Callable[[], dict[str, int]] | None = None,
    gateway_metrics: bool = True,
    offload: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> AutoscalerController:
    """A controller over `registry`; its busy-proxy sampling hooks into the registry's scrape rounds."""
    reader = SignalReader(registry, config.scrape.stale_after_s, clock, time_scales(config),
                          metrics_registry if gateway_metrics else None, admission)
    registry.on_refresh.append(reader.on_scrape)
    return AutoscalerController(config, registry, reader, AutoscalerMetrics(metrics_registry), actuator_factory,
                                managed, offload=offload, clock=clock)
