"""A real vLLM that stops answering without closing its connections — its API server process stopped with
SIGSTOP, as a frozen process or a lost node looks from the gateway — has its request ended by the gateway once
the worker fails its health checks (`health.sever_silent_requests`), not at the 60 s first-token timeout; after
SIGCONT the same server serves again. Its engine processes stopped while it generates, or while it is idle
(a hung engine behind `/health` 200), are judged stuck (`health.stuck_engine_s`). The server is the KV-pressure one (`real_vllm_kv`),
resumed after each test and used by test_kv_pressure.py next."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import RealServer
from engine_processes import (
    TRIES,
    engine_processes,
    resume,
    stop_once_running,
    stop_while_idle,
)
from gateway_harness import MosaicGateway, static_config

from server.scrape import parse_vllm_metrics
from server.vllm_launcher import health_ok

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(300)]

# Checks every 0.5 s, 2 failures in a row → unhealthy; a connection silent for 1 s is then severed
HEALTH = {"interval_s": 0.5, "timeout_s": 1.0, "failure_threshold": 2}


def test_a_request_to_a_vllm_that_froze_ends_once_it_fails_health_checks(
    real_vllm_kv: RealServer, tmp_path: Path
) -> None:
    """The server's API process is stopped, then a request is sent through the gateway, which still counts the
    worker healthy (its last check passed): the connection is accepted by the kernel and nothing answers. Once
    two health checks failed (~1 s) the silent connection is closed and the request, not begun, is given up
    (no other worker here) — not held for the 60 s first-token timeout. (A stream cut mid-way is
    tests/gateway/test_sever_silent.py's: this tiny model generates a whole answer faster than a client can
    stop the server after its first token.)"""
    server = real_vllm_kv
    if server.process is None:
        pytest.skip("the server was started elsewhere (MOSAIC_REAL_VLLM_KV_URL): its processes are not ours")
    config = static_config(
        server.model,
        [server.url],
        extra={"health": HEALTH, "limits": {"stall_timeout_s": 60, "first_token_timeout_s": 60}},
    )
    request = {"model": server.model, "prompt": [10, 11, 12], "max_tokens": 8, "stream": True}
    with MosaicGateway(config, tmp_path) as gateway:
        gateway.wait_ready()
        gateway.wait_worker_scraped()
        with gateway.target(server.model).http() as http:
            os.kill(server.process.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                answer = http.post("/v1/completions", json=request)
                took = time.monotonic() - stopped
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
        assert answer.status_code == 502, answer.text
        assert "unhealthy" in answer.json()["error"]["message"], answer.text
        assert took < 15, took  # the window (1 s) and a health round, on 2 busy cores; the timeout is 60 s
        workers = gateway.admin_get("/admin/workers")["workers"]
        assert workers[0]["inflight"]["requests"] == 0, workers

    deadline = time.monotonic() + 60
    while not health_ok(server.url):
        assert time.monotonic() < deadline, "the server did not answer /health after SIGCONT"
        time.sleep(0.5)
    answer = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": server.model, "prompt": "x", "max_tokens": 2},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text


def _engine_and_stuck_config(server: RealServer) -> tuple[list[int], dict[str, object]]:
    """The server's engine processes, and a gateway config in front of it that judges a stuck engine after 2 s
    (60 s timeouts, which the tests show are not what ends their requests). Skips for a server not ours."""
    if server.process is None:
        pytest.skip("the server was started elsewhere (MOSAIC_REAL_VLLM_KV_URL): its processes are not ours")
    engine = engine_processes(server.process.pid)
    assert engine, "no VLLM::EngineCore process below the server"
    config = static_config(
        server.model,
        [server.url],
        extra={
            "health": {**HEALTH, "stuck_engine_s": 2.0, "open_s": 1.0},
            "limits": {"stall_timeout_s": 60, "first_token_timeout_s": 60},
        },
    )
    return engine, config


def _served_again(gateway: MosaicGateway, model: str, within_s: float = 60.0) -> None:
    """Posts a short completion through the gateway every 0.5 s until one is answered 200."""
    deadline = time.monotonic() + within_s
    with gateway.target(model).http() as http:
        while True:
            answer = http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})
            if answer.status_code == 200:
                return
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.5)


def _stream_stopping_the_engine(
    gateway: MosaicGateway, server: RealServer, engine: list[int], request: dict[str, object]
) -> tuple[list[str], float | None]:
    """Streams `request` through the gateway and stops the engine while it generates the answer
    (`stop_once_running`): the stream's events, and the seconds from the stop to the stream's end (None when
    the engine was not stopped with the request running; it ran on, and the caller tries again). While
    stopped, `/health` answers 200 (checked here)."""
    events: list[str] = []
    ended: list[float] = []
    failed: list[BaseException] = []

    def stream() -> None:
        try:
            with (
                gateway.target(server.model).http() as http,
                http.stream("POST", "/v1/completions", json=request) as answer,
            ):
                assert answer.status_code == 200, answer.read()
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
        except BaseException as exc:  # re-raised by the test's thread
            failed.append(exc)
        ended.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        if not stop_once_running(engine, server.url, reader):
            reader.join(120)
            return events, None
        stopped = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        reader.join(60)
    finally:
        resume(engine)
        reader.join(120)
    if failed:
        raise failed[0]
    assert ended, "the stream did not end within 60 s of the stop"
    return events, ended[0] - stopped


def test_a_stream_on_a_vllm_whose_engine_hangs_ends_and_the_engine_is_kept_out_until_it_steps(
    real_vllm_kv: RealServer, tmp_path: Path
) -> None:
    """vLLM's engine processes are stopped (SIGSTOP) mid-stream while its API server runs on: `/health` stays
    200 (it asks only whether the engine died), `/metrics` shows the request running (checked here on the
    server itself; an engine stopped before or after it ran the request is resumed and a new one tried). The
    gateway judges the engine stuck after `health.stuck_engine_s` (2 s here), its checks fail, and the stream,
    silent since, ends with the "unhealthy" error event and `[DONE]` within seconds, not at the 60 s stall timeout. After SIGCONT the
    engine steps again, a probe passes, and requests are served."""
    server = real_vllm_kv
    engine, config = _engine_and_stuck_config(server)
    request = {
        "model": server.model,
        "prompt": "hello",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    with MosaicGateway(config, tmp_path) as gateway:
        gateway.wait_ready()
        gateway.wait_worker_scraped()
        for _ in range(TRIES):  # until the engine is stopped with the request running (`stop_once_running`)
            events, took = _stream_stopping_the_engine(gateway, server, engine, request)
            if took is not None:
                break
        else:
            pytest.fail(f"the engine finished each of {TRIES} answers before it could be stopped")
        assert events[-1] == "[DONE]" and "unhealthy" in events[-2], events[-3:]
        assert took < 20, (
            took
        )  # stuck after 2 s, two failed checks 0.5 s apart, 1 s of silence; the stall: 60
        log = gateway.log_path.read_text()
        assert "is unhealthy: engine stuck: 1 request(s) running and no engine step for" in log, log[-3000:]
        _served_again(gateway, server.model)  # a probe passes once the resumed engine has stepped


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_request_to_a_vllm_whose_engine_hung_while_idle_ends_once_the_engine_is_judged_stuck(
    stream: bool, real_vllm_kv: RealServer, tmp_path: Path
) -> None:
    """vLLM's engine processes are stopped (SIGSTOP) while the server is idle, so its gauges stay at zero running
    and waiting and `/health` at 200: an engine that hangs in the first step after idle. A request sent through
    the gateway (a stream: the API server sends its response head at once) is never taken up by the engine (checked
    on the server); the gateway judges the engine stuck after `health.stuck_engine_s` (2 s here), its checks
    fail, and the request, sent nothing yet, is given up (no other worker here) within seconds, not at the
    60 s first-token timeout. Its probes then ask for a 1-token completion, which the stopped engine does not
    answer (the worker stays out, though nothing of ours waits there and its gauges say nothing); after
    SIGCONT a probe's completion is answered and requests are served."""
    server = real_vllm_kv
    engine, config = _engine_and_stuck_config(server)
    request = {"model": server.model, "prompt": "hello", "max_tokens": 8, "stream": stream}
    with MosaicGateway(config, tmp_path) as gateway:
        gateway.wait_ready()
        gateway.wait_worker_scraped()
        stop_while_idle(engine, server.url)
        try:
            stopped = time.monotonic()
            with gateway.target(server.model).http() as http:
                answer = http.post("/v1/completions", json=request)
            took = time.monotonic() - stopped
            marks = parse_vllm_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text).engine_marks
            deadline = time.monotonic() + 30
            while True:  # a probe (after open_s, 1 s) asks for a completion the stopped engine cannot answer
                (worker,) = gateway.admin_get("/admin/workers")["workers"]
                if "1-token completion sent as its probe had no answer" in (worker["last_error"] or ""):
                    break
                assert time.monotonic() < deadline, worker
                time.sleep(0.3)
            assert worker["engine_stuck"] is True and worker["breaker"]["state"] != "closed", worker
        finally:
            resume(engine)
        assert not any(m.num_running or m.num_waiting for m in marks), marks  # the gauges stayed at zero
        assert answer.status_code == 502, answer.text
        assert "unhealthy" in answer.json()["error"]["message"], answer.text
        assert took < 20, took  # stuck after 2 s, two failed checks 0.5 s apart, 1 s of silence; timeout: 60
        log = gateway.log_path.read_text()
        assert (
            "is unhealthy: engine stuck: none running or waiting, request(s) sent there not taken up" in log
        ), log[-3000:]
        _served_again(gateway, server.model)  # a probe's completion is answered now
