"""The `embedded` actuator: start and stop the live gateway's simulated workers, with a cold start and a soft scale-in.

It implements the autoscaler's `Actuator` shape (`scale(pool, replicas, now) -> ScaleAction`,
`replicas(pool)`) without blocking: `scale` records the desired count and a background task reconciles
the pool's `SimulatedPoolSource` (`server.embedded`) towards it.

- **Scale-out**: a draining worker is taken back first (it is warm and already listed); otherwise a new
  worker is started and listed *not ready* until `cold_start_s` has passed, so the registry holds it as
  `starting` (the router sends it nothing; the policy counts it as arriving capacity). The registry is
  re-listed at once and again when the cold start ends.
- **Scale-in is soft**: workers still starting go first (they never served); then the ready workers with
  the fewest in-flight requests (newest on ties), as the cluster simulator does. Each is listed as
  *terminating*, so the registry marks it draining and the router stops choosing it at once; it is stopped
  and deregistered only when idle: no routing decision open on it (the `OpenDecisions` Reserve plugin:
  from the routing decision to the request's release, which also covers a P/D decode leg whose prefill
  hop is still running), no gateway in-flight ticket, and an engine with no request in flight and no KV
  held for a P/D peer. A drain that outlives `drain_timeout_s` is stopped anyway and recorded as forced.

A worker that cannot start (`start_refused`: no room in the inventory; `start_failed`: the simulated
replica did not start) lowers the desired count back to what runs, is logged at warning and is reported
through `on_error(pool)` (the controller counts it in `mosaic_autoscaler_scale_errors_total`): the action
that asked for it said applied, so this is where the failure shows.

`events` keeps what happened (started / ready / draining / drain_cancelled / stopped with the wait and
whether it was forced) for `/admin/autoscaler` and tests.

Topology (`placer`, when `autoscaler.nodes` is configured; `server.autoscale_placement`): each simulated
worker occupies a node of the inventory. The workers running at startup are placed together at once; a
scale-out starts each new worker on the next node the controller handed over (`assign_nodes`, computed
for the whole decision by the topology solver), or places it alone when none was handed over, and refuses
to start it (event `start_refused`) when the inventory has no room; the `started` event carries its node
and domain. Scale-in ranks its victims by `TopologyPlacer.removal_order` after the rule above (stable),
and a worker's GPUs are freed when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler.actuators.base import ScaleAction
from scheduler.fleet import WorkerView
from scheduler.routing.framework import RouteRequest
from scheduler.routing.reasons import Outcome
from scheduler.topology import TopologyPlacer
from server.registry import Registry

if TYPE_CHECKING:  # the simulator is imported only where simulated pools exist
    from server.embedded import SimulatedPoolSource

log = logging.getLogger("mosaic.autoscaler")


class _OpenDecision:
    __slots__ = ("_owner", "_released", "worker_id")

    def __init__(self, owner: OpenDecisions, worker_id: str) -> None:
        self._owner = owner
        self._released = False
        self.worker_id = worker_id

    def release(self, outcome: Outcome) -> None:
        if self._released:
            return
        self._released = True
        self._owner.close(self.worker_id)


class OpenDecisions:
    """Reserve plugin that never refuses: counts routing decisions not yet released, per worker.

    A decision exists from `Router.route` until the request's lease is released, which is longer than the
    registry's in-flight ticket (taken at dispatch): the gap is the prefill hop of a P/D request.
    """

    def __init__(self) -> None:
        self._open: dict[str, int] = {}

    def reserve(self, req: RouteRequest, worker: WorkerView, now: float) -> _OpenDecision:
        self._open[worker.id] = self._open.get(worker.id, 0) + 1
        return _OpenDecision(self, worker.id)

    def close(self, worker_id: str) -> None:
        n = self._open.get(worker_id, 0) - 1
        if n > 0:
            self._open[worker_id] = n
        else:
            self._open.pop(worker_id, None)

    def count(self, worker_id: str) -> int:
        return self._open.get(worker_id, 0)


class EmbeddedActuator:
    """See module docstring. `sources` are the simulated pools it may scale (by pool name)."""

    def __init__(
        self,
        sources: Mapping[str, SimulatedPoolSource],
        registry: Registry,
        *,
        decisions: OpenDecisions | None = None,
        cold_start_s: float = 0.0,
        drain_timeout_s: float = 600.0,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        keep_events: int = 200,
        placer: TopologyPlacer | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.sources = dict(sources)
        self.on_error = on_error  # called with the pool when a scale-up could not start a worker
        self.placer = placer
        self._next_nodes: dict[str, deque[tuple[str, str]]] = {name: deque() for name in sources}
        self.registry = registry
        self.decisions = decisions
        self.cold_start_s = cold_start_s
        self.drain_timeout_s = drain_timeout_s
        self.poll_s = poll_s
        self.clock = clock
        self.events: deque[dict[str, Any]] = deque(maxlen=keep_events)
        self._desired = {name: len(src.workers) - len(src.draining) for name, src in self.sources.items()}
        self._locks = {name: asyncio.Lock() for name in self.sources}
        self._drains: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timers: list[asyncio.TimerHandle] = []
        if placer is not None:
            self._place_running()

    # ------------------------------------------------------------------ the Actuator shape
    def replicas(self, pool: str) -> int:
        return self._desired.get(pool, 0)

    def scale(self, pool: str, replicas: int, now: float) -> ScaleAction:
        if pool not in self.sources:
            return ScaleAction(
                now, pool, 0, 0, applied=False, error=f"pool {pool!r} is not simulated in this gateway"
            )
        if replicas < 0:
            raise ValueError(f"replicas must be ≥ 0, got {replicas}")
        before = self._desired[pool]
        self._desired[pool] = replicas
        if replicas != before:
            self._spawn(self.reconcile(pool))
        return ScaleAction(now, pool, before, replicas, applied=True)

    # ------------------------------------------------------------------ topology
    def places(self, pool: str) -> bool:
        """Whether this actuator records the nodes of `pool`'s workers itself (the controller hands it nodes)."""
        return self.placer is not None and pool in self.sources

    def assign_nodes(self, pool: str, nodes: Sequence[tuple[str, str]]) -> None:
        """The next workers `pool` starts go to these (node, domain)s, in order."""
        self._next_nodes[pool].extend(nodes)

    def _place_running(self) -> None:
        assert self.placer is not None
        running = {name: sorted(src.workers) for name, src in sorted(self.sources.items())}
        placed = self.placer.place({name: len(idx) for name, idx in running.items()})
        for name, indexes in running.items():
            for index, (node, domain) in zip(indexes, placed.nodes.get(name, ()), strict=False):
                self.placer.assign(self.worker_id(name, index), name, node)
                self.sources[name].domains[index] = domain  # listed with it: the router pairs P/D by domain
        for name, short in sorted(placed.shortfall.items()):
            log.warning(
                "pool %s: %d running workers do not fit the node inventory: %s",
                name,
                short,
                placed.explanation,
            )
            self._event("unplaced", name, None, workers=short, why=placed.explanation)

    def _node_for(self, pool: str) -> tuple[str, str] | str:
        """The next handed-over node, else one placed for this worker alone; a string says why none fits."""
        queued = self._next_nodes[pool]
        if queued:
            return queued.popleft()
        assert self.placer is not None
        placed = self.placer.place({pool: 1})
        return placed.nodes[pool][0] if placed.granted[pool] else f"no room: {placed.explanation}"

    # ------------------------------------------------------------------ reconciliation
    async def reconcile(self, pool: str) -> None:
        """Move the pool's workers towards the desired count (module docstring); re-lists the registry."""
        src = self.sources[pool]
        async with self._locks[pool]:
            active = [i for i in sorted(src.workers) if i not in src.draining]
            want = self._desired[pool]
            while len(active) < want:
                if src.draining:  # warm and listed: cheaper than a cold start
                    index = max(src.draining)
                    src.set_draining(index, False)
                    self._event("drain_cancelled", pool, index)
                else:
                    node = self._node_for(pool) if self.places(pool) else None
                    if isinstance(node, str):  # the inventory is full: keep what runs, report it
                        self._start_error(pool, want, len(active), "start_refused", why=node)
                        break
                    try:
                        index = await src.start_replica(self.cold_start_s)
                    except Exception as exc:  # e.g. no free port: keep what runs, report it, retry next cycle
                        self._start_error(pool, want, len(active), "start_failed", error=str(exc))
                        break
                    where = {}
                    if node is not None and self.placer is not None:
                        self.placer.assign(self.worker_id(pool, index), pool, node[0])
                        src.domains[index] = node[1]
                        where = {"node": node[0], "domain": node[1]}
                    self._event("started", pool, index, cold_start_s=self.cold_start_s, **where)
                    if self.cold_start_s > 0:
                        self._after(self.cold_start_s, pool, index)
                active.append(index)
            self._next_nodes[pool].clear()  # nodes for workers taken back from draining stay unused
            if len(active) > want:
                for index in self._victims(pool, active, len(active) - want):
                    src.set_draining(index)
                    self._event("draining", pool, index)
            await self.registry.resync(
                pool
            )  # the router sees new and draining workers now, not at the next resync
        for index in sorted(src.draining):
            task = self._drains.get((pool, index))
            if task is None or task.done():
                self._drains[(pool, index)] = self._spawn(self._drain(pool, index))

    def _start_error(self, pool: str, want: int, active: int, kind: str, **why: str) -> None:
        """A scale-up that could not start its worker: the desired count falls back to what runs (the next
        decision asks again), the event is recorded, logged at warning and counted as a scale error."""
        self._event(kind, pool, None, **why)
        self._desired[pool] = active
        log.warning(
            "pool %s: scale-up to %d stopped at %d: %s: %s",
            pool,
            want,
            active,
            kind,
            next(iter(why.values())),
        )
        if self.on_error is not None:
            self.on_error(pool)

    def _victims(self, pool: str, active: list[int], n: int) -> list[int]:
        """Starting workers first (newest first), then ready ones by fewest in-flight requests, newest on ties."""
        src = self.sources[pool]
        now = src.clock()
        starting = sorted((i for i in active if src.ready_at.get(i, now) > now), reverse=True)
        ready = [i for i in active if i not in starting]
        ready.sort(key=lambda i: (self._load(pool, i), -i))
        if self.placer is not None:  # topology first, the rule above on ties (the sort is stable)
            by_id = {self.worker_id(pool, i): i for i in starting + ready}
            starting = [
                by_id[w] for w in self.placer.removal_order([self.worker_id(pool, i) for i in starting])
            ]
            ready = [by_id[w] for w in self.placer.removal_order([self.worker_id(pool, i) for i in ready])]
        return (starting + ready)[:n]

    def _load(self, pool: str, index: int) -> int:
        rec = self.registry.get(self.worker_id(pool, index))
        return rec.inflight_requests if rec is not None else 0

    def worker_id(self, pool: str, index: int) -> str:
        return f"{pool}/{self.sources[pool].endpoint_name(index)}"

    def idle(self, pool: str, index: int) -> bool:
        """Nothing routed to the worker is unfinished, at the gateway or in its engine."""
        wid = self.worker_id(pool, index)
        if self.decisions is not None and self.decisions.count(wid):
            return False
        rec = self.registry.get(wid)
        if rec is not None and rec.inflight_requests:
            return False
        worker = self.sources[pool].workers.get(index)
        if worker is None:
            return True
        runtime = worker.runtime
        return runtime.inflight == 0 and runtime.num_held == 0  # every data-parallel engine

    async def _drain(self, pool: str, index: int) -> None:
        src = self.sources[pool]
        started = self.clock()
        forced = False
        while not self.idle(pool, index):
            if index not in src.draining:  # taken back by a scale-out
                return
            if self.clock() - started > self.drain_timeout_s:
                forced = True
                log.warning(
                    "pool %s: worker %s still busy after %.0f s of draining; stopping it",
                    pool,
                    index,
                    self.drain_timeout_s,
                )
                break
            await asyncio.sleep(self.poll_s)
        async with self._locks[pool]:
            if index not in src.draining:
                return
            await src.stop_replica(index)
            if self.placer is not None:
                self.placer.release(self.worker_id(pool, index))
            await self.registry.resync(pool)
        self._event("stopped", pool, index, drained_s=round(self.clock() - started, 3), forced=forced)

    def _after(self, delay_s: float, pool: str, index: int) -> None:
        """Re-list the pool when a cold start ends, so the worker turns ready without waiting for a resync."""
        started = self.sources[pool].workers.get(index)

        def fire() -> None:
            worker = self.sources[pool].workers.get(index)
            if worker is None or worker is not started:
                return  # stopped during its cold start (or its index reused since): nothing turned ready
            self._event("ready", pool, index)
            self._spawn(self.registry.resync(pool))

        self._timers.append(asyncio.get_running_loop().call_later(delay_s + 0.01, fire))

    # ------------------------------------------------------------------ plumbing
    def _event(self, kind: str, pool: str, index: int | None, **extra: Any) -> None:
        worker = self.worker_id(pool, index) if index is not None else None
        self.events.append(
            {"at": round(time.time(), 3), "event": kind, "pool": pool, "worker": worker, **extra}
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("embedded actuator task failed", exc_info=task.exception())

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Wait until no reconcile or drain task is running (tests, shutdown)."""
        deadline = self.clock() + timeout_s
        while self._tasks and self.clock() < deadline:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, deadline - self.clock()))

    async def aclose(self) -> None:
        for timer in self._timers:
            timer.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
