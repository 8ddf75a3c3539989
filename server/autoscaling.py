"""The live autoscaler: a controller loop driving a `ScalingPolicy` with wall-clock time, acting through an actuator.

Every `autoscaler.interval_s` the controller

1. reads each managed pool's desired count from its actuator (`Actuator.replicas`); a pool whose read
   fails (403, 404, API down) is recorded as a failed scale action (`error`: "replica count unreadable:
   <status>", counted in `mosaic_autoscaler_scale_errors_total`), is not scaled this cycle, and is pinned
   at its last known count (never read: the registry's),
2. builds an `Observation` from the registry's scraped worker stats and the gateway's own metrics
   (`server.autoscale_signals.SignalReader`),
3. asks the policy (`scheduler.autoscaler.factory.build_policy`, the same objects `mosaic simulate` runs)
   for targets: every pool no actuator scales this cycle (unmanaged, or its read failed) is pinned there
   at its observed count (min = max = provisioned), so its capacity counts and the policy never buys
   capacity nobody applies, and
4. applies each changed target of a managed pool through the actuator as the backend's count (never
   plus the pool's broken workers, `SignalReader.broken`: replicas added beside crash-looping pods of a
   bad image or config crash too, and would multiply the pool up to its maximum), recording the decision
   (targets, reasons, signals) and the scale actions in bounded histories for `GET /admin/autoscaler` and
   as metrics. A signal absent from a cycle (no TTFT sample, a model gone) is removed from the
   `mosaic_autoscaler_signal` gauge rather than left at its last value.

With `autoscaler.nodes` (a node inventory) the targets pass through `server.autoscale_placement.
PlacementBook` before step 4: scale-ups are placed on nodes by the topology solver, clipped to what the
inventory holds (the decision's `placement` record says what and why), and scale-ins free node slots
once the actions applied (`PlacementBook.commit`; every cycle `PlacementBook.reconcile` also matches the
computed slots to the real counts).

`server.autoscaler_setup` builds controllers (which pools an actuator manages, their `PoolSpec`s) for
`mosaic serve` and `mosaic autoscale`. `PoolActuators` puts one actuator per pool behind the `Actuator` shape.

Metrics (`mosaic_` namespace, in the gateway's registry):

| metric | type | labels |
|---|---|---|
| mosaic_autoscaler_desired_replicas | gauge | pool: the last decision's target |
| mosaic_autoscaler_replicas | gauge | pool, state (ready, starting, draining) as observed |
| mosaic_autoscaler_scale_events_total | counter | pool, direction (up, down) |
| mosaic_autoscaler_scale_errors_total | counter | pool: actions refused or failed, unreadable replica counts, embedded workers that could not start |
| mosaic_autoscaler_signal | gauge | name: the policy's signals (`<model>/decode_demand_tps`, ...) and `ttft_p90_s`, `tpot_p90_s`, `request_rate` |
| mosaic_autoscaler_pool_signal | gauge | pool, name (decode_tokens_per_s, prompt_tokens_per_s, num_waiting, gpu_utilization) |
| mosaic_autoscaler_cycles_total, mosaic_autoscaler_cycle_errors_total | counter | |
| mosaic_autoscaler_placement_shortfall_total | counter | pool: instances the node inventory could not hold |
| mosaic_autoscaler_cross_domain_pairs, mosaic_autoscaler_fragmented_nodes | gauge | (with `autoscaler.nodes`) |
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from scheduler.actuators.base import Actuator, ScaleAction, api_error_text
from scheduler.autoscaler.factory import build_policy
from scheduler.autoscaler.signals import Observation, PoolSpec, ScalingDecision, ScalingPolicy, within_bounds
from scheduler.fleet import WorkerState
from server.autoscale_placement import PlacementBook
from server.autoscale_signals import SignalReader
from server.config import MosaicConfig
from server.registry import Registry

log = logging.getLogger("mosaic.autoscaler")
# initial replica counts of the managed pools → the actuator (built once the registry has listed them)
ActuatorFactory = Callable[[Mapping[str, int]], Actuator]
POOL_SIGNALS = ("decode_tokens_per_s", "prompt_tokens_per_s", "num_waiting", "gpu_utilization")


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.desired = Gauge(
            "mosaic_autoscaler_desired_replicas",
            "Replicas the autoscaler's last decision wants",
            ["pool"],
            registry=r,
        )
        self.replicas = Gauge(
            "mosaic_autoscaler_replicas",
            "Replicas observed at the last cycle, by state",
            ["pool", "state"],
            registry=r,
        )
        self.events = Counter(
            "mosaic_autoscaler_scale_events",
            "Scale actions applied (or recorded, dry-run)",
            ["pool", "direction"],
            registry=r,
        )
        self.errors = Counter(
            "mosaic_autoscaler_scale_errors",
            "Scale actions the actuator refused or failed",
            ["pool"],
            registry=r,
        )
        self.signal = Gauge("mosaic_autoscaler_signal", "Signals of the last decision", ["name"], registry=r)
        self.pool_signal = Gauge(
            "mosaic_autoscaler_pool_signal",
            "Per-pool signals of the last observation",
            ["pool", "name"],
            registry=r,
        )
        self.cycles = Counter("mosaic_autoscaler_cycles", "Controller cycles run", registry=r)
        self.cycle_errors = Counter(
            "mosaic_autoscaler_cycle_errors", "Controller cycles that failed", registry=r
        )


WAKE_GAP_S = 1.0  # an early cycle (`wake`) comes at least this long after the previous one


class AutoscalerController:
    """One policy, one actuator, the pools it manages. `start()` runs the loop; `cycle()` runs one."""

    def __init__(
        self,
        config: MosaicConfig,
        registry: Registry,
        reader: SignalReader,
        metrics: AutoscalerMetrics,
        specs: Sequence[PoolSpec],
        actuator_factory: ActuatorFactory,
        managed: frozenset[str],
        *,
        offload: bool = False,
        clock: Callable[[], float] = time.monotonic,
        placement: PlacementBook | None = None,
    ) -> None:
        self.config = config
        self.placement = placement
        self._placement_seeded = False
        self.settings = config.autoscaler
        self.registry = registry
        self.reader = reader
        self.metrics = metrics
        self.managed = managed
        for pool in sorted(managed):  # each series from the start: increase() misses a counter's first step
            metrics.errors.labels(pool)
            for direction in ("up", "down"):
                metrics.events.labels(pool, direction)
        self.offload = offload  # blocking actuator (Kubernetes API calls): run its calls in a thread
        self.clock = clock
        self.policy_config = self.settings.policy_config(config.slo)
        self.specs = list(specs)
        self._base_specs = tuple(specs)  # as configured; `_pin` derives each cycle's from these
        self._actuator_factory = actuator_factory
        self.actuator: Actuator | None = None
        self.policy: ScalingPolicy | None = None
        self.decisions: deque[dict[str, Any]] = deque(maxlen=self.settings.history)
        self.actions: deque[dict[str, Any]] = deque(maxlen=self.settings.history)
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._last_cycle: float | None = None
        self._known: dict[str, int] = {}  # managed pool → its count at the last successful read
        self._signal_names: set[str] = set()  # labels of mosaic_autoscaler_signal set at the last cycle

    def wake(self) -> None:
        """Run the next cycle now rather than at the end of the interval (at most one per `WAKE_GAP_S`): a
        request is waiting for a pool with no worker, so every second until the decision is added to its
        cold start (Knative's activator pokes its autoscaler the same way)."""
        self._wake.set()

    # ------------------------------------------------------------------ lifecycle
    def build(self) -> None:
        """Build actuator and policy once the registry has listed the fleet (initial counts come from it)."""
        if self.policy is not None:
            return
        initial = {s.name: self._seen(s.name) for s in self.specs}
        self.actuator = self._actuator_factory({p: n for p, n in initial.items() if p in self.managed})
        self.policy = build_policy(self.settings.policy, self.specs, self.policy_config, initial)
        # the baseline for the counters the first cycle differences, which is a cycle as far as `wake` goes:
        # a request waking the controller a few ms after start read as 1 request / few ms (26 req/s: a pool
        # at zero bought 4 workers for one request)
        self._last_cycle = self.clock()
        self.reader.observe(self._last_cycle, {})

    def _seen(self, pool: str) -> int:
        return sum(
            1
            for r in self.registry.records()
            if r.pool.name == pool and r.state() is not WorkerState.DRAINING
        )

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
            await self._until_next_cycle()
            done += 1
            try:
                await self.cycle()
            except Exception:  # the loop must survive a bad cycle (API server down, ...)
                self.metrics.cycle_errors.inc()
                log.exception("autoscaler cycle failed")
                continue
            if on_cycle is not None:
                on_cycle(self.decisions[-1])

    async def _until_next_cycle(self) -> None:
        """One interval, or less when `wake()` is called (not sooner than `WAKE_GAP_S` after the last cycle)."""
        with contextlib.suppress(TimeoutError):  # asyncio.timeout: 3.11's wait_for can drop a stop's cancel
            async with asyncio.timeout(self.settings.interval_s):
                await self._wake.wait()
        if self._wake.is_set() and self._last_cycle is not None:
            await asyncio.sleep(max(0.0, self._last_cycle + WAKE_GAP_S - self.clock()))
        self._wake.clear()

    # ------------------------------------------------------------------ one cycle
    async def cycle(self) -> ScalingDecision:
        self.build()
        assert self.policy is not None
        now = self._last_cycle = self.clock()
        desired, unreadable = await self._desired(now)
        places = getattr(self.actuator, "places", None) or (lambda pool: False)
        if self.placement is not None:
            # the instances running: the backend's count for managed pools, else the registry's
            counts = {
                s.name: desired.get(s.name, self._seen(s.name))
                for s in self.specs
                if s.name not in unreadable
            }
            if not self._placement_seeded:
                self._placement_seeded = True
                self.placement.seed(counts, places)
            else:
                self.placement.reconcile(counts, places)
        # a pool whose read failed counts at its last known size (never read: the registry's view)
        known = {p: self._known[p] for p in unreadable if p in self._known}
        obs = self.reader.observe(now, {**known, **desired})
        self._pin(
            {
                s.name: obs.pools[s.name].provisioned
                for s in self.specs
                if s.name not in desired and s.name in obs.pools
            }
        )
        decision = self.policy.decide(obs)
        bounds = {s.name: s for s in self.specs}
        targets: dict[str, int] = {
            p: within_bounds(t, obs.pools[p].provisioned, bounds[p].min_replicas, bounds[p].max_replicas)
            if p in bounds and p in obs.pools
            else t
            for p, t in decision.targets.items()
        }
        placement = None
        if self.placement is not None:
            provisioned = {p: obs.pools[p].provisioned for p in desired if p in obs.pools}
            targets, placement = self.placement.plan(targets, provisioned, self.actuator, now)
        actions = [
            ScaleAction(now, p, known.get(p, -1), known.get(p, -1), applied=False, error=why)
            for p, why in sorted(unreadable.items())
        ]
        for pool, target in sorted(targets.items()):
            if pool in desired and pool in obs.pools and target != obs.pools[pool].provisioned:
                actions.append(await self._apply(pool, target, now))
        if self.placement is not None and placement is not None:
            self.placement.commit(actions, places, placement)
        self._record(obs, decision, actions, placement)
        return decision

    async def _desired(self, now: float) -> tuple[dict[str, int], dict[str, str]]:
        """The managed pools' counts read from the actuator, and (pool → error) for those whose read failed:
        each a failed action this cycle (module docstring, step 1)."""
        assert self.actuator is not None
        out: dict[str, int] = {}
        failed: dict[str, str] = {}
        for pool in sorted(self.managed):
            try:
                out[pool] = await self._call(self.actuator.replicas, pool)
            except Exception as exc:  # not scaled this cycle, pinned at its last known count
                failed[pool] = f"replica count unreadable: {api_error_text(exc)}"
                self.metrics.errors.labels(pool).inc()
                log.warning("autoscaler: pool %s: %s; not scaled this cycle", pool, failed[pool])
        self._known.update(out)
        return out, failed

    def _pin(self, counts: Mapping[str, int]) -> None:
        """The policy's pools with min = max = `counts` for the pools nobody scales this cycle (module
        docstring, step 3); the others at their configured bounds. A policy without pools (static) is as is."""
        pinned = [
            dataclasses.replace(s, min_replicas=counts[s.name], max_replicas=counts[s.name])
            if s.name in counts
            else s
            for s in self._base_specs
        ]
        self.specs = pinned
        if self.policy is not None and hasattr(self.policy, "pools"):
            self.policy.pools = tuple(pinned)  # type: ignore[attr-defined]

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
            log.info(
                "autoscaler: pool %s %d → %d%s",
                pool,
                action.before,
                action.after,
                "" if action.applied else " (dry run)",
            )
        return action

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args) if self.offload else fn(*args)

    def _record(
        self,
        obs: Observation,
        decision: ScalingDecision,
        actions: list[ScaleAction],
        placement: dict[str, Any] | None = None,
    ) -> None:
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
        for gone in self._signal_names - set(signals):  # absent this cycle: no stale value left behind
            with contextlib.suppress(KeyError):
                m.signal.remove(gone)
        self._signal_names = set(signals)
        for a in actions:
            self.actions.append({"time": wall, **asdict(a)})
        self.decisions.append(
            {
                "time": wall,
                "targets": dict(decision.targets),
                "reasons": dict(decision.reasons),
                "signals": {k: round(v, 6) for k, v in signals.items()},
                "observation": {
                    "pools": {name: asdict(po) for name, po in obs.pools.items()},
                    "admission_queue": dict(obs.admission_queue),
                    "ttft_p90_s": obs.ttft_p90_s,
                    "tpot_p90_s": obs.tpot_p90_s,
                    "request_rate": obs.request_rate,
                    "mean_input_tokens": obs.mean_input_tokens,
                    "mean_output_tokens": obs.mean_output_tokens,
                    "models": {m: asdict(mo) for m, mo in obs.models.items()},
                },
                "actions": [asdict(a) for a in actions],
                **({"placement": placement} if placement is not None else {}),
            }
        )

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
            "topology": self.placement.describe() if self.placement is not None else None,
        }


class PoolActuators:
    """One `Actuator` over several, by pool: simulated pools → `EmbeddedActuator`, launched vLLM pools →
    `server.vllm_pool.VllmActuator`. A pool with none answers an unapplied action with an error."""

    def __init__(self, by_pool: Mapping[str, Actuator]) -> None:
        self.by_pool = dict(by_pool)

    def replicas(self, pool: str) -> int:
        return self.by_pool[pool].replicas(pool)

    def scale(self, pool: str, replicas: int, now: float) -> ScaleAction:
        inner = self.by_pool.get(pool)
        if inner is None:
            return ScaleAction(now, pool, 0, 0, applied=False, error=f"no actuator manages pool {pool!r}")
        return inner.scale(pool, replicas, now)

    def places(self, pool: str) -> bool:
        inner = self.by_pool.get(pool)
        places = getattr(inner, "places", None)
        return bool(places is not None and places(pool))

    def assign_nodes(self, pool: str, nodes: Sequence[tuple[str, str]]) -> None:
        self.by_pool[pool].assign_nodes(pool, nodes)  # type: ignore[attr-defined]

    def _unique(self) -> list[Actuator]:
        return list({id(a): a for a in self.by_pool.values()}.values())

    @property
    def events(self) -> list[dict[str, Any]]:
        merged = [e for a in self._unique() for e in getattr(a, "events", ())]
        return sorted(merged, key=lambda e: e.get("at", 0))

    async def aclose(self) -> None:
        for a in self._unique():
            close = getattr(a, "aclose", None)
            if close is not None:
                await close()
