"""`health.sever_silent_requests`: a worker that fails its health checks has the gateway's connections to it that
got no byte for failure_threshold × interval_s closed, so requests on a worker gone without closing them (a lost
node, a partition, a frozen process) end at once instead of at their first-token or stall timeouts. Scripted
workers over real sockets: the pooled upstream client is what severs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from server.runner import RunningGateway, start_gateway_server
from tests.gateway.fakes import config, pool
from tests.gateway.scripted_http import EMPTY_200, SSE_HEAD, chunk, read_request
from tests.gateway.test_faults import CHAT, RR, metric, sse_events

# Checks every 0.2 s, 0.2 s each, 2 failures in a row → unhealthy; silent for 0.4 s → severed (a tighter
# timeout failed healthy workers' checks on a loaded 2-core machine)
HEALTH = {"interval_s": 0.2, "timeout_s": 0.2, "failure_threshold": 2}
WHOLE_BODY = b'{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}'


def _token(content: str, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}
    return b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode() + b"\n\n"


class ScriptedWorker:
    """A worker on a real socket. `freeze_on_chat`: the first chat request freezes it: from then on it answers
    nothing on any connection (health checks included) and closes none, as a lost node or a stopped process;
    before that, a stream's first `tokens_before_freeze` tokens are sent. `failing_health`: /health answers 503
    while it streams `stream_tokens` tokens 0.05 s apart (an overloaded but working worker)."""

    def __init__(
        self,
        freeze_on_chat: bool = False,
        tokens_before_freeze: int = 0,
        failing_health: bool = False,
        stream_tokens: int = 2,
        whole_delay_s: float = 0.0,
        metrics_progress: bool = False,
        prefix: str = "",
    ) -> None:
        self.freeze_on_chat = freeze_on_chat
        self.tokens_before_freeze = tokens_before_freeze
        self.failing_health = failing_health
        self.stream_tokens = stream_tokens
        self.whole_delay_s = whole_delay_s  # a whole answer comes this long after the request
        self.metrics_progress = metrics_progress  # /metrics shows vllm:generation_tokens_total growing
        self.prefix = prefix  # the path the worker's URL ends with (workers sharing one host:port)
        self.generated = 0
        self.frozen = False
        self.chats = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                path, body = await read_request(reader)
                await self.answer(path.removeprefix(self.prefix.encode()), body, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def answer(self, path: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        """Answer one request (its path without the worker's prefix)."""
        if self.frozen:
            await asyncio.sleep(3600)  # never answers; the gateway's abort ends this
        if path == b"/health" and self.failing_health:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            return
        if path == b"/metrics" and self.metrics_progress:
            self.generated += 10
            text = f'vllm:generation_tokens_total{{model_name="llama-3-8b"}} {self.generated}\n'.encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(text), text))
            return
        if path != CHAT.encode():
            writer.write(EMPTY_200)
            return
        self.chats += 1
        stream = bool(json.loads(body).get("stream"))
        if self.freeze_on_chat:
            if stream:
                writer.write(SSE_HEAD)
                for i in range(self.tokens_before_freeze):
                    writer.write(chunk(_token(f"t{i} ")))
                await writer.drain()
            self.frozen = True
            await asyncio.sleep(3600)
        if not stream:
            await asyncio.sleep(self.whole_delay_s)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                % (len(WHOLE_BODY), WHOLE_BODY)
            )
            return
        writer.write(SSE_HEAD)
        for i in range(self.stream_tokens):
            last = i == self.stream_tokens - 1
            writer.write(chunk(_token(f"t{i} ", "length" if last else None)))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


@asynccontextmanager
async def fleet(
    *workers: ScriptedWorker,
    sever: bool = True,
    scrape_s: float = 60,
    health: dict[str, Any] | None = None,
    **limits: float,
) -> AsyncIterator[tuple[httpx.AsyncClient, RunningGateway]]:
    for w in workers:
        await w.start()
    addresses = [SimpleNamespace(url=w.url) for w in workers]  # what `pool` reads of a worker
    cfg = config(
        pool("p", "H100", "mixed", *addresses),  # type: ignore[arg-type]
        health={**HEALTH, "sever_silent_requests": sever, **(health or {})},
        scrape={"interval_s": scrape_s},
        limits={"first_token_timeout_s": 20, "stall_timeout_s": 20, "total_timeout_s": 30, **limits},
        **RR,
    )
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    try:
        deadline = time.monotonic() + 5
        while sum(r.health_ok is True for r in running.gateway.registry.records()) < len(workers):
            assert time.monotonic() < deadline, "workers never checked healthy"
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            yield client, running
    finally:
        await running.stop()
        for w in workers:
            w.close()


def _chat(stream: bool) -> dict[str, Any]:
    return {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_on_a_worker_that_froze_is_retried_elsewhere_once_it_is_unhealthy(stream: bool) -> None:
    """Two requests at once, round robin: the one sent to the worker that freezes (nothing answered, no
    connection closed) is served by the other worker within about a second — before, it waited its whole
    first-token (or total) timeout, 20 s here, and only then was retried."""

    async def body() -> None:
        frozen, healthy = ScriptedWorker(freeze_on_chat=True), ScriptedWorker()
        async with fleet(frozen, healthy) as (client, running):
            started = time.monotonic()
            answers = await asyncio.gather(*(client.post(CHAT, json=_chat(stream)) for _ in range(2)))
            took = time.monotonic() - started
            assert [a.status_code for a in answers] == [200, 200]
            assert took < 3, took
            assert (frozen.chats, healthy.chats) == (1, 2)
            gw = running.gateway
            assert gw.dispatcher.outcomes == {"completed": 2}
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="unhealthy") == 1

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.parametrize("sever", [True, False], ids=["severed", "off"])
def test_a_stream_whose_worker_froze_mid_way_ends_with_an_error_event(sever: bool) -> None:
    """Two tokens relayed, then the worker freezes: the stream ends with the gateway's error event and
    `[DONE]` once the worker is unhealthy (about 1 s here); with `sever_silent_requests: false` only at the
    stall timeout (3 s here)."""

    async def body() -> None:
        frozen = ScriptedWorker(freeze_on_chat=True, tokens_before_freeze=2)
        async with fleet(frozen, sever=sever, stall_timeout_s=3) as (client, running):
            started = time.monotonic()
            answer = await client.post(CHAT, json=_chat(True))
            took = time.monotonic() - started
            events = sse_events(answer.text)
            assert answer.status_code == 200 and events[-1] == "[DONE]" and len(events) == 4
            error = json.loads(events[2])["error"]
            assert error["type"] == "BadGatewayError"
            if sever:
                assert took < 2.5, took
                assert "(unhealthy)" in error["message"]
            else:
                assert took >= 2.9, took
                assert "(timeout)" in error["message"]
            assert running.gateway.dispatcher.outcomes == {"worker_error": 1}

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_stream_still_receiving_tokens_is_not_cut_while_its_worker_fails_health_checks() -> None:
    """The worker answers /health 503 (unhealthy after ~0.4 s) but streams a token every 0.05 s for 1.5 s:
    its connection is never silent for the window, so the stream completes."""

    async def body() -> None:
        busy = ScriptedWorker()
        async with fleet(busy) as (client, running):
            busy.failing_health, busy.stream_tokens = True, 30
            answer = await client.post(CHAT, json=_chat(True))
            events = sse_events(answer.text)
            assert len(events) == 31 and events[-1] == "[DONE]"
            assert "error" not in answer.text
            assert running.gateway.registry.records()[0].health_ok is False  # it was unhealthy meanwhile
            assert running.gateway.dispatcher.outcomes == {"completed": 1}

    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.mark.parametrize("progress", [True, False], ids=["engine works", "no sign of it"])
def test_a_whole_answer_is_cut_only_when_no_scrape_shows_the_engine_working(progress: bool) -> None:
    """A whole answer sends nothing until it is done: on a worker whose /health fails (slow under load, say)
    but whose scrapes show its token counters moving, it is left to finish; with no such sign it is cut
    once the worker is unhealthy (the only worker here: 502)."""

    async def body() -> None:
        busy = ScriptedWorker(whole_delay_s=2.5, metrics_progress=progress)
        async with fleet(busy, scrape_s=0.05) as (client, running):
            busy.failing_health = True
            started = time.monotonic()
            answer = await client.post(CHAT, json=_chat(False))
            took = time.monotonic() - started
            if progress:
                assert answer.status_code == 200 and took >= 2.4, (answer.text, took)
                assert running.gateway.dispatcher.outcomes == {"completed": 1}
            else:
                assert answer.status_code == 502 and "(unhealthy)" in answer.text and took < 2.4, took
                assert running.gateway.dispatcher.outcomes == {"failed_before_first_byte": 1}

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_healthy_worker_sharing_the_unhealthy_ones_host_and_port_keeps_its_requests() -> None:
    """Two pools behind one address, told apart by path (`http://h:p/a`, `http://h:p/b`): the pooled
    connections are per host:port, so severing for the unhealthy `a` would cut `b`'s requests too. Not while
    another worker there is not unhealthy."""

    async def body() -> None:
        a = ScriptedWorker(failing_health=True, prefix="/a")
        b = ScriptedWorker(whole_delay_s=1.5, prefix="/b")

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    path, payload = await read_request(reader)
                    worker = a if path.startswith(b"/a/") else b
                    await worker.answer(path.removeprefix(worker.prefix.encode()), payload, writer)
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        cfg = config(
            pool("pa", "H100", "mixed", SimpleNamespace(url=base + "/a")),  # type: ignore[arg-type]
            pool("pb", "H100", "mixed", SimpleNamespace(url=base + "/b")),  # type: ignore[arg-type]
            health=HEALTH,
            limits={"first_token_timeout_s": 20, "total_timeout_s": 30},
        )
        running = await start_gateway_server(cfg, "127.0.0.1", 0)
        try:
            registry = running.gateway.registry
            deadline = time.monotonic() + 5
            while {r.pool.name: r.health_ok for r in registry.records()} != {"pa": False, "pb": True}:
                assert time.monotonic() < deadline, "a never unhealthy, b never healthy"
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
                answer = await client.post(CHAT, json=_chat(False))
            assert answer.status_code == 200, answer.text
            assert (a.chats, b.chats) == (0, 1)
            assert running.gateway.dispatcher.outcomes == {"completed": 1}
        finally:
            await running.stop()
            server.close()

    asyncio.run(asyncio.wait_for(body(), 30))
