"""`RelayResponse` ended by the gateway's shutdown (`Dispatcher.stop_requests` cancels its task): the client
gets a complete answer whichever await the cancel lands in. Driven with a hand-made ASGI `send`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from server.errors import STREAM_DONE
from server.failure import RelayResponse

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def _events() -> AsyncIterator[bytes]:
    yield b'data: {"choices": []}\n\n'
    await asyncio.Event().wait()  # the worker goes quiet: the stream is still open at shutdown
    yield b""


def _relay(closed: list[bool]) -> RelayResponse:
    async def on_close() -> None:
        closed.append(True)

    return RelayResponse(
        _events(), on_close, [(b"content-type", b"text/event-stream")], stopped=lambda _: True
    )


def test_a_cancel_while_the_start_waits_for_the_socket_answers_a_whole_503() -> None:
    """The cancel landed in the start message's drain (a client not reading): no start had gone out, and a
    body message alone was refused by the HTTP cycle (a 500). Now the whole answer is the 503."""
    sent: list[dict[str, Any]] = []
    closed: list[bool] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and not sent:
            sent.append({"blocked": message["status"]})
            await asyncio.Event().wait()  # waits for the socket to drain
        sent.append(message)

    async def go() -> None:
        task = asyncio.create_task(_relay(closed)(SCOPE, _never_disconnects, send))
        await asyncio.sleep(0.01)
        task.cancel()
        await task  # ends normally: the cancel is the shutdown's, answered

    asyncio.run(go())
    assert sent[0] == {"blocked": 200}
    assert sent[1]["type"] == "http.response.start" and sent[1]["status"] == 503
    assert (b"retry-after", b"1") in sent[1]["headers"]
    assert json.loads(sent[2]["body"])["error"]["type"] == "ServiceUnavailableError"
    assert closed == [True]


def test_a_cancel_mid_stream_ends_it_with_an_error_event_and_done() -> None:
    sent: list[dict[str, Any]] = []
    closed: list[bool] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> None:
        task = asyncio.create_task(_relay(closed)(SCOPE, _never_disconnects, send))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    asyncio.run(go())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    last = sent[-1]
    assert last["more_body"] is False and last["body"].endswith(STREAM_DONE)
    assert json.loads(last["body"].split(b"\n\n")[0].removeprefix(b"data: "))["error"]["code"] == 503
    assert closed == [True]
