"""Where each Responses API answer the gateway served lives: response id → worker (stored-response affinity).

vLLM keeps a stored response (`store: true`, with `VLLM_ENABLE_RESPONSES_API_STORE=1`) in the memory of the
one server that generated it, so a continuation (`previous_response_id`), `GET /v1/responses/{id}` and
`POST /v1/responses/{id}/cancel` only work on that server. The gateway remembers, for every response it
relayed, the worker that served it — from a whole answer's `id`, or a stream's `response.created` event —
and how many tokens its conversation held (the worker's `usage`: input + output), which a continuation's
prompt carries again (`server.footprint.with_context`).

Bounded both ways (`responses.affinity_max_entries`, `responses.affinity_ttl_s`): least recently used
first out, and an entry older than the TTL is gone (vLLM itself never evicts, but a gateway must not grow
without bound; a response older than the TTL is served only by asking its worker directly). An id the
gateway does not know is answered 404 in OpenAI's shape, as vLLM answers an id it does not store.
In-process: several gateway replicas each know only the responses they served (docs/gateway.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class StoredResponse:
    worker_id: str
    model: str
    context_tokens: int  # the conversation's tokens after this response: its input + output (0 unknown)
    at: float  # when it was remembered (monotonic clock)


class ResponseAffinity:
    """LRU map of response id → `StoredResponse`, bounded by size and age (module docstring)."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def remember(self, response_id: str, worker_id: str, model: str, context_tokens: int, now: float) -> None:
        """Record (or refresh) where `response_id` lives; evicts the least recently used past the bound."""
        entries = self._entries
        entries[response_id] = StoredResponse(worker_id, model, context_tokens, now)
        entries.move_to_end(response_id)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def update_tokens(self, response_id: str, context_tokens: int) -> None:
        """A stream's conversation size, known only at its last event (its id came with the first)."""
        entry = self._entries.get(response_id)
        if entry is not None:
            entry.context_tokens = context_tokens

    def lookup(self, response_id: str, now: float) -> StoredResponse | None:
        """The entry, marked recently used; None when unknown or older than the TTL (then forgotten)."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if now - entry.at > self.ttl_s:
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return entry

    def forget(self, response_id: str) -> None:
        self._entries.pop(response_id, None)
