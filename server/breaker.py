"""A per-worker circuit breaker: closed → open on failures → one probe → closed (or open again).

- **closed**: requests flow. `failure_threshold` consecutive failures (timeouts, 5xx, failed health
  checks) open it; a connection refused/reset opens it at once (passive ejection: the process is not
  listening, retrying it only burns the retry budget).
- **open**: the router filters the worker out (`breaker_open`). After `open_s` it becomes probe-able.
- **half-open**: the next active health check is the probe (no client request is risked on it): success
  closes the breaker; failure re-opens it for `open_s` · 2^k (k = consecutive re-opens, capped at 8·open_s).
- **refused**: while the last failure was a refused connection (nothing listens: a process starting,
  restarting or gone), every health check is a probe, whatever the backoff: a check of a closed port costs
  the worker nothing, and a vLLM that has just loaded its model is routable at the next health round instead
  of up to 8·open_s after (measured on a CPU vLLM: 13–38 s after its first `/health` 200).

Time is passed in (`now`, monotonic seconds) so the breaker is testable without sleeping.
"""

from __future__ import annotations

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
        self.failures = 0
        self.opened_at = None
        self.reopens = 0
        self.refused = False

    def record_failure(self, now: float, hard: bool = False) -> bool:
        """Count a failure; `hard` (connection refused) trips at once. True when this call opened it."""
        if self.opened_at is not None:
            return False
        self.failures += 1
        if hard or self.failures >= self.failure_threshold:
            self.opened_at = now
            self.trips += 1
            self.refused = hard
            return True
        return False

    def probe_due(self, now: float) -> bool:
        return self.refused or self.state(now) is BreakerState.HALF_OPEN

    def record_probe(self, ok: bool, now: float, hard: bool = False) -> None:
        if ok:
            self.record_success()
        else:
            self.reopens += 1
            self.opened_at = now
            self.refused = hard
