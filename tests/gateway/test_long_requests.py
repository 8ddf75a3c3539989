"""Requests that take longer than the stall timeout, over real sockets with simulated workers.

A non-streaming vLLM answer sends no byte until generation ends, so the gap the stall timeout bounds (no
byte from the worker) is the whole generation: the wait for its headers must be bounded by the request's
own budget (`total_timeout_s`), not by `stall_timeout_s`, and a long answer must not count against the
worker's circuit breaker."""

from __future__ import annotations

import time
from typing import Any

import httpx

from server.config import validate_config
from tests.gateway.serverkit import GatewayThread

MODEL = "llama-3-8b"


def _config(**limits: float) -> Any:
    pool = {
        "name": "l4",
        "model": MODEL,
        "gpu": "L4",
        "role": "mixed",
        # L4 decode of Llama-3-8B ≈ 66 ms per token; at time scale 5 ≈ 13 ms: 120 tokens ≈ 1.6 s
        "endpoints": {"simulated": {"replicas": 1, "time_scale": 5.0}},
    }
    return validate_config(
        {
            "pools": [pool],
            "routing": {"policy": "round-robin"},
            "health": {"interval_s": 60},
            "limits": limits,
        }
    )


def _body(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [5] * 32,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def test_non_streaming_answer_longer_than_the_stall_timeout_completes() -> None:
    with GatewayThread(_config(stall_timeout_s=0.4, total_timeout_s=30)) as gw:
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            started = time.monotonic()
            first = http.post("/v1/completions", json=_body(120, stream=False))
            took = time.monotonic() - started
            assert first.status_code == 200, first.text
            assert first.json()["usage"]["completion_tokens"] == 120
            assert took > 0.8  # it really ran longer than the stall timeout (twice over)
            # twice more: a long answer is not a failure, so the only worker is never ejected
            assert [
                http.post("/v1/completions", json=_body(60, stream=False)).status_code for _ in range(2)
            ] == [
                200,
                200,
            ]
        assert gw.gateway.dispatcher.outcomes == {"completed": 3}
        assert gw.metric("mosaic_retries_total", model=MODEL, reason="timeout") == 0


def test_non_streaming_answer_past_the_total_timeout_gets_504() -> None:
    with GatewayThread(_config(stall_timeout_s=30, total_timeout_s=0.5, retry_budget_s=0)) as gw:
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            started = time.monotonic()
            r = http.post("/v1/completions", json=_body(200, stream=False))
            took = time.monotonic() - started
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == 504
        assert 0.4 < took < 2.0  # the total budget, not the 30 s stall timeout


def test_stream_with_a_gap_longer_than_the_stall_timeout_ends_with_an_error_event() -> None:
    # the stall timeout still bounds every gap between chunks of a stream: 13 ms per token at time scale 5,
    # so a stall timeout far under that must cut the stream after its first byte
    with GatewayThread(_config(stall_timeout_s=0.004, first_token_timeout_s=30, total_timeout_s=30)) as gw:
        with (
            httpx.Client(base_url=gw.url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=_body(100, stream=True)) as r,
        ):
            events = [line for line in r.iter_lines() if line]
        assert r.status_code == 200
        assert len(events) < 100
        assert events[-1] == "data: [DONE]"
        assert '"error"' in events[-2]


def test_a_non_streaming_prompt_leaves_the_prefill_backlog_at_its_estimated_ttft() -> None:
    # the gateway sees no first token of a non-streaming answer, so the prompt would otherwise count as
    # queued prefill (est-ttft, the P/D gate) until generation ends ~1.6 s later
    import threading

    with GatewayThread(_config()) as gw:
        (record,) = gw.gateway.registry.records()
        result: dict[str, int] = {}

        async def routing_view() -> tuple[int, int]:  # what the next request's routing cycle sees
            (view,) = gw.gateway.registry.view().workers
            return view.inflight_requests, view.inflight_prefill_tokens

        def send() -> None:
            with httpx.Client(base_url=gw.url, timeout=30) as http:
                result["status"] = http.post("/v1/completions", json=_body(120, stream=False)).status_code

        thread = threading.Thread(target=send)
        thread.start()
        deadline = time.monotonic() + 5
        while record.inflight_requests == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert record.inflight_requests == 1
        assert record.inflight_prefill_tokens > 0  # just dispatched: its prompt is queued prefill
        time.sleep(0.5)  # an L4 prefills 32 tokens in milliseconds; generation runs on for ~1 s more
        assert gw.call(routing_view()) == (1, 0)
        thread.join(30)
        assert result["status"] == 200
        assert (record.inflight_requests, record.inflight_prefill_tokens) == (0, 0)
