"""`mosaic profile --url`: measure a bucket at a rate by replaying its test requests against a live server.

Each probe sends the bucket's test stream (`loadgen.profiling`: uniform lengths, Poisson arrivals at the
probed rate) through the replay client — token-id prompts of the exact length, `max_tokens` +
`ignore_eos` — and summarises the requests sent in the measured window: p90 TTFT and TPOT as
`benchmark_serving` defines them, failures counted, stability judged from TTFT growth. It runs in real
time: a probe lasts 2·W seconds plus the drain (W from `ProbePlan`), so a full profile of a real GPU takes
hours; shrink `ProbePlan` for quick looks.

Each bucket starts with its requests sent one at a time (`unloaded`): the p90 TTFT there bounds the queue
(`loadgen.profiling.QueueBound`), and a bucket that misses the SLO even so, or whose requests the server
refuses (a max_model_len below the catalog's context: 400), is 0 at once; probing down to the lowest rate
to find that out took up to a day of real time, the lowest rates' probes being the longest.

A profile that cannot measure anything stops instead of writing zeros: `preflight` sends one request (one
output token) before the first probe, and a probe or baseline whose every request failed in a way no load
explains (`FATAL_ERRORS`: nothing listens, or the server refuses us whatever we send) raises
`ProfileError`. Load failures (timeouts, 5xx, 429) and refusals that may be the bucket's length (400, 413,
422: a server whose max_model_len is below the catalog's context) stay that rate's or bucket's fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable

import httpx
import numpy as np

from loadgen.client import one_line
from loadgen.profile_search import Measurement
from loadgen.profiling import (
    Bucket,
    BucketMeasure,
    MeasureFactory,
    ProbePlan,
    bucket_requests,
    probe_requests,
    summarize,
    unloaded_requests,
)
from loadgen.runner import FATAL_ERRORS, RunOptions, RunResult, Target, replay
from loadgen.schedule import ScheduledRequest

PROBE_TPOT_S = 0.05  # per-token time assumed when sizing a probe (never the SLO: see profile_search)
# A probe whose sends fall this far behind their times (the generator, not the server, is the limit) does
# not pass: the queue test reads scheduled times and TTFT from the actual send, so it cannot see that
# backlog, and the rate was never offered. Jitter of milliseconds stays far below it.
GENERATOR_BACKLOG_S = 0.25
PREFLIGHT_TIMEOUT_S = 60.0  # a 1-token answer; a dead address should not hold the command for 10 minutes
PREFLIGHT_INPUT_TOKENS = 16
UNLOADED_FULL = 3  # of the baseline's requests, this many are also sent with their whole output (TPOT)


class ProfileError(ValueError):
    """The server cannot be profiled at all (unreachable, or it refuses every request): the CLI exits 2."""


def preflight(
    target: Target,
    timeout_s: float | None = PREFLIGHT_TIMEOUT_S,
    transport: httpx.AsyncBaseTransport | None = None,
) -> None:
    """Send one small request (one output token) before hours of probes; raise `ProfileError` naming the
    URL and the error when it does not succeed."""
    sched = [ScheduledRequest(0, 0.0, PREFLIGHT_INPUT_TOKENS, 1)]
    result = asyncio.run(replay(sched, target, RunOptions(timeout_s=timeout_s), None, transport))
    rec = result.records[0]
    if not rec.success:
        raise ProfileError(
            f"cannot profile {target.url}: a first request (1 output token) failed: "
            f"{rec.error_type}: {one_line(rec.error or '')}"
        )


def _check_measurable(result: RunResult, target: Target, what: str) -> None:
    """Raise `ProfileError` when every request of a probe (or baseline) failed with a non-load error."""
    recs = result.records
    fatal = result.gave_up or (
        bool(recs) and all(not r.success and r.error_type in FATAL_ERRORS for r in recs)
    )
    if not fatal:
        return
    first = next((r for r in recs if r.error_type in FATAL_ERRORS), recs[0])
    raise ProfileError(
        f"cannot profile {target.url}: every request of {what} failed: "
        f"{first.error_type}: {one_line(first.error or '')}"
    )


def url_measure_factory(
    target: Target,
    max_context: int,
    seed: int = 0,
    plan: ProbePlan = ProbePlan(),
    opts: RunOptions = RunOptions(),
    hint: Callable[[Bucket], float | None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    on_probe: Callable[[str], None] | None = None,
) -> MeasureFactory:
    """`measure(rate)` per bucket against `target`; buckets longer than `max_context` cannot be served.
    `on_probe` hears one line as each baseline and probe starts (a live probe lasts minutes, a bucket an
    hour: the command shows it is working).

    Every probe (and each unloaded baseline) sends its own prompts (`RunOptions.prompt_salt`): the probes
    of a bucket reuse the same lengths and arrival gaps, and with the same prompts a server with prefix
    caching (vLLM's default) would serve every probe after the first from its cache."""
    probes = itertools.count(1)

    def unloaded(bucket: Bucket) -> tuple[float | None, Measurement]:
        """The bucket one request at a time: p90 TTFT of its first 10 requests (one output token each), and
        as a `Measurement` the median TTFT of those and the median TPOT of the first `UNLOADED_FULL` sent
        again with their whole output, failures counted (a server refusing the bucket's lengths: 400)."""
        reqs = unloaded_requests(bucket, max_context, seed)
        sched = [ScheduledRequest(k, 0.0, r.input_tokens, 1) for k, r in enumerate(reqs)]
        whole = [r for r in reqs[:UNLOADED_FULL] if r.output_tokens > 1]
        sched += [
            ScheduledRequest(len(reqs) + k, 0.0, r.input_tokens, r.output_tokens) for k, r in enumerate(whole)
        ]
        one_at_a_time = RunOptions(
            concurrency=1, timeout_s=opts.timeout_s, seed=opts.seed, prompt_salt=next(probes)
        )
        if on_probe is not None:
            on_probe(f"{bucket.label}: unloaded baseline, {len(sched)} requests one at a time")
        result = asyncio.run(replay(sched, target, one_at_a_time, None, transport))
        _check_measurable(result, target, f"the unloaded baseline of {bucket.label}")
        ttfts = [r.ttft_s for r in result.records if r.index < len(reqs) and r.ttft_s is not None]
        tpots = [r.tpot_s for r in result.records if r.index >= len(reqs) and r.tpot_s is not None]
        best = Measurement(
            rate=0.0,
            n=len(ttfts),
            ttft_p90_ms=float(np.median(ttfts)) * 1000.0 if ttfts else float("inf"),
            tpot_p90_ms=float(np.median(tpots)) * 1000.0 if tpots else 0.0,
            failed=sum(not r.success for r in result.records),
        )
        return (float(np.percentile(ttfts, 90)) * 1000.0 if ttfts else None), best

    def factory(bucket: Bucket) -> BucketMeasure | None:
        if not bucket.feasible(max_context):
            return None
        e2e_estimate = 1.0 + (bucket.output_hi - 1) * PROBE_TPOT_S

        def measure(rate: float) -> Measurement:
            window = plan.window_s(rate, e2e_estimate)
            reqs, lo, hi = probe_requests(bucket_requests(bucket, max_context, seed), rate, window)
            sched = [
                ScheduledRequest(k, r.offset / rate, r.input_tokens, r.output_tokens)
                for k, r in enumerate(reqs)
            ]
            salted = dataclasses.replace(opts, prompt_salt=next(probes))
            if on_probe is not None:
                last = sched[-1].send_at_s if sched else 0.0
                on_probe(f"{bucket.label}: probing {rate:.4g} req/s, {len(sched)} requests over {last:.0f} s")
            result = asyncio.run(replay(sched, target, salted, None, transport))
            _check_measurable(result, target, f"the probe of {bucket.label} at {rate:.4g} req/s")
            window_recs = [r for r in result.records if lo <= r.scheduled_s < hi]
            ok = [r for r in window_recs if r.success]
            m = summarize(
                rate,
                [r.scheduled_s for r in ok],
                [r.ttft_s or 0.0 for r in ok],
                [r.tpot_s for r in ok],
                failed=len(window_recs) - len(ok),
            )
            behind = max((r.send_lag_s for r in window_recs), default=0.0)
            return dataclasses.replace(m, stable=False) if behind > GENERATOR_BACKLOG_S else m

        ttft_p90, best = unloaded(bucket)
        return BucketMeasure(measure, None if hint is None else hint(bucket), ttft_p90, best)

    return factory
