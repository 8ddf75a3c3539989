"""What the live autoscaler observes each cycle: an `Observation` built from the gateway's registry and metrics.

Per pool (workers of every state, as the cluster simulator counts them):

| field | from |
|---|---|
| ready / starting / draining | worker states in the registry; for a pool the actuator manages, its desired count D is the provisioned total: ready = min(ready seen, D), starting = D − ready, draining = draining seen + ready seen beyond D |
| decode_tokens_per_s | Σ over workers of Δ`vllm:generation_tokens_total` / Δt between the scrapes seen at the previous and this cycle (a worker new since then: its last scrape-to-scrape rate) |
| prompt_tokens_per_s | the same over `vllm:prompt_tokens_total` |
| num_waiting | Σ `vllm:num_requests_waiting` of ready workers with fresh stats |
| gpu_utilization | busy proxy: Σ over scrapes in the interval of workers with `num_requests_running` > 0, ÷ Σ ready workers scraped (≤ 1) |

Fleet-wide, from the gateway's own metrics over the interval (absent for `mosaic autoscale`, which serves
no traffic): admission queue depth per model; TTFT p90 and TPOT p90 (the p90 of
`mosaic_time_to_first_token_seconds` and of `mosaic_inter_token_latency_seconds` over the interval's
bucket increments, interpolated within buckets as Prometheus' `histogram_quantile`; inter-token gaps
stand in for per-request TPOT, a conservative choice since the net only adds capacity); request rate =
Δ`mosaic_requests_received_total` / Δt (arrivals, so a backlog clearing does not read as a surge); mean
input/output tokens = Δ`mosaic_prompt_tokens_total` / Δ`mosaic_generation_tokens_total` over Δ completed
requests (lengths are known only at completion).

**Model time.** Simulated workers run `time_scale` × faster than the wall clock, while capacities (perf
model) and SLOs are in model seconds. Rates are divided by the pool's time scale and latencies multiplied
by it, so the policy compares like with like; its clock (`now`, windows, intervals) stays the wall clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from scheduler.autoscaler.signals import Observation, PoolObservation
from scheduler.fleet import WorkerState
from server.registry import Registry, WorkerRecord

TTFT_FAMILY = "mosaic_time_to_first_token_seconds"
ITL_FAMILY = "mosaic_inter_token_latency_seconds"

Bucket = tuple[float, float, float]  # (lower bound, upper bound, count); upper may be inf


def quantile(q: float, buckets: Iterable[Bucket]) -> float | None:
    """q-quantile of a mixture of histogram buckets, each uniform on [lower, upper].

    For one histogram with lower bounds 0, previous `le` this is Prometheus' `histogram_quantile`; for
    buckets of several histograms with rescaled bounds it is exact for the mixture. A quantile that
    falls in a +Inf bucket is the largest finite bound (as Prometheus answers). None without samples.
    """
    items = [b for b in buckets if b[2] > 0]
    total = sum(c for _, _, c in items)
    if total <= 0:
        return None
    target = q * total
    finite = [b for b in items if math.isfinite(b[1])]
    points = sorted({p for lo, hi, _ in finite for p in (lo, hi)})
    if not points:
        return max((b[0] for b in items), default=None)

    def cdf(x: float) -> float:
        return sum(
            c * min(1.0, max(0.0, (x - lo) / (hi - lo))) if hi > lo else c * (x >= hi) for lo, hi, c in finite
        )

    prev_x, prev_c = points[0], cdf(points[0])
    if prev_c >= target:
        return prev_x
    for x in points[1:]:
        c = cdf(x)
        if c >= target:  # cdf is linear between consecutive breakpoints
            return prev_x + (x - prev_x) * (target - prev_c) / (c - prev_c)
        prev_x, prev_c = x, c
    return points[-1]


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


@dataclass(slots=True)
class _WorkerMemo:
    gen: float | None
    prompt: float | None
    at: float
    gen_rate: float = 0.0
    prompt_rate: float = 0.0


@dataclass(slots=True)
class _PoolBusy:
    busy: int = 0
    ready: int = 0


@dataclass(slots=True)
class SignalReader:
    """Builds one `Observation` per `observe()` call; `on_scrape` samples the busy proxy after each scrape round.

    `time_scales` maps pool → its simulated time scale (absent: 1). `gateway_metrics` and `admission` are
    the gateway's own metrics registry and admission depths (None in `mosaic autoscale`).
    """

    registry: Registry
    stale_after_s: float
    clock: Callable[[], float] = time.monotonic  # the registry's clock (stats_at is on it)
    time_scales: Mapping[str, float] = field(default_factory=dict)
    gateway_metrics: CollectorRegistry | None = None
    admission: Callable[[], dict[str, int]] | None = None
    _memo: dict[str, _WorkerMemo] = field(default_factory=dict)
    _busy: dict[str, _PoolBusy] = field(default_factory=dict)
    _last_samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] | None = None
    _last_at: float | None = None

    def scale(self, pool: str) -> float:
        return self.time_scales.get(pool, 1.0)

    # ------------------------------------------------------------------ per scrape round
    def on_scrape(self) -> None:
        now = self.clock()
        for rec in self.registry.records():
            stats = rec.fresh_stats(now, self.stale_after_s)
            state = rec.state()
            if stats is None or state not in (WorkerState.READY, WorkerState.DRAINING):
                continue
            b = self._busy.setdefault(rec.pool.name, _PoolBusy())
            b.busy += bool(stats.num_running)
            b.ready += state is WorkerState.READY

    # ------------------------------------------------------------------ per cycle
    def observe(self, now: float, desired: Mapping[str, int]) -> Observation:
        """The observation at `now`; `desired` holds the actuator's count for each pool it manages."""
        pools = {name: self._pool(name, recs, desired.get(name)) for name, recs in self._by_pool().items()}
        self._busy.clear()
        gateway = self._gateway_signals(now)
        return Observation(now=now, pools=pools, **gateway)

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
        if desired is None:  # not managed: what the registry sees
            ready, starting = (
                seen_ready,
                states.count(WorkerState.STARTING) + states.count(WorkerState.UNHEALTHY),
            )
            draining = seen_draining
        else:
            ready = min(seen_ready, desired)
            starting = desired - ready
            draining = seen_draining + max(0, seen_ready - desired)
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
            del self._memo[wid]
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

    def _gateway_signals(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {"admission_queue": dict(self.admission()) if self.admission else {}}
        if self.gateway_metrics is None:
            return out
        cur = _samples(self.gateway_metrics)
        prev, prev_at = self._last_samples, self._last_at
        self._last_samples, self._last_at = cur, now
        if prev is None or prev_at is None or now <= prev_at:
            return out
        dt = now - prev_at
        out["ttft_p90_s"] = quantile(0.9, self._latency_buckets(TTFT_FAMILY, cur, prev))
        out["tpot_p90_s"] = quantile(0.9, self._latency_buckets(ITL_FAMILY, cur, prev))
        completed = prompt = generated = 0.0
        rate = 0.0
        for (name, labels), value in cur.items():
            d = value - prev.get((name, labels), 0.0)
            if d <= 0:
                continue
            lab = dict(labels)
            if name == "mosaic_request_outcomes_total" and lab.get("outcome") == "completed":
                completed += d
            elif name == "mosaic_requests_received_total":
                rate += d / (dt * self._model_scale(lab.get("model", "")))
            elif name == "mosaic_prompt_tokens_total":
                prompt += d
            elif name == "mosaic_generation_tokens_total":
                generated += d
        out["request_rate"] = rate
        if completed > 0:
            out["mean_input_tokens"] = prompt / completed
            out["mean_output_tokens"] = generated / completed
        return out

    def _model_scale(self, model: str) -> float:
        scales = [self.scale(p.name) for p in self.registry.pools() if p.model == model]
        return max(scales) if scales else 1.0

    def _latency_buckets(
        self,
        family: str,
        cur: Mapping[tuple[str, tuple[tuple[str, str], ...]], float],
        prev: Mapping[tuple[str, tuple[tuple[str, str], ...]], float],
    ) -> list[Bucket]:
        """The interval's bucket increments of one histogram family, per (model, pool), bounds × time scale."""
        series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
        for (name, labels), value in cur.items():
            if name != family + "_bucket":
                continue
            lab = dict(labels)
            le = float(lab.pop("le"))
            key = tuple(sorted(lab.items()))
            series.setdefault(key, []).append((le, value - prev.get((name, labels), 0.0)))
        buckets: list[Bucket] = []
        for key, cumulative in series.items():
            scale = self.scale(dict(key).get("pool", ""))
            lower, below = 0.0, 0.0
            for le, count in sorted(cumulative):
                upper = le * scale
                buckets.append((lower, upper, max(0.0, count - below)))
                lower, below = upper, count
        return buckets


def _rate(prev: float | None, cur: float | None, dt: float, fallback: float | None) -> float:
    """Counter rate over dt; a reset (restart) or a missing counter falls back to the registry's last rate."""
    if prev is None or cur is None or cur < prev:
        return fallback or 0.0
    return (cur - prev) / dt
