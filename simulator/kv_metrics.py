"""Metrics of a `KvFleet` run, as the KV reservation bench reports them (definitions in each field's comment).

TTFT = first token − arrival at the gateway (admission-queue wait included); TPOT = (finish − first token) /
(output − 1); goodput = requests meeting both SLOs per second of makespan (first arrival → last finish),
the loadgen's definition (REFERENCE.md). Block equivalents: a compression worker's head-pages / n_heads,
so reservations and usage compare across stock and ragged workers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from simulator.kv_fleet import FleetRun


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float = 30.0
    tpot_s: float = 0.25


@dataclass(frozen=True, slots=True)
class KvRunMetrics:
    completed: int
    rejected: int
    makespan_s: float
    preemptions: int  # engine preemptions (recompute), all workers
    recomputed_tokens: int  # KV tokens thrown away by preemption
    fragmentation_pct: float  # free KV while requests wait (time-weighted, waiting periods only), %
    page_padding_pct: (
        float  # allocated head-token slots not holding kept KV (group padding + page rounding), %
    )
    concurrency_compression: float | None  # mean running sequences per compression worker
    concurrency_stock: float | None  # mean running sequences per stock worker
    goodput_rps: float
    throughput_rps: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    reservation_efficiency: float | None  # mean actual peak / reserved (1 = exact)
    under_reservation_rate: float | None  # share of requests whose actual peak exceeded the reservation
    estimate_error_mean: float | None  # reconcile: mean (reported − reserved) / total

    def as_dict(self) -> dict[str, float | int | None]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def summarize(run: FleetRun, slo: Slo) -> KvRunMetrics:
    done = [s for s in run.requests.values() if s.finished is not None and s.first_token is not None]
    span = max(1e-9, run.end - run.start)
    ttft = [s.first_token - s.arrival.t for s in done]  # type: ignore[operator]
    tpot = {id(s): (s.finished - s.first_token) / (s.output_tokens - 1) for s in done if s.output_tokens > 1}  # type: ignore[operator]
    good = sum(
        1 for s, t in zip(done, ttft, strict=True) if t <= slo.ttft_s and tpot.get(id(s), 0.0) <= slo.tpot_s
    )
    reserved = [s for s in done if s.reserved_blocks]
    eff = [s.actual_peak_blocks / s.reserved_blocks for s in reserved]  # type: ignore[operator]
    under = [s for s in reserved if s.actual_peak_blocks > s.reserved_blocks + 1e-9]  # type: ignore[operator]
    waiting = sum(w.waiting_time for w in run.workers.values())
    stranded = sum(w.stranded_time for w in run.workers.values())
    alloc = sum(s.alloc_slots for s in done)
    return KvRunMetrics(
        completed=len(done),
        rejected=sum(1 for s in run.requests.values() if s.rejected),
        makespan_s=span,
        preemptions=sum(e.counters.preemptions for e in run.engines.values()),
        recomputed_tokens=sum(e.counters.recomputed_tokens for e in run.engines.values()),
        fragmentation_pct=100.0 * stranded / waiting if waiting else 0.0,
        page_padding_pct=100.0 * (1.0 - sum(s.ideal_slots for s in done) / alloc) if alloc else 0.0,
        concurrency_compression=_concurrency(run, True, span),
        concurrency_stock=_concurrency(run, False, span),
        goodput_rps=good / span,
        throughput_rps=len(done) / span,
        output_tokens_per_s=sum(s.output_tokens for s in done) / span,
        ttft_p50_s=percentile(ttft, 50),
        ttft_p99_s=percentile(ttft, 99),
        tpot_p50_ms=1000 * percentile(list(tpot.values()), 50),
        tpot_p99_ms=1000 * percentile(list(tpot.values()), 99),
        reservation_efficiency=statistics.fmean(eff) if eff else None,
        under_reservation_rate=len(under) / len(reserved) if reserved else None,
        estimate_error_mean=statistics.fmean(run.estimate_errors) if run.estimate_errors else None,
    )


def _concurrency(run: FleetRun, compression: bool, span: float) -> float | None:
    ids = [wid for wid, comp in run.compression.items() if comp == compression]
    if not ids:
        return None
    return sum(run.workers[w].running_time for w in ids) / span / len(ids)
