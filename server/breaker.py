"""A per-worker circuit breaker: closed → open on failures → one probe → closed (or open again).

- **closed**: requests flow. `failure_threshold` consecutive failures (timeouts, 5xx, failed health
  checks) open it; a connection refused/reset opens it at once (passive ejection: the process is not
  listening, retrying it only burns the retry budget).
- **open**: the router filters the worker out (`breaker_open`). After `open_s` it becomes probe-able.
- **half-open**: the next active health check is the probe (no client request is risked on it): failure
  re-opens it for `open_s` · 2^k (k = consecutive re-opens, capped at 8·open_s); success closes the breaker
  **on probation**. A `/health` 200 does not show that requests succeed (a worker answering every request
  500, or stalling every stream, passes it), so on probation the first request failure re-opens it at once,
  with k kept and raised, and only a request's success ends the probation and resets k. Before, the probe's
  success reset k and took `failure_threshold` failed client requests to re-open, every `open_s`. A failed
  health check on probation counts as when closed (`failure_threshold` in a row re-open it, k raised): a
  gateway without traffic never ends its probation, and one slow `/health` had re-opened a worker serving
  fine for up to 8·open_s (its only worker: 503s for 40 s).
- **ejection limit**: a failure that would open it while the gateway's `max_ejection_percent` of the worker's
  peers are out already (`may_open()` False) is counted and leaves it closed (`overflows`, `held_back`): a
  client whose requests fail on every worker (one that trips a vLLM bug) would otherwise eject them all. A
  refused connection opens it regardless, and so do failed health checks once they alone reach
  `failure_threshold` (the worker is down: unhealthy): one slow check on top of held-back request failures
  does not.
- **refused**: while the last failure was a refused connection (nothing listens: a process starting,
  restarting or gone), every health check is a probe, whatever the backoff: a check of a closed port costs
  the worker nothing, and a vLLM that has just loaded its model is routable at the next health round instead
  of up to 8·open_s after (measured on a CPU vLLM: 13–38 s after its first `/health` 200).

Time is passed in (`now`, monotonic seconds) so the breaker is testable without sleeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    failure_threshold: int
    open_s: float
    failures: int = 0
    opened_at: float | None = None
    reopens: int = 0
    trips: int = 0  # times opened, for /admin/workers
    refused: bool = False  # the last failure was a refused connection: probe at every health check
    probation: bool = False  # closed by a health probe: the next request failure re-opens it at once
    # of `failures`, those of streams that failed after they began (`stream_*` kinds): a later stream's first
    # byte does not excuse them (`record_first_byte`), only a request's success does
    stream_failures: int = 0
    # of `failures`, the failed health checks: the next passed check excuses them (`record_check_ok`), not
    # the requests' failures (a /health 200 does not show that requests succeed)
    check_failures: int = 0
    # openings the ejection limit held back (`record_failure`'s `may_open`), for /admin/workers; `held_back`:
    # the last failure was one (set by the first of a streak; ended by a success, a probe or its opening)
    overflows: int = 0
    held_back: bool = False

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if now - self.opened_at >= self._open_for():
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def is_open(self, now: float) -> bool:
        """True while requests must not be sent (open or waiting for its probe)."""
        return self.opened_at is not None

    def _open_for(self) -> float:
        return self.open_s * min(8, 2**self.reopens)

    def record_success(self) -> None:
        """A request succeeded (the registry calls it while closed): the count, probation and backoff end."""
        self.failures = 0
        self.stream_failures = 0
        self.check_failures = 0
        self.opened_at = None
        self.reopens = 0
        self.refused = False
        self.probation = False
        self.held_back = False

    def record_first_byte(self) -> None:
        """A stream began: the worker is reachable and generates, which excuses the failures that say it was
        not (connect errors, time-outs, failed checks), not those of streams that broke after they began: a
        worker failing every stream midway sends first bytes too (each had reset the whole count, and it was
        never ejected)."""
        self.failures = self.stream_failures
        self.check_failures = 0

    def record_check_ok(self) -> None:
        """A health check passed while closed: the failed checks before it were not in a row. Without this an
        idle gateway (no request to reset the count) ejected a worker after any `failure_threshold` failed
        checks, however far apart."""
        self.failures -= self.check_failures
        self.check_failures = 0

    def record_failure(
        self,
        now: float,
        hard: bool = False,
        stream: bool = False,
        check: bool = False,
        may_open: Callable[[], bool] | None = None,
    ) -> bool:
        """Count a failure (`stream`: of a stream after it began; `check`: a failed health check, not a
        request); `hard` (connection refused) trips at once, and so does a request's on probation. Opened on
        probation, it is a re-open: the backoff doubles. `may_open` (asked only when this failure would open it,
        so the failures below the threshold cost nothing) returning False: the ejection limit is reached, and the
        failure is counted without opening it (a later one opens it once the limit allows), unless it is `hard`
        or a failed check that makes `failure_threshold` failed checks in a row. None: no limit. True when this
        call opened it."""
        if self.opened_at is not None:
            return False
        self.failures += 1
        self.stream_failures += stream
        self.check_failures += check
        if hard or (self.probation and not check) or self.failures >= self.failure_threshold:
            down = hard or (check and self.check_failures >= self.failure_threshold)
            if not down and may_open is not None and not may_open():
                self.overflows += 1
                self.held_back = True
                return False
            self.held_back = False
            if self.probation:
                self.reopens += 1
            self.probation = False
            self.opened_at = now
            self.trips += 1
            self.refused = hard
            return True
        return False

    def probe_due(self, now: float) -> bool:
        return self.refused or self.state(now) is BreakerState.HALF_OPEN

    def record_probe(self, ok: bool, now: float, hard: bool = False) -> None:
        if ok:  # closed on probation, the backoff kept until a request succeeds
            self.failures = 0
            self.stream_failures = 0
            self.check_failures = 0
            self.opened_at = None
            self.refused = False
            self.probation = True
            self.held_back = False
        else:
            self.reopens += 1
            self.opened_at = now
            self.refused = hard
