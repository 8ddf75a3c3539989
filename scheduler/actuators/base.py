"""The actuator contract and the record of what an actuator did."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


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


class ActuatorCallFailed(RuntimeError):
    """A backend call that failed, its message naming what it was on (e.g. "reading deployments/x/scale in
    namespace llm: 403 Forbidden: <the API server's message>"): an operator reads it in the controller's log
    and `/admin/autoscaler` without a second look at the cluster."""


def api_error_text(exc: BaseException) -> str:
    """An error as one line for logs and scale actions: an API answer as "<status> <reason>: <message>" (the
    message from a Kubernetes `Status` body, e.g. RBAC's "... cannot patch resource "deployments/scale" ..."),
    `ActuatorCallFailed` as its own message, anything else (a transport error) as "<type>: <message>"."""
    if isinstance(exc, ActuatorCallFailed):
        return str(exc)
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is None and reason is None:
        return f"{type(exc).__name__}: {exc}"
    head = f"{status or ''} {reason or type(exc).__name__}".strip()
    message = _status_message(getattr(exc, "body", None))
    return f"{head}: {message}" if message else head


def _status_message(body: Any) -> str | None:
    """The `message` of a Kubernetes `Status` object in an error body (str or bytes), if there is one."""
    if isinstance(body, bytes | bytearray):
        body = body.decode("utf-8", "replace")
    if not isinstance(body, str) or not body.strip():
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if not isinstance(message, str) or not message.strip():
        return None
    return message.strip()
