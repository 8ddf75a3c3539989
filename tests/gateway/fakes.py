"""Fake vLLM workers behind one `httpx.MockTransport`, for failure injection at the gateway's HTTP seam.

Each `FakeWorker` answers like vLLM's OpenAI server (bodies, SSE framing, include_usage, P/D
kv_transfer_params; `/v1/responses` with vLLM 0.32's event framing, its objects taken from a real server's
answers in `fixtures/vllm_responses_*`, and its stored responses) for the host it is registered under, and can be told to misbehave: refuse
connections, answer a status, stall, or die mid-stream. Every request it sees is recorded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server.config import validate_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# A real vLLM 0.32 server's answers to `POST /v1/responses` (tiny model): a whole one and a stream
RESPONSES_WHOLE: dict[str, Any] = json.loads((FIXTURES / "vllm_responses_whole.json").read_text())
RESPONSES_STREAM: list[tuple[str, dict[str, Any]]] = [
    (event.split("\n")[0].removeprefix("event: "), json.loads(event.split("\n")[1].removeprefix("data: ")))
    for event in (FIXTURES / "vllm_responses_stream.sse").read_text().split("\n\n")
    if event
]


def responses_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One event as vLLM frames it: `event: <type>`, then the JSON compact (pydantic's model_dump_json)."""
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


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
    # /v1/responses: what it stored (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1), by response id; a
    # stream's terminal event (response.completed; "" ends the body without one); the `status` it reports
    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    responses_terminal: str = "response.completed"
    responses_status: str = "incomplete"
    # LoRA adapters its /v1/models lists (name → path), as vLLM's --lora-modules; models_status: that
    # route's status (vLLM's --api-key guards it: 401)
    adapters: dict[str, str] = field(default_factory=dict)
    models_status: int = 200
    models_seen: list[dict[str, str]] = field(default_factory=list)  # headers of each /v1/models GET
    # vLLM's run-time updating (VLLM_ALLOW_RUNTIME_LORA_UPDATING): /v1/load_lora_adapter and
    # /v1/unload_lora_adapter as vLLM 0.32 answers them; lora_refusal: (status, message) every load gets
    # instead (a path it cannot find, a rank too high); lora_calls: (path, body, headers) of each call
    lora_runtime: bool = False
    lora_refusal: tuple[int, str] | None = None
    lora_calls: list[tuple[str, dict[str, Any], dict[str, str]]] = field(default_factory=list)
    lora_gate: asyncio.Event | None = None  # set: each load waits for it (a slow load from the Hub)
    lora_loading: int = 0  # loads waiting at the gate now

    @property
    def url(self) -> str:
        return f"http://{self.name}:8000"

    def _lora_runtime(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        """vLLM 0.32's `OpenAIServingModels.load_lora_adapter` / `unload_lora_adapter` answers."""
        self.lora_calls.append((path, body, headers))
        name = body.get("lora_name")

        def refuse(status: int, message: str, err_type: str) -> httpx.Response:
            error = {"message": message, "type": err_type, "param": None, "code": status}
            return httpx.Response(status, json={"error": error})

        if path == "/v1/unload_lora_adapter":
            if name not in self.adapters:
                return refuse(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del self.adapters[name]
            return httpx.Response(
                200, content=f"Success: LoRA adapter '{name}' removed successfully.".encode()
            )
        if not body.get("load_inplace") and name in self.adapters:
            return refuse(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if self.lora_refusal is not None:
            return refuse(
                *self.lora_refusal, "NotFoundError" if self.lora_refusal[0] == 404 else "BadRequestError"
            )
        self.adapters[name] = body["lora_path"]
        return httpx.Response(200, content=f"Success: LoRA adapter '{name}' added successfully.".encode())

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if self.mode == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if self.mode == "pool_timeout" and path.endswith("/completions"):  # a transport's full pool
            raise httpx.PoolTimeout("no connection free", request=request)
        if path == "/health":
            return httpx.Response(200 if self.health_ok else 503)
        if path == "/v1/models":
            self.models_seen.append(dict(request.headers))
            base = {"id": self.model, "object": "model", "root": self.model, "parent": None}
            cards = [base] + [
                {"id": name, "object": "model", "root": root, "parent": self.model}
                for name, root in self.adapters.items()
            ]
            return httpx.Response(self.models_status, json={"object": "list", "data": cards})
        if path == "/metrics":
            text = self.metrics_text or METRICS_TEXT.format(
                model=self.model, running=0, generated=self.generated
            )
            return httpx.Response(200, text=text)
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            if self.lora_runtime:
                if self.lora_gate is not None and path == "/v1/load_lora_adapter":
                    self.lora_loading += 1
                    try:
                        await self.lora_gate.wait()
                    finally:
                        self.lora_loading -= 1
                return self._lora_runtime(path, json.loads(request.content), dict(request.headers))
            # vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING attaches no such route: FastAPI's 404
            self.lora_calls.append((path, json.loads(request.content), dict(request.headers)))
            return httpx.Response(404, json={"detail": "Not Found"})
        if path.startswith("/v1/responses/"):
            self.paths.append(f"{request.method} {path}")
            return self._stored_response(request.method, path.removeprefix("/v1/responses/"))
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
        if path == "/v1/responses":
            return await self._responses(body)
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

    # ------------------------------------------------------------------ /v1/responses
    async def _responses(self, body: dict[str, Any]) -> httpx.Response:
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            return _not_found(previous)
        n = body.get("max_output_tokens") or self.tokens
        rid = f"resp_{self.name}_{len(self.seen)}"
        text = " ".join(f"w{i}" for i in range(n))
        whole = self._response_object(rid, body, text, n)
        if body.get("store", True):
            self.stored[rid] = whole
        if body.get("stream"):
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream; charset=utf-8"},
                content=self._responses_stream(rid, body, n, whole),
            )
        if self.whole_delay_s:
            await asyncio.sleep(self.whole_delay_s)
        return httpx.Response(200, json=whole)

    def _response_object(self, rid: str, body: dict[str, Any], text: str, n: int) -> dict[str, Any]:
        """vLLM's `response` object (the real one's fields), with this request's id, text and usage."""
        out = json.loads(json.dumps(RESPONSES_WHOLE))
        out.update(
            id=rid,
            model=self.model,
            status=self.responses_status,
            max_output_tokens=body.get("max_output_tokens"),
            previous_response_id=body.get("previous_response_id"),
        )
        out["output"][0]["content"][0]["text"] = text
        usage = (
            self.usage if self.usage is not None else {**out["usage"], "input_tokens": 7, "output_tokens": n}
        )
        out["usage"] = {**usage, "total_tokens": 7 + n} if self.usage is None else usage
        return out

    async def _responses_stream(
        self, rid: str, body: dict[str, Any], n: int, whole: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        """The real stream's events (`RESPONSES_STREAM`) with this response's id and n text deltas."""
        by_kind = {kind: payload for kind, payload in RESPONSES_STREAM}
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            base = by_kind.get(kind, by_kind["response.completed"])  # (response.incomplete/failed: its shape)
            payload = {**json.loads(json.dumps(base)), **fields, "sequence_number": seq}
            seq += 1
            return responses_event(kind, payload)

        opening = {**by_kind["response.created"]["response"], "id": rid, "model": self.model}
        try:
            yield event("response.created", response=opening)
            yield event("response.in_progress", response=opening)
            yield event("response.output_item.added")
            yield event("response.content_part.added")
            for i in range(n):
                if self.mode == "die_mid_stream" and i == self.die_after:
                    raise httpx.ReadError("connection reset by peer")
                if self.mode == "error_mid_stream" and i == self.die_after:
                    code = str(self.error_code)
                    yield responses_event(
                        "error",
                        {
                            "type": "error",
                            "code": code,
                            "message": "engine died",
                            "param": None,
                            "sequence_number": seq,
                        },
                    )
                    return
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                yield event("response.output_text.delta", delta=f"w{i} ")
            if self.tail_delay_s:
                await asyncio.sleep(self.tail_delay_s)
            yield event("response.output_text.done", text=whole["output"][0]["content"][0]["text"])
            yield event("response.content_part.done")
            yield event("response.output_item.done")
            if self.responses_terminal:
                yield event(self.responses_terminal, type=self.responses_terminal, response=whole)
        except GeneratorExit:
            self.aborted += 1
            raise

    def _stored_response(self, method: str, rest: str) -> httpx.Response:
        rid, _, action = rest.partition("/")
        if rid not in self.stored:
            return _not_found(rid)
        if method == "POST" and action == "cancel":  # vLLM's answer for a response that was not background
            err = {"message": "Cannot cancel a synchronous response.", "type": "invalid_request_error"}
            return httpx.Response(400, json={"error": {**err, "param": "response_id", "code": 400}})
        return httpx.Response(200, json=self.stored[rid])

    def _error_event(self) -> bytes:
        kind = "BadRequestError" if self.error_code < 500 else "InternalServerError"
        err = {"error": {"message": "engine died", "type": kind, "param": None, "code": self.error_code}}
        return b"data: " + json.dumps(err).encode() + b"\n\n"


def _not_found(response_id: str) -> httpx.Response:
    """vLLM's answer for a response id it does not store."""
    err = {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error"}
    return httpx.Response(404, json={"error": {**err, "param": "response_id", "code": 404}})


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
