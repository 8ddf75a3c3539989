"""The actuator contract and the record of what an actuator did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ScaleAction:
    at: float  # the decision's `now`
    pool: str
    before: int
    after: int
    applied: bool  # False for dry-run, or when the backend refused (see `error`)
    error: str | None = None


class Actuator(Protocol):
    def scale(self, pool: str, replicas: int, now: float) -> ScaleAction:
        """Set the pool's desired replica count. Idempotent: the same count twice is a no-op action."""
        ...

    def replicas(self, pool: str) -> int:
        """The pool's desired replica count as the backend holds it now."""
        ...
