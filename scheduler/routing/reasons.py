"""Why a worker was filtered, how a request ended, and the one table mapping reasons to HTTP errors.

`REJECT_TABLE` is the single source for a rejected request's HTTP status, error `code` (the error `type`
follows from the status through `ERROR_TYPES`, shared with the gateway's own errors in `server/errors.py`), whether the gateway should hold it in the admission queue and retry (`retryable`), and the
`Retry-After` hint. `Reject.from_counts` turns per-worker reason counts into one summary:

    "no worker fits: 3 kv_full, 1 draining"

Its `primary` reason picks the table row: the most frequent *retryable* reason if any (a worker that is
full now may free up), else the most frequent other reason; `wrong_model` counts only when no worker
serves the model at all. `empty_pool` is the router's, not a worker's: a configured pool of the request's
model and role with no worker now (`FleetView.pools`), so a fleet whose decode pool was scaled to zero
holds the request until the pool is back instead of refusing it as `wrong_role`. `pool_stays_empty` is
the same for a pool nothing can add a worker to (`PoolRef.waited_for` False): final, a 503 at once, also when
it is the model's only pool (which an empty tally would have read as a retryable `no_workers`, and the
other models' workers as `wrong_model`, a 404 for a model the gateway lists).

`kv_full` and `kv_exceeds_capacity` split "the KV does not fit": the first fits the worker's reservable
capacity once others finish (retryable, 429 at the queue deadline); the second exceeds it even with
nothing else reserved on the worker (this gateway's share, watermark applied), so waiting cannot help: a
400 at once, whose message gives the footprint and the largest worker's reservable blocks (`details`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class FilterReason(StrEnum):
    """Why one worker cannot serve one request (a metric label and part of the Reject message)."""

    WRONG_MODEL = "wrong_model"
    WRONG_ROLE = "wrong_role"
    STARTING = "starting"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    BREAKER_OPEN = "breaker_open"
    EXCLUDED = "excluded"  # the gateway already failed on it for this request
    AT_CAPACITY = "at_capacity"  # in-flight requests at the worker's concurrency limit
    KV_FULL = "kv_full"  # the request's KV does not fit now (ledger or scraped usage)
    # the request's KV exceeds what the ledger could ever reserve on the worker (empty, no shrink)
    KV_EXCEEDS_CAPACITY = "kv_exceeds_capacity"
    EXCEEDS_CONTEXT = "exceeds_context"  # prompt longer than the worker's max_model_len or whole KV cache
    NO_ADAPTER = "no_adapter"  # the request names a LoRA adapter the worker does not serve
    NO_WORKERS = "no_workers"  # the fleet is empty
    # a configured pool the request could use has no worker now (scaled to zero, pods not yet listed):
    # counted once per such pool when nothing else fits, so the request waits for it to come back
    EMPTY_POOL = "empty_pool"
    # ... and one that nothing can add a worker to (`PoolRef.waited_for` False): final, refused at once
    POOL_STAYS_EMPTY = "pool_stays_empty"


class Outcome(StrEnum):
    """How a reservation ended (the gateway's terminal outcomes, plus the router's own rollback)."""

    COMPLETED = "completed"
    FAILED_BEFORE_FIRST_BYTE = "failed_before_first_byte"
    CLIENT_DISCONNECTED = "client_disconnected"
    WORKER_ERROR = "worker_error"
    # the worker answered 4xx (bad request, context too long, unknown adapter, ...): healthy, nothing served
    # and nothing cached, but not its fault (a breaker, a KV release metric or a dashboard must tell it apart)
    WORKER_REJECTED = "worker_rejected"
    LEASE_EXPIRED = "lease_expired"
    UNRESERVED = "unreserved"  # released inside the routing cycle (Unreserve); the request never ran there


# HTTP status → error `type` of every error the gateway answers itself: the router's rejects (below) and the
# gateway's own causes (`server/errors.py` ERROR_TABLE, which reads it from here: `scheduler/` may not import
# `server/`). vLLM's class-name vocabulary (BadRequestError, NotFoundError, ...), as its workers' errors pass
# through unchanged: one status, one type, whichever path answered (an unknown model was NotFoundError from
# the gateway and invalid_request_error from the router, both 404 model_not_found).
ERROR_TYPES: Mapping[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


@dataclass(frozen=True, slots=True)
class RejectRule:
    status: int  # HTTP status the gateway answers with once it stops retrying
    code: str  # OpenAI error `code`
    retryable: bool  # True → hold in the admission queue and route again until its deadline
    retry_after_s: float  # Retry-After hint on the final 429/503

    @property
    def error_type(self) -> str:
        """The error `type`: the status's (`ERROR_TYPES`), never a row's own, so it cannot drift."""
        return ERROR_TYPES[self.status]


# One row per reason; tests iterate it. Order = precedence among equal counts.
REJECT_TABLE: Mapping[FilterReason, RejectRule] = {
    FilterReason.KV_FULL: RejectRule(429, "kv_cache_full", True, 1.0),
    FilterReason.AT_CAPACITY: RejectRule(429, "workers_at_capacity", True, 1.0),
    FilterReason.STARTING: RejectRule(503, "workers_starting", True, 5.0),
    FilterReason.EMPTY_POOL: RejectRule(503, "pool_empty", True, 5.0),
    FilterReason.DRAINING: RejectRule(503, "workers_draining", True, 5.0),
    FilterReason.BREAKER_OPEN: RejectRule(503, "workers_unavailable", True, 5.0),
    FilterReason.UNHEALTHY: RejectRule(503, "workers_unavailable", True, 5.0),
    FilterReason.NO_WORKERS: RejectRule(503, "no_workers", True, 5.0),
    FilterReason.EXCLUDED: RejectRule(502, "upstream_failed", False, 1.0),
    FilterReason.WRONG_ROLE: RejectRule(503, "no_worker_for_role", False, 5.0),
    FilterReason.POOL_STAYS_EMPTY: RejectRule(503, "no_worker_for_role", False, 0.0),
    # the gateway resolved the adapter from a worker that listed it, gone since: as vLLM answers a name it
    # does not serve
    FilterReason.NO_ADAPTER: RejectRule(404, "model_not_found", False, 0.0),
    FilterReason.EXCEEDS_CONTEXT: RejectRule(400, "context_length_exceeded", False, 0.0),
    FilterReason.KV_EXCEEDS_CAPACITY: RejectRule(400, "kv_exceeds_capacity", False, 0.0),
    FilterReason.WRONG_MODEL: RejectRule(404, "model_not_found", False, 0.0),
}
# `Cycle.facts` key where the kv-fit filter records, for `Reject.details`, the largest reservable capacity
# among workers the request exceeds: {"kv_need_blocks": N, "kv_reservable_blocks": M}
KV_EXCEEDS_FACT = "kv-fit/exceeds_capacity"
# ... and where the context-length filter records the largest context among the workers the prompt exceeds:
# {"context_limit_tokens": N, "prompt_tokens": P, "exact": bool} (P the longest prompt, counted or estimated)
CONTEXT_FACT = "context-length/limit"
_ORDER = {reason: i for i, reason in enumerate(REJECT_TABLE)}


@dataclass(frozen=True, slots=True)
class Reject:
    """No worker can take the request now. `reason` is the human summary; `counts` the per-reason tally."""

    reason: str
    counts: Mapping[FilterReason, int]
    retry_after_s: float
    retryable: bool
    primary: FilterReason = FilterReason.NO_WORKERS
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rule(self) -> RejectRule:
        return REJECT_TABLE[self.primary]

    @property
    def http_status(self) -> int:
        return self.rule.status

    def error_body(self, model: str | None = None) -> dict[str, Any]:
        """The OpenAI error JSON the gateway returns when it gives up on this request."""
        message = self.reason if model is None else f"{self.reason} (model {model!r})"
        if self.primary is FilterReason.WRONG_MODEL and model is not None:
            message = f"The model {model!r} does not exist or no worker serves it"
        elif self.primary is FilterReason.NO_ADAPTER:
            of = "" if model is None else f" of model {model!r}"
            message = f"No worker{of} serves the LoRA adapter the request names any more ({self.reason})"
        elif self.primary is FilterReason.EXCEEDS_CONTEXT and "context_limit_tokens" in self.details:
            # vLLM's wording, with what the gateway knows: its count is an estimate unless token ids were sent
            of = (
                "This model's maximum context length"
                if model is None
                else f"The maximum context length of model {model!r}"
            )
            about = "" if self.details.get("exact") else "about "
            # a pooling request (embeddings) needs no room for output: its prompt alone is over
            why = (
                "leaves no room for any output token"
                if self.details.get("generates", True)
                else "exceeds this limit even without any output tokens"
            )
            message = (
                f"{of} is {self.details['context_limit_tokens']} tokens. However, your "
                f"prompt contains {about}{self.details['prompt_tokens']} input tokens, which {why}. Please "
                "reduce the length of the input prompt."
            )
        elif self.primary is FilterReason.KV_EXCEEDS_CAPACITY and "kv_need_blocks" in self.details:
            of = "" if model is None else f" of model {model!r}"
            message = (
                f"The request's KV-cache footprint of {self.details['kv_need_blocks']} blocks exceeds the "
                f"{self.details['kv_reservable_blocks']} blocks the largest worker{of} can reserve for one "
                "request; lower max_tokens (or n, or the prompt length)"
            )
        # vLLM names the prompt's length as the parameter at fault (`input_tokens`), whichever prompt form
        param = "input_tokens" if self.primary is FilterReason.EXCEEDS_CONTEXT else None
        return {
            "error": {
                "message": message,
                "type": self.rule.error_type,
                "param": param,
                "code": self.rule.code,
            }
        }

    @classmethod
    def from_counts(
        cls,
        counts: Mapping[FilterReason, int],
        details: Mapping[str, Any] | None = None,
        pinned: bool = False,
    ) -> Reject:
        """Summarise per-reason counts; `wrong_model` is left out of the summary when other reasons exist
        (workers of other models are not news), `wrong_role` is the primary reason only when no other is,
        and an empty tally means an empty fleet. `details` is kept as is (the kv-fit filter's
        `KV_EXCEEDS_FACT`, read by `error_body`). `pinned`: the request may run on one worker only (a
        Responses continuation), every other one counted `excluded`; the answer is then the pinned worker's
        own reason whenever it has one (the others' exclusions outnumbered it: a continuation naming an
        adapter its worker lacks was a 502 `upstream_failed` the SDK retried twice, not the final 404)."""
        tally = {FilterReason(r): n for r, n in counts.items() if n > 0}
        shown: dict[FilterReason, int] = {
            r: n for r, n in tally.items() if r is not FilterReason.WRONG_MODEL
        } or tally
        if not shown:
            rule = REJECT_TABLE[FilterReason.NO_WORKERS]
            return cls(
                "no worker fits: no workers", {}, rule.retry_after_s, rule.retryable, FilterReason.NO_WORKERS
            )
        # Workers of a role the profile does not use are the reason only when nothing else is: a P/D
        # fleet's prefill workers outnumbering the decode workers that refuse a prompt over the context
        # made the answer a 503 no_worker_for_role, not the 400 context_length_exceeded.
        candidates = {r: n for r, n in shown.items() if r is not FilterReason.WRONG_ROLE} or shown
        if pinned:
            candidates = {r: n for r, n in candidates.items() if r is not FilterReason.EXCLUDED} or candidates
        primary = _primary(candidates)
        rule = REJECT_TABLE[primary]
        ordered = sorted(shown.items(), key=lambda kv: (-kv[1], _ORDER[kv[0]]))
        summary = "no worker fits: " + ", ".join(f"{n} {r.value}" for r, n in ordered)
        return cls(summary, dict(tally), rule.retry_after_s, rule.retryable, primary, dict(details or {}))


def _primary(shown: Mapping[FilterReason, int]) -> FilterReason:
    retryable = {r: n for r, n in shown.items() if REJECT_TABLE[r].retryable}
    pool = retryable or shown
    return min(pool, key=lambda r: (-pool[r], _ORDER[r]))
