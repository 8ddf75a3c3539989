"""One streaming OpenAI request, timed the way vLLM's `benchmark_serving` times it.

Timing (all `time.perf_counter()` seconds relative to the replay's start):
- `sent_s`: just before the POST is handed to httpx (the send-lag end point);
- `chunk_s`: arrival of every SSE chunk whose `choices` is non-empty (content chunks); usage-only and
  `[DONE]` chunks are not content;
- TTFT = chunk_s[0] − sent_s; E2EL = chunk_s[-1] − sent_s; ITLs = successive differences of chunk_s
  (a chunk may carry several tokens); output tokens from the `usage` chunk (`completion_tokens`), or the
  number of content chunks when the server sends no usage.

Embeddings (`/v1/embeddings`, a whole JSON answer): the answer's arrival is its one content chunk, so
TTFT = E2EL = its latency (vLLM's own TTFT of a pooling request is its end too), no ITL or TPOT, no output
tokens; `usage.prompt_tokens` as for completions.

A request fails (and is excluded from latency statistics, as in vLLM) with one error type:
`connect_error`, `timeout` (whole request longer than the per-request timeout), `http_<status>`,
`stream_error` (an `{"error": ...}` event in the stream), `no_content` (stream ended without a content
chunk), `read_error` (connection lost mid-stream), `bad_chunk` (a chunk that is not JSON),
`transport_error` (any other transport failure: a write error, an unsupported protocol, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

Clock = Callable[[], float]

ENDPOINT_PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "embeddings": "/v1/embeddings",
    "rerank": "/rerank",  # vLLM's path (also /v1/rerank, /v2/rerank)
}
WHOLE_ENDPOINTS = frozenset({"embeddings", "rerank"})  # answered whole, not streamed


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request; times are seconds since the replay start."""

    index: int
    scheduled_s: float
    input_tokens: int
    expected_output_tokens: int
    slot_s: float = 0.0  # when a concurrency slot was free (= scheduled_s without a concurrency limit)
    sent_s: float = 0.0
    chunk_s: array = field(default_factory=lambda: array("d"))  # arrival of each content chunk
    output_tokens: int = 0
    usage_prompt_tokens: int | None = None
    success: bool = False
    error_type: str | None = None
    error: str | None = None
    end_s: float = 0.0  # when the request finished (success or failure)
    trace_line: int = 0  # the request's line in the trace file
    model: str = ""  # the body's `model`: the base model, or a LoRA adapter (`--lora-modules`)

    @property
    def send_lag_s(self) -> float:
        """Actual send − the later of (scheduled time, free concurrency slot): the generator's own delay."""
        return self.sent_s - max(self.scheduled_s, self.slot_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.success and self.chunk_s else None

    @property
    def e2el_s(self) -> float | None:
        return self.chunk_s[-1] - self.sent_s if self.success and self.chunk_s else None

    @property
    def tpot_s(self) -> float | None:
        """(E2EL − TTFT) / (output_tokens − 1); None when fewer than 2 output tokens (vLLM skips those)."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)

    def itls_s(self) -> list[float]:
        c = self.chunk_s
        return [c[i] - c[i - 1] for i in range(1, len(c))] if self.success else []


class _Fail(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _consume(rec: RequestRecord, data: str, now: float) -> bool:
    """Handle one SSE `data:` payload; True at `[DONE]`."""
    if data == "[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError, or nesting too deep to decode
        raise _Fail("bad_chunk", f"chunk is not JSON: {data[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise _Fail("bad_chunk", f"chunk is not an object: {data[:80]!r}")
    if chunk.get("error"):  # some servers serialise an unset error as null on every chunk
        err = chunk["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise _Fail("stream_error", str(msg)[:300])
    if chunk.get("choices"):
        rec.chunk_s.append(now)
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            rec.output_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            rec.usage_prompt_tokens = usage["prompt_tokens"]
    return False


@contextlib.contextmanager
def _http_errors() -> Iterator[None]:
    """httpx's failures of one request as its recorded error type (module docstring)."""
    try:
        yield
    except httpx.ConnectError as e:
        raise _Fail("connect_error", str(e) or type(e).__name__) from None
    except httpx.TimeoutException as e:
        raise _Fail("timeout", str(e) or type(e).__name__) from None
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        raise _Fail("read_error", str(e) or type(e).__name__) from None
    except httpx.TransportError as e:  # write errors, unsupported protocol, proxy errors, ...
        raise _Fail("transport_error", f"{type(e).__name__}: {e}") from None
    except httpx.DecodingError as e:  # e.g. a corrupt gzip body: this request fails, not the replay
        raise _Fail("decode_error", str(e) or type(e).__name__) from None
    except httpx.HTTPError as e:  # any other request error of httpx's is this request's outcome too
        raise _Fail("client_error", f"{type(e).__name__}: {e}") from None


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    rec: RequestRecord,
    since: Clock,
) -> None:
    with _http_errors():
        async with client.stream("POST", url, content=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise _Fail(f"http_{resp.status_code}", _error_message(text))
            done = False
            # Read to the end of the body even after [DONE]: a connection whose response was not drained
            # cannot go back to the pool, and a new TCP connection per request costs the sender ~1 ms.
            async for line in resp.aiter_lines():
                if not done and line.startswith("data:"):
                    done = _consume(rec, line[5:].strip(), since())


async def _whole(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    rec: RequestRecord,
    since: Clock,
) -> None:
    """A whole JSON answer (embeddings, rerank): its arrival is the one content chunk when it holds `data`
    (vectors) or `results` (ranked documents)."""
    with _http_errors():
        resp = await client.post(url, content=body, headers=headers)
    now = since()
    if resp.status_code != 200:
        raise _Fail(f"http_{resp.status_code}", _error_message(resp.text))
    try:
        answer = json.loads(resp.content)
    except (ValueError, RecursionError):
        raise _Fail("bad_chunk", f"answer is not JSON: {resp.content[:80]!r}") from None
    if not isinstance(answer, dict):
        raise _Fail("bad_chunk", f"answer is not an object: {resp.content[:80]!r}")
    if answer.get("data") or answer.get("results"):
        rec.chunk_s.append(now)
    usage = answer.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        rec.usage_prompt_tokens = usage["prompt_tokens"]


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    except (json.JSONDecodeError, AttributeError):
        pass
    return text[:300]


def one_line(text: str, limit: int = 200) -> str:
    """An error message from a server or a library, fit for the CLI's one-line error."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    rec: RequestRecord,
    origin: float,
    timeout_s: float | None,
    clock: Clock = time.perf_counter,
    whole: bool = False,
) -> RequestRecord:
    """Send one request and fill `rec`; never raises for server or network failures (they are recorded).

    Times are `clock() − origin`; tests inject a clock to get exact chunk timings. `whole`: the answer is
    one JSON object, not a stream (embeddings).
    """

    def since() -> float:
        return clock() - origin

    rec.sent_s = since()
    try:
        async with asyncio.timeout(timeout_s):
            await (_whole if whole else _stream)(client, url, body, headers, rec, since)
        if not rec.chunk_s:
            raise _Fail(
                "no_content",
                "the answer held no content" if whole else "the stream ended without a content chunk",
            )
        if rec.output_tokens == 0 and not whole:
            rec.output_tokens = len(rec.chunk_s)  # no usage chunk: one token per content chunk
        rec.success = True
    except _Fail as f:
        rec.error_type, rec.error = f.kind, str(f)
    except TimeoutError:
        rec.error_type, rec.error = "timeout", f"no complete response within {timeout_s} s"
    rec.end_s = since()
    return rec
