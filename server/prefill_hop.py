"""The P/D prefill hop's verdicts: why a hop fell back to decode-only, whether its `kv_transfer_params` may
go to the decode worker, and a bounded warning for a prefill pool that is misconfigured.

**Fallback reasons** (`Fallback`, the `reason` label of `mosaic_pd_fallbacks_total`), and who hears of them:

| reason | the prefill hop | the prefill worker's breaker |
|---|---|---|
| timeout | its bound ran out (half the first-token budget), connecting included | a failure |
| pool_timeout | no connection to the worker came free within its bound (the gateway's own `max_upstream_connections`: the worker never saw the request) | nothing, as on the decode hop |
| worker_error | 5xx, connection refused or reset, a malformed HTTP answer | a failure (a refused connection: ejected at once) |
| busy | 429 | a success (busy, not broken) |
| refused | any other status but 200: 401/403 (the pool's `api_key_env`), 404 (path or model); 400 and 422 only when the decode worker serves the request | nothing; a WARNING |
| bad_response | a 200 whose body is no JSON object, is longer than `MAX_ANSWER_BYTES`, or whose `kv_transfer_params` fail `kv_params_fault` | a failure |
| no_params | a 200 without `kv_transfer_params` (null or absent: vLLM without a KV connector) | a success; a WARNING |
| removed | none: the worker left the fleet (discovery) between routing and the hop | nothing |

A 400 or 422 (`REQUEST_FAULTS`: vLLM's answer to an invalid request — a bad parameter, a prompt over the
context) goes decode-only too (`PrefillRefusal`), but is counted `refused` and warned of only when the decode
worker then serves the request (answers below 400): the prefill pool refuses what the decode pool takes, its
flags, chat template or context set up apart. When the decode worker refuses it as well, the request was at
fault, not the pool: the client gets the decode worker's answer, and nothing is counted (every invalid
request had counted and warned as a misconfigured prefill pool). The worker's breaker hears a success.

The two WARNING reasons are misconfigurations the breaker cannot see (the worker is healthy): each is logged
at most once per worker and reason every `WARN_EVERY_S`, with how many were held back (`LogThrottle`).

**The check on `kv_transfer_params`** (`kv_params_fault`). What the decode worker and the gateway act on:
a JSON object with `do_remote_prefill: true` (the decode worker pulls the prompt's KV instead of computing
it; the gateway counts its prompt as prefilled remotely) and `do_remote_decode` absent, null or false (true
would make the decode worker hold its own KV blocks for a remote decode nobody runs: the same leak for which
a client may not send `kv_transfer_params`). Every other key passes as it came (vLLM's NixlConnector:
`remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, `remote_request_id`, `tp_size`; other
connectors' own), bounded in size: at most `MAX_KV_DEPTH` levels of nesting (the decode body is encoded
again, and JSON nested near the parser's limit fails there) and `MAX_KV_VALUES` values in all.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from scheduler.routing.reasons import Outcome

# A prefill worker's statuses that judge the request (or a pool set up apart): see the module docstring.
REQUEST_FAULTS = frozenset({400, 422})


@dataclass(frozen=True, slots=True)
class PrefillRefusal:
    """The prefill worker refused the request (`REQUEST_FAULTS`); whose fault, the decode hop tells."""

    worker_id: str
    status: int


class Fallback(StrEnum):
    """Why a prefill hop ended decode-only (module docstring's table)."""

    TIMEOUT = "timeout"
    POOL_TIMEOUT = "pool_timeout"
    WORKER_ERROR = "worker_error"
    BUSY = "busy"
    REFUSED = "refused"
    BAD_RESPONSE = "bad_response"
    NO_PARAMS = "no_params"
    REMOVED = "removed"  # the prefill worker left the fleet between routing and the hop

    @classmethod
    def of_failure(cls, kind: str) -> Fallback:
        """The reason for a failure of `server.failure.classify`'s `kind` (or `bad_response`)."""
        if kind in (cls.POOL_TIMEOUT, cls.BAD_RESPONSE):
            return cls(kind)
        return cls.TIMEOUT if "timeout" in kind else cls.WORKER_ERROR

    @classmethod
    def of_status(cls, status: int) -> Fallback:
        """The reason for an answer other than 200."""
        if status == 429:
            return cls.BUSY
        return cls.WORKER_ERROR if status >= 500 else cls.REFUSED


# What a decode-only fallback tells the prefill worker's stateful routing plugins (prefix affinity) when the
# request ends: a hop the worker refused, or that failed before it ran, built no KV there (the affinity its
# dispatch recorded is taken back); one that timed out or answered may have (the request's own outcome).
PREFILL_BUILT_NOTHING: Mapping[Fallback, Outcome] = {
    Fallback.REFUSED: Outcome.WORKER_REJECTED,
    Fallback.BUSY: Outcome.WORKER_REJECTED,
    Fallback.WORKER_ERROR: Outcome.FAILED_BEFORE_FIRST_BYTE,
    Fallback.POOL_TIMEOUT: Outcome.FAILED_BEFORE_FIRST_BYTE,
    Fallback.REMOVED: Outcome.FAILED_BEFORE_FIRST_BYTE,
}

# Misconfigurations a healthy prefill worker shows: logged as a WARNING (bounded), the rest at INFO.
WARNED = frozenset({Fallback.REFUSED, Fallback.NO_PARAMS})
WARN_EVERY_S = 60.0

# NixlConnector's deepest field is a list of lists (`remote_block_ids` per KV-cache group): 3 levels.
MAX_KV_DEPTH = 8
# 2^20 values: the block ids of a 16M-token prompt at vLLM's default 16 tokens per block. More is no
# prompt's handover but a worker gone wrong, and would be copied into the decode body whole.
MAX_KV_VALUES = 1 << 20
# The prefill answer is read whole only for its `kv_transfer_params`: the largest handover the check takes
# (MAX_KV_VALUES block ids of up to 8 digits and a comma each, 9 MiB) with room for the one-token answer
# around it (prompt logprobs, which grow with the prompt, never take the P/D path: `server.footprint`).
# Longer is a worker gone wrong, and the gateway would hold it all in memory: it stops reading there.
MAX_ANSWER_BYTES = 32 << 20


def kv_params_fault(params: Any) -> Fallback | None:
    """None when a prefill answer's `kv_transfer_params` may go to the decode worker; else NO_PARAMS (none:
    null or absent) or BAD_RESPONSE (module docstring). `params` is parsed JSON: an object's keys are
    strings, its values JSON values."""
    if params is None:
        return Fallback.NO_PARAMS
    if (
        not isinstance(params, dict)
        or params.get("do_remote_prefill") is not True
        or params.get("do_remote_decode") not in (None, False)
        or not _bounded(params)
    ):
        return Fallback.BAD_RESPONSE
    return None


def _bounded(params: dict[str, Any]) -> bool:
    """At most MAX_KV_DEPTH levels of objects and lists, holding at most MAX_KV_VALUES values in all.
    Iterative, so a deep value cannot exhaust the stack here."""
    left = MAX_KV_VALUES
    todo: list[tuple[dict[str, Any] | list[Any], int]] = [(params, 1)]
    while todo:
        node, depth = todo.pop()
        values = node.values() if isinstance(node, dict) else node
        left -= len(values)
        if left < 0:
            return False
        for v in values:
            if isinstance(v, dict | list):
                if depth == MAX_KV_DEPTH:
                    return False
                todo.append((v, depth + 1))
    return True


class LogThrottle:
    """At most one log line per key every `every_s` seconds of `clock`.

    `due(key)` returns None while the key's last line is younger than `every_s`, else how many were held
    back since that line (0 the first time); the caller logs only when it is not None. Keys of the past
    (a worker long gone) are forgotten once more than `max_keys` are held."""

    __slots__ = ("_last", "clock", "every_s", "max_keys")

    def __init__(self, every_s: float, clock: Callable[[], float], max_keys: int = 1024) -> None:
        self.every_s = every_s
        self.clock = clock
        self.max_keys = max_keys
        self._last: dict[Hashable, tuple[float, int]] = {}  # key → (when last logged, held back since)

    def due(self, key: Hashable) -> int | None:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.every_s:
            self._last[key] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._last) >= self.max_keys:
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every_s}
        self._last[key] = (now, 0)
        return 0 if last is None else last[1]
