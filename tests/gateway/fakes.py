"""Fake vLLM workers behind one `httpx.MockTransport`, for failure injection at the gateway's HTTP seam.

Each `FakeWorker` answers like vLLM's OpenAI server (bodies, SSE framing, include_usage, P/D
kv_transfer_params) for the host it is registered under, and can be told to misbehave: refuse
connections, answer a status, stall, or die mid-stream. Every request it sees is recorded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from server.config import validate_config


async def read_raw_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of the next HTTP/1.1 request on a raw connection (a Content-Length body, or none)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lengths = [
        line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    ]
    return head, await reader.readexactly(int(lengths[0]) if lengths else 0)


METRICS_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{model}"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.1
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="1000"}} 1.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="{model}"}} {generated}
"""


@dataclass
class FakeWorker:
    name: str
    model: str = "llama-3-8b"
    # ok | refuse | status | stall | die_mid_stream | no_kv_params | kv_params | pool_timeout | error_event |
    # error_mid_stream
    mode: str = "ok"
    error_code: int = 500  # the code of an error event (error_event, error_mid_stream)
    status: int = 503
    tokens: int = 4
    die_after: int = 2  # chunks sent before dying (die_mid_stream)
    chunk_delay_s: float = 0.0
    tail_delay_s: float = 0.0  # between the last token and the stream's end (usage event, [DONE])
    whole_delay_s: float = 0.0  # a whole (non-streaming) answer comes after this long
    seen: list[dict[str, Any]] = field(default_factory=list)
    raw_seen: list[bytes] = field(default_factory=list)
    headers_seen: list[dict[str, str]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    health_ok: bool = True
    aborted: int = 0  # streams the gateway closed before the end
    retry_after: str | None = None  # sent with a `status` answer
    usage: dict[str, Any] | None = None  # replaces the usage of whole (non-streaming) answers
    stream_usage: Any = None  # replaces the usage object of a stream's usage event (malformed ones)
    # chat streams open with vLLM's role event (`delta: {role, content: ""}`), this long before the first
    # token (vLLM: ~0, with it; None: no role event)
    role_lead_s: float | None = None
    generated: float = 0.0  # its /metrics' vllm:generation_tokens_total
    metrics_text: str | None = None  # its whole /metrics exposition, when not the one-engine default
    kv_params: Any = None  # a prefill answer's kv_transfer_params in mode kv_params, as given

    @property
    def url(self) -> str:
        return f"http://{self.name}:8000"

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.mode == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if self.mode == "pool_timeout" and path.endswith("/completions"):  # a transport's full pool
            raise httpx.PoolTimeout("no connection free", request=request)
        if path == "/health":
            return httpx.Response(200 if self.health_ok else 503)
        if path == "/metrics":
            text = self.metrics_text or METRICS_TEXT.format(
                model=self.model, running=0, generated=self.generated
            )
            return httpx.Response(200, text=text)
        body = json.loads(request.content)
        self.seen.append(body)
        self.raw_seen.append(request.content)
        self.headers_seen.append(dict(request.headers))
        self.paths.append(path)
        if self.mode == "status":
            err = {
                "error": {
                    "message": f"worker {self.name} says {self.status}",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": self.status,
                }
            }
            headers = {"retry-after": self.retry_after} if self.retry_after is not None else None
            return httpx.Response(self.status, json=err, headers=headers)
        if self.mode == "stall":
            await asyncio.sleep(3600)
        if path == "/tokenize":  # vLLM's answer shape; the ids say which worker answered
            return httpx.Response(200, json={"count": 1, "max_model_len": 8192, "tokens": [len(self.name)]})
        if path == "/detokenize":
            return httpx.Response(200, json={"prompt": self.name})
        chat = path.endswith("chat/completions")
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            return httpx.Response(200, json=self._prefill_answer(chat, body))
        n = body.get("max_completion_tokens") or body.get("max_tokens") or self.tokens
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream; charset=utf-8"},
                content=self._stream(chat, n, usage),
            )
        if self.whole_delay_s:
            await asyncio.sleep(self.whole_delay_s)
        return httpx.Response(200, json=self._whole(chat, n))

    def _prefill_answer(self, chat: bool, body: dict[str, Any]) -> dict[str, Any]:
        answer = self._whole(chat, 1)
        if self.mode == "kv_params":
            answer["kv_transfer_params"] = self.kv_params
        elif self.mode != "no_kv_params":
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"engine-{self.name}",
                "remote_block_ids": [1, 2, 3],
                "remote_host": self.name,
                "remote_port": 5600,
            }
        else:
            answer["kv_transfer_params"] = None
        return answer

    def _whole(self, chat: bool, n: int) -> dict[str, Any]:
        text = " ".join(f"w{i}" for i in range(n))
        choice = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return {
            "id": "chatcmpl-0123456789abcdef" if chat else "cmpl-0123456789abcdef",
            "object": "chat.completion" if chat else "text_completion",
            "model": self.model,
            "choices": [choice],
            "usage": self.usage
            if self.usage is not None
            else {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n},
        }

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat and self.role_lead_s is not None:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield b"data: " + json.dumps({"id": "x", "object": obj, "choices": [role]}).encode() + b"\n\n"
                await asyncio.sleep(self.role_lead_s)
            if self.mode == "error_event":  # vLLM's stream when generation fails before the first token
                yield self._error_event()
                yield b"data: [DONE]\n\n"
                return
            for i in range(n):
                if self.mode == "error_mid_stream" and i == self.die_after:
                    yield self._error_event()
                    yield b"data: [DONE]\n\n"
                    return
                if self.mode == "die_mid_stream" and i == self.die_after:
                    raise httpx.ReadError("connection reset by peer")
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                # vLLM's last token event carries the finish_reason; the others null
                choice = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
                choice |= {"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "}
                yield (
                    b"data: "
                    + json.dumps(
                        {"id": "x", "object": obj, "model": self.model, "choices": [choice]}
                    ).encode()
                    + b"\n\n"
                )
            if self.tail_delay_s:
                await asyncio.sleep(self.tail_delay_s)
            if usage:
                u = {
                    "id": "x",
                    "object": obj,
                    "model": self.model,
                    "choices": [],
                    "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
                    if self.stream_usage is None
                    else self.stream_usage,
                }
                yield b"data: " + json.dumps(u).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        except GeneratorExit:
            self.aborted += 1
            raise

    def _error_event(self) -> bytes:
        kind = "BadRequestError" if self.error_code < 500 else "InternalServerError"
        err = {"error": {"message": "engine died", "type": kind, "param": None, "code": self.error_code}}
        return b"data: " + json.dumps(err).encode() + b"\n\n"


class FakeFleet:
    """Workers by host name, served through one MockTransport."""

    def __init__(self, *workers: FakeWorker) -> None:
        self.workers = {w.name: w for w in workers}
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        worker = self.workers.get(request.url.host)
        if worker is None:
            raise httpx.ConnectError(f"no such host {request.url.host}", request=request)
        return await worker.handle(request)


def pool(name: str, gpu: str, role: str, *workers: FakeWorker, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model": "llama-3-8b",
        "gpu": gpu,
        "role": role,
        "endpoints": {"static": [w.url for w in workers]},
        **extra,
    }


def config(*pools: dict[str, Any], **sections: Any) -> Any:
    data = {"pools": list(pools), "health": {"interval_s": 60}, "scrape": {"interval_s": 60}, **sections}
    return validate_config(data, "test")


def pd_config(prefill: FakeWorker, decode: FakeWorker, **sections: Any) -> Any:
    """A P/D fleet of two pools: `prefill` (H100) hands its KV to `decode` (A100)."""
    return config(
        pool("prefill", "H100", "prefill", prefill), pool("decode", "A100", "decode", decode), **sections
    )
