"""Aggregate metrics of a replay, defined as vLLM's `benchmark_serving` defines them.

Over successful requests only (failed ones are counted by error type and excluded, as in vLLM):
- TTFT  = first content chunk − send;  E2EL = last content chunk − send;
- TPOT  = (E2EL − TTFT) / (output_tokens − 1), only for requests with ≥ 2 output tokens (excludes the first token);
- ITL   = every gap between successive content chunks, pooled over requests;
- statistics: mean, std, median, p90/p95/p99 by `numpy.percentile` (linear interpolation), in ms;
- duration = from the replay start (t = 0: the window's opening, or a fixed rate's start, one gap before its
  first send) to the end of the last request, as vLLM's benchmark times from before its first request's delay;
- request throughput = completed / duration; output throughput = Σ output tokens / duration;
  total token throughput = (Σ input + Σ output tokens of completed requests) / duration;
- goodput = completed requests meeting every given SLO (TTFT, TPOT, E2EL in ms) / duration; a request
  with < 2 output tokens has TPOT 0 for this test (vLLM's rule);
- SLO attainment = requests meeting every SLO / requests sent (a failed request misses its SLO).

Send lag (not in vLLM): actual send − max(scheduled send, time a concurrency slot was free), over all
requests. A run whose p99 lag exceeds `lag_threshold_ms` did not offer the load it claims:
`lag_exceeded` is True and the CLI says so loudly.

(guidellm calls vLLM's TPOT "ITL"; reports name their definitions: `DEFINITIONS`.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.client import RequestRecord

PERCENTILES = (90, 95, 99)
DEFINITIONS = {
    "source": "vLLM benchmarks/benchmark_serving.py (calculate_metrics), percentiles by numpy.percentile",
    "ttft": "first chunk with non-empty choices − send time",
    "tpot": "(e2el − ttft) / (output_tokens − 1), requests with ≥ 2 output tokens; output tokens from usage",
    "itl": "every gap between successive content chunks (a chunk may hold several tokens)",
    "e2el": "last content chunk − send time",
    "goodput": "completed requests meeting every given SLO per second of duration (TPOT of 1-token requests = 0)",
    "slo_attainment": "requests meeting every given SLO / requests sent",
    "send_lag": "actual send − max(scheduled send, concurrency slot free)",
    "duration": "replay start (t = 0, before the first arrival's offset) → end of the last request",
}


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met_by(self, rec: RequestRecord) -> bool:
        """Whether a successful request meets every given SLO (≤, as vLLM: `slo >= value`)."""
        if not rec.success:
            return False
        ttft, e2el = rec.ttft_s, rec.e2el_s
        tpot = rec.tpot_s or 0.0
        assert ttft is not None and e2el is not None
        return (
            (self.ttft_ms is None or ttft * 1000 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot * 1000 <= self.tpot_ms)
            and (self.e2el_ms is None or e2el * 1000 <= self.e2el_ms)
        )


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary of one latency in ms (all 0 when there are no samples, like vLLM's `np.mean(x or 0)`)."""

    count: int
    mean: float
    std: float
    median: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Stats:
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        a = np.asarray(values, dtype=float) * 1000.0
        p90, p95, p99 = (float(x) for x in np.percentile(a, PERCENTILES))
        return cls(
            len(a), float(a.mean()), float(a.std()), float(np.median(a)), p90, p95, p99, float(a.max())
        )

    def as_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in ("count", "mean", "std", "median", "p90", "p95", "p99", "max")}


@dataclass(frozen=True, slots=True)
class Metrics:
    sent: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # None when no SLO was given
    slo_attainment: float | None
    slo: Slo
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2el: Stats
    send_lag: Stats
    lag_threshold_ms: float
    lag_exceeded: bool
    errors: dict[str, int]
    output_length_mismatches: int  # completed requests whose usage differs from the requested max_tokens

    def as_dict(self) -> dict[str, object]:
        return {
            "sent": self.sent,
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "goodput": self.goodput,
            "slo_attainment": self.slo_attainment,
            "slo": {"ttft_ms": self.slo.ttft_ms, "tpot_ms": self.slo.tpot_ms, "e2el_ms": self.slo.e2el_ms},
            "ttft_ms": self.ttft.as_dict(),
            "tpot_ms": self.tpot.as_dict(),
            "itl_ms": self.itl.as_dict(),
            "e2el_ms": self.e2el.as_dict(),
            "send_lag_ms": self.send_lag.as_dict(),
            "lag_threshold_ms": self.lag_threshold_ms,
            "lag_exceeded": self.lag_exceeded,
            "errors": self.errors,
            "output_length_mismatches": self.output_length_mismatches,
        }


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    slo: Slo = Slo(),
    lag_threshold_ms: float = 5.0,
) -> Metrics:
    """Metrics of finished records. `duration_s` defaults to `replay_duration(records)`."""
    ok = [r for r in records if r.success]
    if duration_s is None:
        duration_s = replay_duration(records)
    dur = duration_s if duration_s > 0 else float("nan")
    # the server's own count when its usage gives one (a chat template adds tokens), as vLLM's benchmark
    total_in = sum(r.input_tokens if r.usage_prompt_tokens is None else r.usage_prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = sum(1 for r in ok if slo.met_by(r)) if slo.given else None
    itls: list[float] = []
    for r in ok:
        itls.extend(r.itls_s())
    lag = Stats.of_seconds([r.send_lag_s for r in records])
    return Metrics(
        sent=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=_rate(len(ok), dur),
        output_throughput=_rate(total_out, dur),
        total_token_throughput=_rate(total_in + total_out, dur),
        goodput=None if good is None else _rate(good, dur),
        slo_attainment=None if good is None or not records else good / len(records),
        slo=slo,
        ttft=Stats.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=Stats.of_seconds([t for r in ok if (t := r.tpot_s) is not None]),
        itl=Stats.of_seconds(itls),
        e2el=Stats.of_seconds([r.e2el_s for r in ok if r.e2el_s is not None]),
        send_lag=lag,
        lag_threshold_ms=lag_threshold_ms,
        lag_exceeded=lag.count > 0 and lag.p99 > lag_threshold_ms,
        errors=dict(sorted(Counter(r.error_type for r in records if r.error_type).items())),
        output_length_mismatches=sum(1 for r in ok if r.output_tokens != r.expected_output_tokens),
    )


def replay_duration(records: Sequence[RequestRecord]) -> float:
    """The replay's start (t = 0) → end of the last request (0 without records), as vLLM's benchmark times
    from before its first request's delay: a fixed rate's first gap, or a trace's offset before its first
    arrival, is part of the time the load was offered over (N requests at R req/s span N / R)."""
    if not records:
        return 0.0
    return max(r.end_s for r in records)


def _rate(count: float, duration_s: float) -> float:
    return 0.0 if duration_s != duration_s else count / duration_s
