"""What the live autoscaler observes each cycle: an `Observation` built from the gateway's registry and metrics.

Per pool (workers of every state, as the cluster simulator counts them):

| field | from |
|---|---|
| ready / starting / draining | worker states in the registry; for a pool the actuator manages, its desired count D is the provisioned total: ready = min(ready seen, D), starting = D − ready − B, draining = draining seen + ready seen beyond D, where B (`broken`) counts the pool's workers unhealthy for longer than the grace below |
| decode_tokens_per_s | Σ over workers of Δ`vllm:generation_tokens_total` / Δt between the scrapes seen at the previous and this cycle (a worker new since then: its last scrape-to-scrape rate; a counter reset: current value / Δt, as Prometheus' `increase`) |
| prompt_tokens_per_s | the same over `vllm:prompt_tokens_total` |
| num_waiting | Σ `vllm:num_requests_waiting` of ready workers with fresh stats |
| gpu_utilization | busy proxy: Σ over scrapes in the interval of ready workers with `num_requests_running` > 0, ÷ Σ ready workers scraped (≤ 1; draining workers are left out, as the HPA leaves out terminating pods) |
| starting_ready_in_s | managed pools with `autoscaler.cold_start_s` > 0: each starting instance's start (the cycle whose action raised the desired count) + the cold start − now; the newest are the ones still starting. Otherwise empty (the policy then counts them as arriving at its lead) |
| signal_complete | False when a READY worker of the pool has no fresh stats (its `/metrics` scrape is older than `scrape.stale_after_s` while `/health` answers): its load is unknown, so the rates undercount. The policy then does not scale in that model's pools (scale-up stays allowed) and says so in the decision's reason. Chosen over carrying the last rate forward: a rate carried for a bounded time still turns into "zero load" when the bound expires, while a blocked scale-in only keeps capacity that is already paid for |

**Unhealthy workers** (`/health` failing: crash-looping, wedged) count as arriving capacity (`starting`) for
one grace period after the cycle that first saw them unhealthy — `autoscaler.cold_start_s`, or
`UNHEALTHY_GRACE_S` (120 s) when that is 0 — so a health-check blip does not buy a replacement; after it
they count as nothing. For a managed pool they stay in the backend's count (a Deployment keeps a
crash-looping pod), so `broken[pool]` holds them: the policy's `provisioned` is what serves or will, the
backend's count is that plus the broken ones. The controller does not add replicas on top of them (a bad
image would crash in each one added).

Fleet-wide, the gateway-side signals (`server.gateway_signals`, one code path for both drivers): admission
queue depth per model, TTFT p90 and per-request TPOT p90 (inter-token gaps when no gateway exports TPOT),
arrival rate and mean input/output tokens over the interval, from the gateway's own registry in `mosaic
serve` (`RegistrySource`) and from every gateway replica's scraped `/metrics`, merged, in `mosaic
autoscale` (`server.gateway_scrape.GatewayScraper`, `autoscaler.gateways`).

**Model time.** Simulated workers run `time_scale` × faster than the wall clock, while capacities (perf
model) and SLOs are in model seconds. Rates are divided by the pool's time scale and latencies multiplied
by it, so the policy compares like with like; its clock (`now`, windows, intervals) stays the wall clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from scheduler.autoscaler.signals import Observation, PoolObservation
from scheduler.fleet import WorkerState
from server.gateway_signals import GatewaySource, GatewayWindow, gateway_signals, quantile
from server.registry import Registry, WorkerRecord

__all__ = ["UNHEALTHY_GRACE_S", "SignalReader", "quantile"]

UNHEALTHY_GRACE_S = 120.0  # an unhealthy worker's grace as arriving capacity when cold_start_s is unset


@dataclass(slots=True)
class _WorkerMemo:
    gen: float | None
    prompt: float | None
    at: float
    gen_rate: float = 0.0
    prompt_rate: float = 0.0
    # the newest counters a scrape round saw (`on_scrape`): what a worker that leaves the fleet before the
    # next cycle produced since `at` still counts in that cycle's pool rate, as the simulator's retired totals
    last_gen: float | None = None
    last_prompt: float | None = None


@dataclass(slots=True)
class _PoolBusy:
    busy: int = 0
    ready: int = 0


@dataclass(slots=True)
class SignalReader:
    """Builds one `Observation` per `observe()` call; `on_scrape` samples the busy proxy after each scrape round.

    `time_scales` maps pool → its simulated time scale (absent: 1). `gateway` gives the gateways' metric
    snapshots each cycle (`server.gateway_signals`; None: no gateway-side signals).
    """

    registry: Registry
    stale_after_s: float
    clock: Callable[[], float] = time.monotonic  # the registry's clock (stats_at is on it)
    time_scales: Mapping[str, float] = field(default_factory=dict)
    gateway: GatewaySource | None = None
    _memo: dict[str, _WorkerMemo] = field(default_factory=dict)
    _busy: dict[str, _PoolBusy] = field(default_factory=dict)
    _window: GatewayWindow = field(default_factory=GatewayWindow)
    gateways_seen: int = 0  # gateways with a snapshot at the last cycle
    cold_start_s: float = 0.0  # a started instance's expected time to ready (0: unknown, no estimates)
    _starts: dict[str, list[float]] = field(
        default_factory=dict
    )  # per managed pool: start times, oldest first
    _desired: dict[str, int] = field(default_factory=dict)  # per managed pool: its count at the last cycle
    _last_now: float | None = None
    _unhealthy_since: dict[str, float] = field(default_factory=dict)  # worker id → first cycle seen unhealthy
    _cycle_now: float = 0.0
    # per pool: its workers unhealthy for longer than the grace (not capacity; in a managed pool's backend count)
    broken: dict[str, int] = field(default_factory=dict)

    def scale(self, pool: str) -> float:
        return self.time_scales.get(pool, 1.0)

    # ------------------------------------------------------------------ per scrape round
    def on_scrape(self) -> None:
        now = self.clock()
        for rec in self.registry.records():
            stats = rec.fresh_stats(now, self.stale_after_s)
            memo = self._memo.get(rec.id)
            if stats is not None and memo is not None:  # draining ones too: they decode until they leave
                memo.last_gen, memo.last_prompt = stats.generation_tokens_total, stats.prompt_tokens_total
            state = rec.state()
            # the HPA averages a per-pod metric over the ready pods: a draining worker still finishing its
            # streams is terminating, left out of both sides (counted busy over the ready ones, a scale-in
            # read as load and bought back)
            if stats is None or state is not WorkerState.READY:
                continue
            b = self._busy.setdefault(rec.pool.name, _PoolBusy())
            b.busy += bool(stats.num_running)
            b.ready += 1

    # ------------------------------------------------------------------ per cycle
    def observe(self, now: float, desired: Mapping[str, int]) -> Observation:
        """The observation at `now`; `desired` holds the actuator's count for each pool it manages."""
        self._cycle_now = now
        self._track_unhealthy(now)
        self.broken = {}
        pools = {name: self._pool(name, recs, desired.get(name)) for name, recs in self._by_pool().items()}
        for name, want in desired.items():
            if name in pools:
                etas = self._starting_etas(name, want, pools[name].starting, now)
                pools[name] = dataclasses.replace(pools[name], starting_ready_in_s=etas)
        self._last_now = now
        self._busy.clear()
        merged = self._window.step(self.gateway() if self.gateway is not None else {})
        self.gateways_seen = merged.gateways
        models = sorted({p.model for p in self.registry.pools()})
        gateway = gateway_signals(merged, self.scale, self._model_scale, models)
        return Observation(now=now, pools=pools, **gateway)

    def _track_unhealthy(self, now: float) -> None:
        unhealthy = {r.id for r in self.registry.records() if r.state() is WorkerState.UNHEALTHY}
        for wid in list(self._unhealthy_since):
            if wid not in unhealthy:
                del self._unhealthy_since[wid]
        for wid in unhealthy:
            self._unhealthy_since.setdefault(wid, now)

    def _is_broken(self, rec: WorkerRecord) -> bool:
        """Unhealthy for longer than the grace (module docstring): no longer arriving capacity."""
        since = self._unhealthy_since.get(rec.id)
        grace = self.cold_start_s if self.cold_start_s > 0 else UNHEALTHY_GRACE_S
        return since is not None and self._cycle_now - since >= grace

    def _starting_etas(self, name: str, desired: int, starting: int, now: float) -> tuple[float, ...]:
        """Expected seconds to ready of a managed pool's starting instances (module docstring). An increase
        of the desired count since the last cycle was applied right after it, so those instances started
        then; a decrease cancelled the newest starting instances first (as every actuator and the simulator
        pick their victims); instances become ready oldest first, so of the rest the newest `starting` start
        times are kept."""
        starts = self._starts.setdefault(name, [])
        previous = self._desired.get(name)
        if previous is not None and desired > previous:
            starts.extend([self._last_now if self._last_now is not None else now] * (desired - previous))
        elif previous is not None and desired < previous:
            del starts[max(0, len(starts) - (previous - desired)) :]
        self._desired[name] = desired
        del starts[: max(0, len(starts) - starting)]
        if self.cold_start_s <= 0:
            return ()
        return tuple(max(0.0, t + self.cold_start_s - now) for t in starts)

    def _by_pool(self) -> dict[str, list[WorkerRecord]]:
        out: dict[str, list[WorkerRecord]] = {p.name: [] for p in self.registry.pools()}
        for rec in self.registry.records():
            out.setdefault(rec.pool.name, []).append(rec)
        return out

    def _pool(self, name: str, recs: list[WorkerRecord], desired: int | None) -> PoolObservation:
        now = self.clock()
        states = [r.state() for r in recs]
        seen_ready = states.count(WorkerState.READY)
        seen_draining = states.count(WorkerState.DRAINING)
        broken = sum(1 for r in recs if r.state() is WorkerState.UNHEALTHY and self._is_broken(r))
        if broken:
            self.broken[name] = broken
        if desired is None:  # not managed: what the registry sees
            ready, starting = (
                seen_ready,
                states.count(WorkerState.STARTING) + states.count(WorkerState.UNHEALTHY) - broken,
            )
            draining = seen_draining
        else:
            ready = min(seen_ready, desired)
            starting = max(0, desired - ready - broken)
            draining = seen_draining + max(0, seen_ready - desired)
        # a READY worker without fresh stats: its load is unknown (module docstring, signal_complete)
        complete = all(
            r.fresh_stats(now, self.stale_after_s) is not None for r in recs if r.state() is WorkerState.READY
        )
        gen = prompt = 0.0
        waiting = 0
        for rec in recs:
            g, p = self._rates(rec, now)
            gen, prompt = gen + g, prompt + p
            stats = rec.fresh_stats(now, self.stale_after_s)
            if stats is not None and rec.state() is WorkerState.READY:
                waiting += stats.num_waiting or 0
        live = {r.id for r in recs}
        for wid in [w for w in self._memo if w.startswith(name + "/") and w not in live]:
            g, p = _tail(self._memo.pop(wid), now)  # left since the last cycle (a drain that finished)
            gen, prompt = gen + g, prompt + p
        busy = self._busy.get(name)
        scale = self.scale(name)
        return PoolObservation(
            ready=ready,
            starting=starting,
            draining=draining,
            decode_tokens_per_s=gen / scale,
            prompt_tokens_per_s=prompt / scale,
            num_waiting=waiting,
            gpu_utilization=min(1.0, busy.busy / busy.ready) if busy and busy.ready else 0.0,
            signal_complete=complete,
        )

    def _rates(self, rec: WorkerRecord, now: float) -> tuple[float, float]:
        """(generation, prompt) tokens/s of one worker since the scrape seen at the previous cycle (wall)."""
        stats = rec.fresh_stats(now, self.stale_after_s)
        if stats is None or rec.stats_at is None:
            self._memo.pop(rec.id, None)
            return 0.0, 0.0
        memo = self._memo.get(rec.id)
        if memo is None:
            memo = self._memo[rec.id] = _WorkerMemo(
                stats.generation_tokens_total,
                stats.prompt_tokens_total,
                rec.stats_at,
                rec.generation_tokens_per_s or 0.0,
                rec.prompt_tokens_per_s or 0.0,
            )
            return memo.gen_rate, memo.prompt_rate
        dt = rec.stats_at - memo.at
        if dt > 0:  # a newer scrape: the rate over everything since the last cycle's scrape
            memo.gen_rate = _rate(memo.gen, stats.generation_tokens_total, dt, rec.generation_tokens_per_s)
            memo.prompt_rate = _rate(memo.prompt, stats.prompt_tokens_total, dt, rec.prompt_tokens_per_s)
            memo.gen, memo.prompt, memo.at = (
                stats.generation_tokens_total,
                stats.prompt_tokens_total,
                rec.stats_at,
            )
        return memo.gen_rate, memo.prompt_rate

    def _model_scale(self, model: str) -> float:
        scales = [self.scale(p.name) for p in self.registry.pools() if p.model == model]
        return max(scales) if scales else 1.0


def _tail(memo: _WorkerMemo, now: float) -> tuple[float, float]:
    """(generation, prompt) tokens/s a worker that has left produced between the last cycle's scrape and its
    last scrape, over the cycle's interval (0 for a counter that went down: a restart tells nothing)."""
    dt = now - memo.at
    if dt <= 0:
        return 0.0, 0.0

    def part(first: float | None, last: float | None) -> float:
        return max(0.0, last - first) / dt if first is not None and last is not None else 0.0

    return part(memo.gen, memo.last_gen), part(memo.prompt, memo.last_prompt)


def _rate(prev: float | None, cur: float | None, dt: float, fallback: float | None) -> float:
    """Counter rate over dt. A reset (restart: the counter went down) counts from zero, cur / dt, as
    Prometheus' `increase` does; a missing counter falls back to the registry's last rate."""
    if prev is None or cur is None:
        return fallback or 0.0
    if cur < prev:
        return cur / dt
    return (cur - prev) / dt
