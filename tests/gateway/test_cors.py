"""Cross-origin requests (`cors:`, vLLM's `--allowed-origins` and friends, same defaults: off, as vLLM 0.32):
with origins allowed the preflight is answered, a browser's POST and GET get `Access-Control-Allow-Origin`,
restricted origins are mirrored or refused, and requests without an `Origin` are answered as before (on the
fast cycle, a stream still pushed).
Raw HTTP/1.1 over real sockets to `start_gateway_server`, workers faked at the transport."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.config import ConfigError, CorsConfig, validate_config
from server.responses import StreamSession
from server.runner import start_gateway_server
from tests.gateway.fakes import FakeWorker
from tests.gateway.test_fast_http import (
    FAST,
    completion,
    exchange,
    request,
    run,
    runner_config,
    serving,
)

ORIGIN = b"Origin: https://chat.example"


def preflight(path: bytes, origin: bytes = ORIGIN) -> bytes:
    return (
        b"\r\n".join(
            [
                b"OPTIONS " + path + b" HTTP/1.1",
                b"Host: gw",
                origin,
                b"Access-Control-Request-Method: POST",
                b"Access-Control-Request-Headers: authorization, content-type",
                b"X-Request-Id: pre-1",
            ]
        )
        + b"\r\n\r\n"
    )


def headers_of(head: bytes) -> dict[bytes, bytes]:
    lines = head.split(b"\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines if ln)}


ANY = {"allowed_origins": ["*"]}


def test_any_origin_when_allowed() -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok"), cors=ANY) as running:
            ((head, body),) = await exchange(running, preflight(b"/v1/chat/completions"))
            h = headers_of(head)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert h[b"access-control-allow-origin"] == b"*"
            assert b"POST" in h[b"access-control-allow-methods"].split(b", ")
            assert h[b"access-control-allow-headers"] == b"authorization, content-type"  # echoed: "*"
            assert h[b"x-request-id"] == b"pre-1"  # the preflight passes the request id's middleware
            assert b"access-control-allow-credentials" not in h

            for stream in (False, True):  # the proxy endpoint on the fast cycle, with an Origin
                ((head, body),) = await exchange(running, request(FAST, completion(stream=stream), ORIGIN))
                h = headers_of(head)
                assert head.startswith(b"HTTP/1.1 200") and h[b"access-control-allow-origin"] == b"*"
                assert h[b"x-request-id"] == b"fixed-id"
                if stream:
                    assert body.endswith(b"data: [DONE]\n\n")
                else:
                    assert json.loads(body)["choices"][0]["text"]

            get = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n" + ORIGIN + b"\r\n\r\n"
            ((head, body),) = await exchange(running, get)
            assert headers_of(head)[b"access-control-allow-origin"] == b"*"
            assert json.loads(body)["data"][0]["id"] == "llama-3-8b"

    run(go)


def test_an_error_answer_to_a_browser_carries_the_cors_header_so_it_can_read_the_error() -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok"), auth={"api_keys": ["k1"]}, cors=ANY) as running:
            ((head, body),) = await exchange(running, request(FAST, completion(), ORIGIN))
            assert head.startswith(b"HTTP/1.1 401")
            assert headers_of(head)[b"access-control-allow-origin"] == b"*"
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
            # the preflight itself needs no key: browsers send none with it
            ((head, _),) = await exchange(running, preflight(b"/v1/completions"))
            assert head.startswith(b"HTTP/1.1 200")

    run(go)


def test_without_an_origin_the_answer_has_no_cors_headers() -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok"), cors=ANY) as running:
            for raw in (
                request(FAST, completion()),
                request(FAST, completion(stream=True)),
                b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n",
            ):
                ((head, _),) = await exchange(running, raw)
                assert head.startswith(b"HTTP/1.1 200")
                h = headers_of(head)
                assert not any(k.startswith(b"access-control-") for k in h)
                # the proxy paths skip the middleware without an Origin (byte for byte as before); the
                # other routes go through it, and Starlette's middleware adds Vary: Origin to every answer
                assert (b"vary" in h) == raw.startswith(b"GET ")

    run(go)


def test_restricted_origins_are_mirrored_and_others_refused() -> None:
    allowed = b"Origin: https://app.example"
    other = b"Origin: https://evil.example"
    cors = {"allowed_origins": ["https://app.example"], "allow_credentials": True}

    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok"), cors=cors) as running:
            ((head, _),) = await exchange(running, preflight(b"/v1/chat/completions", allowed))
            h = headers_of(head)
            assert head.startswith(b"HTTP/1.1 200")
            assert h[b"access-control-allow-origin"] == b"https://app.example"
            assert h[b"access-control-allow-credentials"] == b"true"
            ((head, body),) = await exchange(running, preflight(b"/v1/chat/completions", other))
            assert head.startswith(b"HTTP/1.1 400") and b"Disallowed CORS origin" in body

            ((head, _),) = await exchange(running, request(FAST, completion(), allowed))
            h = headers_of(head)
            assert h[b"access-control-allow-origin"] == b"https://app.example"
            assert b"Origin" in h[b"vary"]
            ((head, _),) = await exchange(running, request(FAST, completion(), other))
            assert head.startswith(b"HTTP/1.1 200")  # answered (CORS is the browser's check) …
            assert b"access-control-allow-origin" not in headers_of(head)  # … which then refuses it

    run(go)


@pytest.mark.parametrize("cors", [None, {"allowed_origins": []}], ids=["default (vLLM 0.32: off)", "[]"])
def test_no_origins_turns_cors_off(cors: dict[str, Any] | None) -> None:
    async def go() -> None:
        async with serving(FakeWorker("a", mode="ok"), **({"cors": cors} if cors else {})) as running:
            ((head, _),) = await exchange(running, preflight(b"/v1/chat/completions"))
            assert head.startswith(b"HTTP/1.1 405")
            ((head, _),) = await exchange(running, request(FAST, completion(), ORIGIN))
            assert head.startswith(b"HTTP/1.1 200")
            assert b"access-control-allow-origin" not in headers_of(head)

    run(go)


def test_a_pooled_stream_is_still_pushed_without_an_origin_and_relayed_whole_with_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With CORS on, a request without an Origin keeps the fast cycle's `send`, so its stream is written from
    the worker's reads; a browser's gets the middleware's `send` and the iterated relay."""
    pushed: list[int] = []
    original = StreamSession.push

    async def counting_push(self: StreamSession, cycle: Any) -> bytes:
        pushed.append(1)
        return await original(self, cycle)

    monkeypatch.setattr(StreamSession, "push", counting_push)

    async def go() -> None:
        cfg = runner_config(time_scale=50).model_copy(update={"cors": CorsConfig(allowed_origins=["*"])})
        running = await start_gateway_server(cfg, "127.0.0.1", 0)
        try:
            body = completion(stream=True, max_tokens=12)
            ((_, plain),) = await exchange(running, request(FAST, body))
            assert len(pushed) == 1
            ((head, browser),) = await exchange(running, request(FAST, body, ORIGIN))
            assert len(pushed) == 1 and headers_of(head)[b"access-control-allow-origin"] == b"*"
            for answer in (plain, browser):
                events = [e for e in answer.split(b"\n\n") if e]
                assert len(events) == 13 and events[-1] == b"data: [DONE]"
            assert running.gateway.dispatcher.outcomes == {"completed": 2}
        finally:
            await running.stop()

    run(go)


@pytest.mark.parametrize(
    ("cors", "field"),
    [
        ({"allowed_origins": "*"}, "cors.allowed_origins"),
        ({"allow_credentials": "maybe"}, "cors.allow_credentials"),
        ({"allowed_origin": ["*"]}, "cors.allowed_origin"),
    ],
)
def test_a_bad_cors_section_is_refused_naming_the_field(cors: dict[str, Any], field: str) -> None:
    data = {"pools": [{"name": "p", "model": "m", "gpu": "L4", "endpoints": {"static": ["http://x"]}}]}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_config({**data, "cors": cors}, "test")
