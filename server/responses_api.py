"""OpenAI's Responses API (`/v1/responses`) on the relay path: its SSE framing, usage and error events.

vLLM 0.32 streams a response as typed events, each `event: <type>\\ndata: {json}\\n\\n` with the type
repeated in the JSON: `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` (one per engine step: the tokens), ... and one
terminal event, `response.completed` (whatever the response's `status`: `completed`, or `incomplete` at
`max_output_tokens`), `response.incomplete` or `response.failed` (OpenAI's), carrying the whole response with
its `usage: {input_tokens, output_tokens, ...}`. There is no `data: [DONE]`. A failure is an `error` event
(`{"type": "error", "code", "message", "param", "sequence_number"}`). A whole answer is the `response`
object itself.

`ResponsesRelay` reads that framing behind `server.proxy.SseRelay`'s interface (`feed`, `flush`, `done`,
`finished`, `aborted`, `error`, `usage`), so `StreamSession`'s timing, KV lease renewal, time-outs and
outcomes serve it unchanged: `done` is a terminal event relayed; `usage` the terminal event's, in the chat
names the gateway meters (`prompt_tokens`, `completion_tokens`); token events (`tokens`) are the deltas of
generated text (output text, reasoning, refusal, tool-call arguments), which time TTFT and ITL and grow the
KV reservation. It is a class of its own rather than branches in `SseRelay.feed`, which every chat and
completions chunk runs through. `ResponsesStreamSession` swaps in this relay and the framing of the
gateway's own error events.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from server.errors import NOT_JSON
from server.proxy import usage_count
from server.responses import StreamSession

if TYPE_CHECKING:
    from server.footprint import ParsedRequest
    from server.proxy import SseRelay

# Events that carry generated tokens: one per engine step, as a chat stream's content chunks.
TOKEN_EVENTS = frozenset(
    {
        b"response.output_text.delta",
        b"response.reasoning_text.delta",
        b"response.reasoning_summary_text.delta",
        b"response.refusal.delta",
        b"response.function_call_arguments.delta",
        b"response.custom_tool_call_input.delta",
    }
)
TERMINAL_EVENTS = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
CREATED_EVENT = b"response.created"
ERROR_EVENT = b"error"
# The response statuses of a response that ran to its end (`incomplete`: stopped at max_output_tokens, as a
# chat completion's finish_reason "length")
SERVED_STATUSES = frozenset({"completed", "incomplete"})
# a whole answer to `background: true`: the response was stored and runs on in the worker
BACKGROUND_STATUSES = frozenset({"queued", "in_progress"})


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """A Responses `usage` ({input_tokens, output_tokens, ...}) in the names the gateway meters with
    (`prompt_tokens`, `completion_tokens`, `total_tokens`); None when it is no object."""
    if not isinstance(usage, dict):
        return None
    prompt, output = usage_count(usage.get("input_tokens")), usage_count(usage.get("output_tokens"))
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def context_tokens(usage: dict[str, Any] | None) -> int:
    """What a continuation of this response carries again: its input + output tokens (0 unknown)."""
    return 0 if usage is None else usage["prompt_tokens"] + usage["completion_tokens"]


def error_event(message: str, status: int, err_type: str, sequence_number: int) -> bytes:
    """The gateway's own `error` event on a Responses stream (OpenAI's `ResponseErrorEvent`; `code` the
    status as a string, `type` the gateway's error type kept beside it)."""
    payload = {
        "type": "error",
        "code": str(status),
        "message": message,
        "param": None,
        "sequence_number": sequence_number,
        "error_type": err_type,
    }
    return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"


def _event_type(event: bytes) -> bytes:
    """The event's type: from its `event:` line (vLLM writes one), else from the JSON's `type` (an event
    without that line); b"" for a comment or an empty event."""
    if event.startswith(b"event:"):
        end = event.find(b"\n")
        return (event[6:] if end < 0 else event[6:end]).strip()
    at = event.find(b"data:")
    if at < 0:
        return b""
    payload = _json(event[at + 5 :])
    kind = payload.get("type") if isinstance(payload, dict) else None
    return kind.encode() if isinstance(kind, str) else b""


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except NOT_JSON:
        return None


def _data(event: bytes, at: int) -> dict[str, Any] | None:
    """The JSON object of an event's `data:` line (None when absent or not an object)."""
    if at < 0:
        return None
    payload = _json(event[at + 5 :])
    return payload if isinstance(payload, dict) else None


class ResponsesRelay:
    """`SseRelay`'s interface over a Responses stream (module docstring). `tokens`: token events relayed
    since the caller last reset it; `events`: events relayed (the next `sequence_number` a gateway error
    event takes); `on_created(response_id)` is called once the `response.created` event names the response,
    `on_usage(usage)` with the terminal event's usage."""

    __slots__ = (
        "_buf",
        "_cr_held",
        "aborted",
        "done",
        "error",
        "events",
        "finished",
        "on_created",
        "on_usage",
        "response_id",
        "role_only_relayed",
        "seen_fingerprint",
        "status",
        "strip_usage",
        "tokens",
        "usage",
        "usage_only_relayed",
        "watch_roles",
    )

    def __init__(
        self,
        on_created: Callable[[str], None] | None = None,
        on_usage: Callable[[dict[str, Any] | None], None] | None = None,
    ) -> None:
        self.on_created = on_created
        self.on_usage = on_usage
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.done = False  # a terminal event was relayed
        self.finished = False  # the response ran to its end (status completed or incomplete)
        self.aborted = False  # the worker cancelled it (status cancelled)
        self.response_id: str | None = None
        self.status: str | None = None  # the terminal response's status
        self.tokens = 0
        self.events = 0
        # `StreamSession` reads and resets these (a chat stream's usage-only and role-only events)
        self.usage_only_relayed = 0
        self.role_only_relayed = 0
        self.watch_roles = False
        self.strip_usage = False  # usage is part of the terminal event: never stripped
        self.seen_fingerprint: bytes | None = None  # a Responses stream names no `system_fingerprint`
        self._buf = b""
        self._cr_held = False

    def feed(self, chunk: bytes) -> bytes:
        if self.done:  # the terminal event was relayed: nothing after it is
            return b""
        if self._cr_held:
            chunk = b"\r" + chunk
            self._cr_held = False
        if chunk.find(b"\r") >= 0:  # CRLF framing (the SSE spec allows it): relayed as LF, as SseRelay does
            chunk = chunk.replace(b"\r\n", b"\n")
            if chunk.endswith(b"\r"):
                self._cr_held = True
                chunk = chunk[:-1]
        if self._buf:
            chunk = self._buf + chunk
            self._buf = b""
        cut = chunk.rfind(b"\n\n")
        if cut < 0:
            self._buf = chunk
            return b""
        self._buf = chunk[cut + 2 :]
        chunk = chunk[: cut + 2]
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n\n", start)
            if end < 0:
                break
            self._note(chunk[start:end])
            start = end + 2
            if self.done:  # whatever follows the terminal event in this read is not relayed
                self._buf = b""
                return chunk[:start]
        return chunk

    def _note(self, event: bytes) -> None:
        kind = _event_type(event.lstrip(b"\n"))
        if not kind:
            return
        self.events += 1
        if kind in TOKEN_EVENTS:
            self.tokens += 1
        elif kind == CREATED_EVENT:
            self._created(_data(event, event.find(b"data:")))
        elif kind in TERMINAL_EVENTS:
            self._terminal(_data(event, event.find(b"data:")))
        elif kind == ERROR_EVENT and self.error is None:
            payload = _data(event, event.find(b"data:")) or {}
            nested = payload.get("error")  # vLLM's chat-style `{"error": {...}}`, should one come
            error = dict(nested if isinstance(nested, dict) else payload)
            code = error.get("code")
            if (
                isinstance(code, str) and code.isdigit()
            ):  # OpenAI's codes are strings: "400" is a 4xx all the same
                error["code"] = int(code)
            self.error = error

    def _created(self, payload: dict[str, Any] | None) -> None:
        response = payload.get("response") if payload is not None else None
        rid = response.get("id") if isinstance(response, dict) else None
        if isinstance(rid, str) and self.response_id is None:
            self.response_id = rid
            if self.on_created is not None:
                self.on_created(rid)

    def _terminal(self, payload: dict[str, Any] | None) -> None:
        self.done = True
        response = payload.get("response") if payload is not None else None
        if not isinstance(response, dict):
            self.error = {"message": "terminal event without a response object", "code": None}
            return
        self.usage = responses_usage(response.get("usage"))
        if self.on_usage is not None:
            self.on_usage(self.usage)
        status = response.get("status")
        self.status = status if isinstance(status, str) else None
        if status in SERVED_STATUSES:
            self.finished = True
        elif status == "cancelled":  # stopped by the worker (a cancel, vLLM's abort): not a completion
            self.finished = self.aborted = True
        elif self.error is None:  # failed: its `error` object, if it has one
            err = response.get("error")
            self.error = err if isinstance(err, dict) else {"message": f"response {status}", "code": None}

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest


class ResponsesStreamSession(StreamSession):
    """A relayed Responses stream: `StreamSession` with `ResponsesRelay`, counting token events by type,
    and the gateway's error events in the Responses framing (no `[DONE]`). The response id is remembered
    with its worker as soon as `response.created` names it, so a `GET /v1/responses/{id}` or a cancel can
    reach it while it streams; its conversation size once the terminal event says it."""

    def _new_relay(self, parsed: ParsedRequest) -> SseRelay:
        d, model, worker_id = self.d, self.rec.model, self.lease.decision.decode.id

        def created(response_id: str) -> None:
            d.affinity.remember(response_id, worker_id, model, 0, d.clock())

        def ended(usage: dict[str, Any] | None) -> None:
            if relay.response_id is not None:
                d.affinity.update_tokens(relay.response_id, context_tokens(usage))

        relay = ResponsesRelay(created, ended)
        return relay  # type: ignore[return-value]  # SseRelay's interface (module docstring)

    def _token_events(self, out: bytes) -> int:
        relay: ResponsesRelay = self.relay  # type: ignore[assignment]
        tokens, relay.tokens = relay.tokens, 0
        return tokens

    def _error_event(self, message: str, status: int, err_type: str) -> bytes:
        relay: ResponsesRelay = self.relay  # type: ignore[assignment]
        return error_event(message, status, err_type, relay.events)

    def _cut_tail(self) -> bytes:
        """The body ended before a terminal event: after the worker's own error event nothing is added (vLLM
        ends a failed stream so); else the gateway's error event."""
        if self.relay.error is not None:
            return b""
        return self._error_event(
            "Upstream stream ended before it was complete (no terminal event).", 502, "BadGatewayError"
        )
