"""Dry-run actuator: decisions are recorded (and shown on /admin/autoscaler and as metrics), never applied."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from scheduler.actuators.base import ScaleAction


class DryRunActuator:
    def __init__(self, initial: Mapping[str, int], keep: int = 1000) -> None:
        self._desired = dict(initial)
        self.actions: deque[ScaleAction] = deque(maxlen=keep)

    def replicas(self, pool: str) -> int:
        return self._desired.get(pool, 0)

    def scale(self, pool: str, replicas: int, now: float) -> ScaleAction:
        # the "would-be" count is remembered so the next decision sees the intended fleet
        action = ScaleAction(now, pool, self._desired.get(pool, 0), replicas, applied=False)
        self._desired[pool] = replicas
        self.actions.append(action)
        return action
