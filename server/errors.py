"""Gateway-originated errors in OpenAI's nested shape, and the one table mapping each cause to its status.

Body: `{"error": {"message": str, "type": str, "param": str | None, "code": int | str | None}}`, the shape
vLLM (≥ 0.10.1) and OpenAI return, so the `openai` client raises the matching exception class
(400 → BadRequestError, 401 → AuthenticationError, 404 → NotFoundError, 413 → APIStatusError,
429 → RateLimitError, 5xx → InternalServerError). `code` carries the HTTP status like vLLM does, except
where a stable string code is more useful to scripts (rate limits, queue full).

Errors from workers are never rebuilt here: their bodies pass through unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import StrEnum

from starlette.responses import Response

from scheduler.routing.reasons import ERROR_TYPES


class Cause(StrEnum):
    """Why the gateway itself answered with an error; also the `reason` label of rejection metrics."""

    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    MODEL_NOT_FOUND = "model_not_found"
    BODY_TOO_LARGE = "body_too_large"
    RATE_LIMITED = "rate_limited"
    TOKEN_RATE_LIMITED = "token_rate_limited"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    NO_WORKER = "no_worker"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    SHUTTING_DOWN = "shutting_down"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INTERNAL = "internal_error"  # a bug in the gateway, not the worker's doing


# cause → HTTP status; a test iterates this table.
_STATUS: dict[Cause, int] = {
    Cause.BAD_REQUEST: 400,
    Cause.UNAUTHORIZED: 401,
    Cause.FORBIDDEN: 403,
    Cause.MODEL_NOT_FOUND: 404,
    Cause.NOT_FOUND: 404,
    Cause.METHOD_NOT_ALLOWED: 405,
    Cause.BODY_TOO_LARGE: 413,
    Cause.RATE_LIMITED: 429,
    Cause.TOKEN_RATE_LIMITED: 429,
    Cause.QUEUE_FULL: 429,
    Cause.QUEUE_TIMEOUT: 429,
    Cause.NO_WORKER: 503,
    Cause.UPSTREAM_UNAVAILABLE: 502,
    Cause.UPSTREAM_TIMEOUT: 504,
    Cause.SHUTTING_DOWN: 503,
    Cause.INTERNAL: 500,
}
# cause → (HTTP status, error `type`): the type is the status's in the one vocabulary the router's rejects
# use too (`scheduler.routing.reasons.ERROR_TYPES`), so both paths answer a status with the same type.
ERROR_TABLE: dict[Cause, tuple[int, str]] = {
    cause: (status, ERROR_TYPES[status]) for cause, status in _STATUS.items()
}

# Causes whose `code` is a stable string rather than the status number (OpenAI uses strings here too).
_STRING_CODES = {
    Cause.MODEL_NOT_FOUND: "model_not_found",
    Cause.RATE_LIMITED: "rate_limit_exceeded",
    Cause.TOKEN_RATE_LIMITED: "tokens_rate_limit_exceeded",
    Cause.QUEUE_FULL: "queue_full",
    Cause.QUEUE_TIMEOUT: "queue_timeout",
    Cause.UNAUTHORIZED: "invalid_api_key",
}


@dataclass(slots=True)
class GatewayError(Exception):
    """Raised anywhere on the request path; the app turns it into one OpenAI error response."""

    cause: Cause
    message: str
    param: str | None = None
    retry_after_s: float | None = None
    status_override: int | None = None  # a router Reject's own status and body (its REJECT_TABLE row)
    body_override: dict[str, object] | None = None
    reason_override: str | None = None  # a router Reject's own code (its REJECT_TABLE row), for the metrics

    def __str__(self) -> str:
        return f"{self.cause}: {self.message}"

    @property
    def reason(self) -> str:
        """The `reason` label of the rejection metrics (and of the `rejected_*` outcome)."""
        return self.reason_override or self.cause.value

    @property
    def status(self) -> int:
        return self.status_override or ERROR_TABLE[self.cause][0]

    def body(self) -> dict[str, object]:
        if self.body_override is not None:
            return self.body_override
        status = self.status
        err_type = ERROR_TYPES[status]  # the answered status's type, also under a status_override
        code: int | str = _STRING_CODES.get(self.cause, status)
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": code}}

    def to_response(self, request_id: str | None = None) -> Response:
        headers: dict[str, str] = {}
        if self.retry_after_s is not None:
            # Retry-After is whole seconds (RFC 9110); round up so clients never retry early.
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.cause is Cause.UNAUTHORIZED:
            headers["WWW-Authenticate"] = 'Bearer realm="mosaic"'
        if request_id:
            headers["X-Request-Id"] = request_id
        return Response(json.dumps(self.body()), self.status, headers, media_type="application/json")


def response_not_found(response_id: str) -> GatewayError:
    """404 for a Responses id the gateway cannot place (never served, forgotten, its worker gone), in vLLM's
    own body for an id it does not store (`invalid_request_error`, param `response_id`, as for a
    continuation, a GET or a cancel): a client sees one shape whichever of the two answered."""
    message = f"Response with id '{response_id}' not found."
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": "response_id", "code": 404}
    }
    return GatewayError(Cause.NOT_FOUND, message, param="response_id", body_override=body)


STREAM_DONE = b"data: [DONE]\n\n"  # the last event of every OpenAI stream
SHUTDOWN_MESSAGE = "The gateway is shutting down; retry on another replica."


def shutting_down() -> GatewayError:
    """The 503 a request gets once the gateway shuts down: new, still queued, or running past the grace."""
    return GatewayError(Cause.SHUTTING_DOWN, SHUTDOWN_MESSAGE, retry_after_s=1)


# What `json` raises on bytes that are no JSON it can decode: RecursionError on valid JSON nested past its
# recursion limit (a broken or hostile worker's answer), ValueError (UnicodeDecodeError among them) else.
NOT_JSON = (ValueError, RecursionError)


def is_error_event(piece: bytes) -> bool:
    """Whether a stream's piece opens with an error event (`data: {"error": ...}`: vLLM's and
    `stream_error_event`'s shape), not a token."""
    return piece.startswith(b"data:") and piece[5:].lstrip(b" ").startswith(b'{"error"')


def is_client_error_event(piece: bytes) -> bool:
    """Whether a piece opening with an error event carries a 4xx code: the worker refused the request
    (another would too), rather than failed it."""
    event = piece[5:].split(b"\n\n", 1)[0]
    try:
        error = json.loads(event).get("error")
        code = error.get("code") if isinstance(error, dict) else None
    except (*NOT_JSON, AttributeError):
        return False
    return type(code) is int and 400 <= code < 500


def stream_error_event(message: str, status: int = 500, err_type: str = "InternalServerError") -> bytes:
    """The SSE tail vLLM sends when a stream fails after it began: an error event, then `[DONE]`."""
    payload = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n" + STREAM_DONE
