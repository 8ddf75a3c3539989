"""A minimal OpenAI-streaming ASGI app for the loadgen tests: records what it was sent, answers max_tokens tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


@dataclass
class FakeWorker:
    """Counts prompt tokens exactly (token-id lists) or as words (chat text); streams one chunk per token."""

    step_s: float = 0.0
    fail_every: int = 0  # every n-th request gets a 503 (0 = never)
    corrupt_gzip_every: int = 0  # every n-th request gets a 200 whose gzip body does not decode
    null_error: bool = False  # every chunk carries "error": null (as servers that serialise unset fields)
    refuse_status: int = 0  # every request gets this status with an OpenAI error (401: a wrong key)
    received: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await self._handle(await request.json(), chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await self._handle(await request.json(), chat=True)

        return app

    async def _handle(self, body: dict[str, Any], chat: bool) -> Any:
        self.received.append(body)
        if self.refuse_status:
            err = {
                "message": "Unauthorized",
                "type": "AuthenticationError",
                "param": None,
                "code": self.refuse_status,
            }
            return JSONResponse({"error": err}, status_code=self.refuse_status)
        if self.fail_every and len(self.received) % self.fail_every == 0:
            err = {"message": "overloaded", "type": "ServiceUnavailable", "param": None, "code": 503}
            return JSONResponse({"error": err}, status_code=503)
        if self.corrupt_gzip_every and len(self.received) % self.corrupt_gzip_every == 0:
            return Response(
                b"not gzip at all", headers={"content-encoding": "gzip"}, media_type="text/event-stream"
            )
        prompt = body["messages"][-1]["content"].split(" ") if chat else body["prompt"]
        n_out = int(body["max_tokens"])

        async def stream() -> AsyncIterator[bytes]:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                async for chunk in self._chunks(chat, n_out, len(prompt)):
                    yield chunk
            finally:
                self.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def _chunks(self, chat: bool, n_out: int, n_prompt: int) -> AsyncIterator[bytes]:
        for i in range(n_out):
            if self.step_s:
                await asyncio.sleep(self.step_s)
            choice = {"index": 0, "delta": {"content": f" w{i}"}} if chat else {"index": 0, "text": f" w{i}"}
            extra = {"error": None} if self.null_error else {}
            yield f"data: {json.dumps({'choices': [choice], **extra})}\n\n".encode()
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"
