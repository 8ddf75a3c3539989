"""When each request is sent: the trace's own timing (scaled, windowed) or a fixed-rate arrival process.

Trace timing: a request that arrived at `a` seconds into the trace is sent at

    send_at = (a − start) / rate_scale           for start ≤ a < start + duration

so `--rate-scale 2` replays twice as fast, and `--start 600 --duration 60` replays the 11th minute
(the window is in trace seconds, before scaling). Fixed rate (`--rate R`): the window still selects by
the trace's own times when it has any, then the selected requests keep their order and lengths and are
re-timed by a Poisson process at R req/s (gamma gaps with shape k = `burstiness`; `constant` spacing on
request) as vLLM's benchmark re-times them: the first after one gap, the N gaps rescaled so that the last
request goes at exactly N / R (`synthetic.fixed_rate_arrivals`). Traces without times (ShareGPT, length
samples) need `--rate`. A request scheduled past `latest_send_s` (`mosaic replay`: 10⁷ s, 116 days) is
refused. `max_requests` cuts the stream after N requests. With the trace's timing everything is lazy (one
request in, one out); with `--rate` the window (or the first N) is read first, as N sets the rescaling.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from loadgen.synthetic import fixed_rate_arrivals
from loadgen.trace import TraceRequest


class ScheduleError(ValueError):
    """Replay options that contradict each other or the trace."""


@dataclass(frozen=True, slots=True)
class ScheduleOptions:
    rate_scale: float = 1.0
    rate: float | None = None  # fixed arrival rate (req/s); None = the trace's timing
    arrival: str = "poisson"  # with `rate`: poisson | gamma | constant
    burstiness: float = 1.0  # gamma shape k for `rate` (1 = Poisson)
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    seed: int = 0
    # a request scheduled later than this after the start is refused (a real-time replay would sleep for
    # it: `--rate-scale 1e-300` slept ~1e298 s without a word); inf: no limit
    latest_send_s: float = math.inf

    def validate(self, timed: bool) -> None:
        """Raise ScheduleError for impossible combinations; `timed` = the trace carries arrival times."""
        if not (math.isfinite(self.rate_scale) and self.rate_scale > 0):
            raise ScheduleError(f"rate scale must be > 0, got {self.rate_scale}")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ScheduleError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.rate is not None and self.rate_scale != 1.0:
            raise ScheduleError("--rate replaces the trace's timing; --rate-scale only scales it: give one")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ScheduleError(f"--burstiness must be a finite number > 0, got {self.burstiness}")
        if self.burstiness != 1.0 and self.rate is None:
            raise ScheduleError(
                "--burstiness shapes --rate's arrivals; without --rate the trace's own timing (or a synthetic "
                "spec's burstiness=) applies: give --rate, or drop --burstiness"
            )
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ScheduleError(f"--start must be a finite number ≥ 0, got {self.start_s}")
        if self.duration_s is not None and not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ScheduleError(f"--duration must be a finite number > 0, got {self.duration_s}")
        if self.max_requests is not None and not self.max_requests > 0:
            raise ScheduleError(f"--max-requests must be > 0, got {self.max_requests}")
        if not timed and self.rate is None:
            raise ScheduleError("this trace has no arrival times: give --rate R (requests/s)")
        if not timed and (self.start_s > 0 or self.duration_s is not None):
            raise ScheduleError("--start/--duration select by arrival time, and this trace has none")


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    index: int  # 0-based position in the replay
    send_at_s: float  # seconds after the replay's start
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    trace_line: int = 0


def schedule(requests: Iterable[TraceRequest], opts: ScheduleOptions) -> Iterator[ScheduledRequest]:
    """The replay's send times; stops reading the trace as soon as the window or the cap is passed. Lazy
    with the trace's timing; with `rate`, the window is read before the first send (its size sets the
    rescaling, `fixed_rate_arrivals`)."""
    selected = _selected(requests, opts)
    if opts.rate is not None:
        chosen = list(selected)
        rng = random.Random(f"mosaic-schedule-{opts.seed}")
        times = fixed_rate_arrivals(len(chosen), opts.rate, opts.arrival, opts.burstiness, rng)
        timed: Iterable[tuple[TraceRequest, float]] = zip(chosen, times, strict=True)
    else:
        timed = ((req, _trace_time(req, opts)) for req in selected)
    for index, (req, send_at) in enumerate(timed):
        if send_at > opts.latest_send_s:
            raise ScheduleError(
                f"request {index} would be sent {send_at:g} s after the start, past the replay's limit of "
                f"{opts.latest_send_s:g} s ({opts.latest_send_s / 86400:.0f} days): use a larger rate scale or "
                "rate, or --duration"
            )
        yield ScheduledRequest(index, send_at, req.input_tokens, req.output_tokens, req.hash_ids, req.line)


def _selected(requests: Iterable[TraceRequest], opts: ScheduleOptions) -> Iterator[TraceRequest]:
    """The requests of the window (by the trace's own times, when it has any), at most `max_requests`."""
    end = None if opts.duration_s is None else opts.start_s + opts.duration_s
    if opts.max_requests is not None and opts.max_requests <= 0:
        return
    count = 0
    for req in requests:
        if req.arrival_s is not None:
            if req.arrival_s < opts.start_s:
                continue
            if end is not None and req.arrival_s >= end:
                return  # arrivals are non-decreasing (readers enforce it): nothing later is in the window
        yield req
        count += 1
        if opts.max_requests is not None and count >= opts.max_requests:
            return  # before the loop pulls another row: a bad row past the cap is never read


def _trace_time(req: TraceRequest, opts: ScheduleOptions) -> float:
    assert req.arrival_s is not None
    send_at = (req.arrival_s - opts.start_s) / opts.rate_scale
    if not math.isfinite(send_at):  # a rate scale so small that the division overflows
        raise ScheduleError(
            f"rate scale {opts.rate_scale:g} puts a request at infinity (trace time {req.arrival_s:g} s)"
        )
    return send_at
