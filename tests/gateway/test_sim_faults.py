"""Faults with real simulated workers over real sockets: a worker killed before dispatch and mid-stream,
client disconnects (streaming and not), and graceful shutdown draining a stream. Each test checks that
every request ended in one terminal outcome and no in-flight load is left behind."""

from __future__ import annotations

import asyncio
import collections.abc
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from server.config import validate_config
from server.embedded import SimulatedPoolSource
from tests.gateway.serverkit import GatewayThread

MODEL = "llama-3-8b"
# L4 decode of Llama-3-8B ≈ 66 ms per token; at time_scale 5 ≈ 13 ms: a 200-token stream lasts ≈ 2.6 s.
SLOW = 5.0


def _config(replicas: int = 2, time_scale: float = SLOW, **sections: Any) -> Any:
    pool = {
        "name": "l4",
        "model": MODEL,
        "gpu": "L4",
        "role": "mixed",
        "endpoints": {"simulated": {"replicas": replicas, "time_scale": time_scale}},
    }
    # active health checks off (60 s): the tests see passive ejection, not a lucky health check first
    return validate_config(
        {"pools": [pool], "routing": {"policy": "round-robin"}, "health": {"interval_s": 60}, **sections}
    )


@pytest.fixture
def gw() -> collections.abc.Iterator[GatewayThread]:
    with GatewayThread(_config()) as thread:
        yield thread
        _assert_no_leftover_load(thread)


def _assert_no_leftover_load(gw: GatewayThread) -> None:
    deadline = time.monotonic() + 5
    while any(r.inflight_requests for r in gw.gateway.registry.records()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(
        r.inflight_requests == 0 and r.inflight_prefill_tokens == 0 for r in gw.gateway.registry.records()
    )


def _within(seconds: float, condition: collections.abc.Callable[[], bool]) -> bool:
    """`condition()` came true within `seconds` (polled every 10 ms)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _source(gw: GatewayThread) -> SimulatedPoolSource:
    source = gw.gateway.sources["l4"]
    assert isinstance(source, SimulatedPoolSource)
    return source


def _busy_worker_index(gw: GatewayThread) -> int:
    for rec in gw.gateway.registry.records():
        if rec.inflight_requests:
            return int(rec.id.rsplit("-", 1)[1])
    raise AssertionError("no worker has a request in flight")


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [5] * 32,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def test_worker_killed_before_dispatch_retries_elsewhere(gw: GatewayThread) -> None:
    gw.call(_source(gw).workers[0].stop())  # dead, but the registry still lists it as ready
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        results = [http.post("/v1/completions", json=_body(3, stream=i % 2 == 1)) for i in range(6)]
    assert [r.status_code for r in results] == [200] * 6
    assert gw.metric("mosaic_retries_total", model=MODEL, reason="connect") == 1  # ejected after one refusal
    assert gw.gateway.dispatcher.outcomes == {"completed": 6}


def test_worker_killed_mid_stream_ends_with_error_event(gw: GatewayThread) -> None:
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=_body(200, stream=True)) as r:
            lines = r.iter_lines()
            events = [next(e for e in lines if e) for _ in range(3)]
            gw.call(_source(gw).workers[_busy_worker_index(gw)].kill())
            events += [e for e in lines if e]
        assert r.status_code == 200
        assert 3 <= len(events) < 200
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 502
        assert events[-1] == "data: [DONE]"
        # the surviving worker takes the next request (the dead one is refused and ejected)
        assert http.post("/v1/completions", json=_body(3, stream=False)).status_code == 200
    assert gw.gateway.dispatcher.outcomes == {"worker_error": 1, "completed": 1}


def test_worker_stopped_mid_stream_ends_it_as_vllm_aborts_it(gw: GatewayThread) -> None:
    """A worker that stops (as vLLM does on SIGTERM without a shutdown timeout) ends its running stream with
    finish_reason "abort" and [DONE]: relayed as sent, the outcome a worker error, its breaker not told (a
    stop is not a fault). Before, the gateway counted the cut answer as completed."""
    with (
        httpx.Client(base_url=gw.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=_body(200, stream=True)) as r,
    ):
        lines = r.iter_lines()
        events = [next(e for e in lines if e) for _ in range(3)]
        gw.call(_source(gw).workers[_busy_worker_index(gw)].stop())
        events += [e for e in lines if e]
    assert r.status_code == 200 and 3 <= len(events) < 200
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))["choices"][0]
    assert (last["text"], last["finish_reason"]) == ("", "abort")
    assert gw.gateway.dispatcher.outcomes == {"worker_error": 1}
    assert all(rec.breaker.failures == 0 for rec in gw.gateway.registry.records())


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_cancels_upstream(gw: GatewayThread, stream: bool) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            if stream:
                async with http.stream("POST", "/v1/completions", json=_body(300, stream=True)) as r:
                    it = r.aiter_lines()
                    for _ in range(3):
                        await anext(it)
            else:  # give up waiting for a long non-streaming answer
                with pytest.raises(httpx.ReadTimeout):
                    await http.post("/v1/completions", json=_body(300, stream=False), timeout=0.5)

    asyncio.run(go())
    _assert_no_leftover_load(gw)
    assert gw.gateway.dispatcher.outcomes == {"client_disconnected": 1}
    if stream:
        # The gateway closed its upstream connection. The simulated worker, like vLLM, aborts a stream whose
        # client went away; it does not watch non-streaming requests for disconnects (vLLM does, with its
        # `with_cancellation` wrapper), so the non-streaming case is checked at the seam in test_faults.py.
        engines = [w.runtime.engine for w in _source(gw).workers.values()]
        deadline = time.monotonic() + 3
        while any(e.num_running for e in engines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(e.num_running == 0 for e in engines)  # aborted upstream, not left generating 300 tokens
        assert sum(e.counters.generation_tokens for e in engines) < 300


def test_graceful_shutdown_drains_an_open_stream() -> None:
    with (
        GatewayThread(_config(replicas=1, limits={"shutdown_grace_s": 20})) as gw,
        httpx.Client(base_url=gw.url, timeout=30) as http,
    ):
        with http.stream("POST", "/v1/completions", json=_body(60, stream=True)) as r:
            lines = r.iter_lines()
            first = next(e for e in lines if e)
            assert gw.running is not None
            stopping = asyncio.run_coroutine_threadsafe(gw.running.stop(), gw.loop)
            time.sleep(0.1)
            assert gw.gateway.draining
            rest = [e for e in lines if e]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]" and len(events) == 61  # all 60 tokens, then [DONE]
        stopping.result(20)
        assert gw.gateway.dispatcher.outcomes == {"completed": 1}


def test_shutdown_ends_what_outlives_the_grace_in_openai_shape(caplog: pytest.LogCaptureFixture) -> None:
    """One worker with max_num_seqs 1 (at-capacity lets 2 in flight): a stream and a non-streaming request
    run, a third waits in the admission queue. On stop the queued one gets 503 at once; when the 1 s grace
    (less its margin) runs out, the gateway ends the other two itself: 503 JSON before the response began,
    an error event and [DONE] for the stream. uvicorn's own time-out cancelled them into plain-text 500s."""
    cfg = _config(replicas=1, limits={"shutdown_grace_s": 1, "queue_deadline_s": 60})
    cfg = cfg.model_copy(update={"pools": [cfg.pools[0].model_copy(update={"max_num_seqs": 1})]})
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        outcomes: dict[str, Any] = {}

        def whole(name: str) -> None:
            outcomes[name] = http.post("/v1/completions", json=_body(300, stream=False))

        with http.stream("POST", "/v1/completions", json=_body(300, stream=True)) as r:
            lines = r.iter_lines()
            assert next(e for e in lines if e).startswith("data: {")
            running = threading.Thread(target=whole, args=("running",))
            running.start()
            time.sleep(0.3)
            queued = threading.Thread(target=whole, args=("queued",))
            queued.start()
            time.sleep(0.3)
            assert gw.gateway.admission.depths() == {MODEL: 1}
            assert gw.running is not None
            started = time.monotonic()
            stopping = asyncio.run_coroutine_threadsafe(gw.running.stop(), gw.loop)
            queued.join(5)
            assert time.monotonic() - started < 0.4  # refused at once, not at the end of the grace
            rest = [e for e in lines if e]
        running.join(5)
        stopping.result(10)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["error"] == {
            "message": "The gateway is shutting down; retry on another replica.",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
        for name in ("queued", "running"):
            answer = outcomes[name]
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["type"] == "ServiceUnavailableError"
        assert gw.gateway.dispatcher.outcomes == {"shut_down": 1, "rejected_shutting_down": 2}
        assert not gw.gateway.dispatcher.open
    # the operator hears how many the grace cut (before, nothing after "shutting down: ...")
    cut = [r for r in caplog.records if "grace of 1 s ran out" in r.getMessage()]
    assert [(r.levelname, r.getMessage().split(";")[0]) for r in cut] == [
        (
            "WARNING",
            "shutdown grace of 1 s ran out: ended 2 request(s) still open (503, or an error event on a stream not yet ended)",
        )
    ]


def test_a_responses_stream_cut_at_shutdown_ends_with_the_next_sequence_number() -> None:
    """Before: the shutdown's `event: error` of a Responses stream was a constant with `sequence_number` 0,
    after events numbered from 0 up; the gateway's other error events there carry the next number."""
    cfg = _config(replicas=1, limits={"shutdown_grace_s": 1})
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 300, "stream": True}
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        with http.stream("POST", "/v1/responses", json=body) as r:
            lines = r.iter_lines()
            assert next(e for e in lines if e).startswith("event: response.created")
            assert gw.running is not None
            stopping = asyncio.run_coroutine_threadsafe(gw.running.stop(), gw.loop)
            events = [json.loads(e.removeprefix("data: ")) for e in lines if e.startswith("data: ")]
        stopping.result(10)
    assert events[-1]["type"] == "error" and events[-1]["code"] == "503"
    numbers = [e["sequence_number"] for e in events]
    assert numbers == list(range(len(numbers))) and len(numbers) > 3


def test_a_body_still_arriving_at_shutdown_is_refused_not_sent_to_a_worker() -> None:
    """The draining check ran before the body was read: a request mid-upload at SIGTERM was routed to a
    worker once its body arrived, then ended at the end of the grace (or by uvicorn, a plain-text 500)."""
    with GatewayThread(_config(replicas=1, limits={"shutdown_grace_s": 2})) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        body = json.dumps(_body(2000, stream=False)).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        with socket.create_connection((host, int(port))) as s:
            s.sendall(head + b"content-length: %d\r\n\r\n" % len(body) + body[:10])
            time.sleep(0.2)
            assert gw.running is not None
            stopping = asyncio.run_coroutine_threadsafe(gw.running.stop(), gw.loop)
            time.sleep(0.3)
            sent = time.monotonic()
            s.sendall(body[10:])
            s.settimeout(5)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            took = time.monotonic() - sent
        stopping.result(10)
        status, _, payload = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 503") and took < 0.5
        assert json.loads(payload)["error"]["type"] == "ServiceUnavailableError"
        assert gw.gateway.dispatcher.outcomes == {"rejected_shutting_down": 1}
        engines = [w.runtime.engine for w in _source(gw).workers.values()]
        assert all(e.counters.steps == 0 for e in engines)  # no worker ever saw it


def test_a_queued_request_is_refused_even_when_a_wake_up_meets_the_cancel() -> None:
    """A lease release wakes the queue's head in the same loop turn as the shutdown's cancel: on 3.11
    `asyncio.wait_for` returned the wake-up and dropped the cancel, so the queued request waited out the
    whole grace (and was cancelled by uvicorn, logged as exceeding the graceful shutdown)."""
    cfg = _config(replicas=1, limits={"shutdown_grace_s": 3, "queue_deadline_s": 60})
    cfg = cfg.model_copy(update={"pools": [cfg.pools[0].model_copy(update={"max_num_seqs": 1})]})
    with GatewayThread(cfg) as gw, httpx.Client(base_url=gw.url, timeout=30) as http:
        answers: dict[int, tuple[int, float]] = {}
        started = time.monotonic()

        def whole(i: int) -> None:
            r = http.post("/v1/completions", json=_body(400, stream=False))
            answers[i] = (r.status_code, time.monotonic() - started)

        threads = [threading.Thread(target=whole, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        # two on the worker, one queued (polled: a loaded machine may take longer to get there)
        assert _within(5.0, lambda: gw.gateway.admission.depths() == {MODEL: 1})

        def wake_then_shut_down() -> None:
            gw.gateway.admission.notify(MODEL)
            gw.gateway.begin_shutdown(3.0)

        shut_at = time.monotonic() - started
        gw.loop.call_soon_threadsafe(wake_then_shut_down)
        assert _within(1.0, lambda: gw.gateway.admission.depths() == {MODEL: 0})
        assert gw.running is not None
        asyncio.run_coroutine_threadsafe(gw.running.stop(), gw.loop).result(10)
        for t in threads:
            t.join(10)
        queued = answers[2]
        assert queued[0] == 503 and queued[1] - shut_at < 1.0  # before: the whole 3 s grace
        assert gw.gateway.dispatcher.outcomes == {"rejected_shutting_down": 3}
