"""Failure handling through the HTTP seam: fake vLLM workers behind `httpx.MockTransport`, the gateway app
driven in-process (`httpx.ASGITransport`). After every test: each request ended in exactly one terminal
outcome and every in-flight ticket was released (no worker shows load).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from server.app import create_app
from server.dispatch import RequestRecord
from server.footprint import parse_request
from server.gateway import Gateway
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pd_config, pool

CHAT = "/v1/chat/completions"
LONG_PROMPT = "word " * 400  # ≈ 2,000 chars ≈ 500 estimated tokens: over the 256-token P/D threshold


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {
        "model": "llama-3-8b",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **extra,
    }


@asynccontextmanager
async def gateway(cfg: Any, fleet: FakeFleet) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    app = create_app(cfg, transport=fleet.transport)
    gw: Gateway = app.state.gateway
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10)
    async with app.router.lifespan_context(app), client as c:
        yield c, gw
    # every path released everything exactly once: in-flight tickets and KV reservations
    assert all(r.inflight_requests == 0 and r.inflight_prefill_tokens == 0 for r in gw.registry.records())
    assert gw.ledger is not None
    assert all(row["reserved_units"] == 0 and row["active"] == 0 for row in gw.ledger.snapshot().values())
    assert gw.ledger.stats.double_releases == 0


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 30))


def metric(gw: Gateway, name: str, **labels: str) -> float:
    value = gw.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


RR = {"routing": {"policy": "round-robin"}}


def test_retry_on_503_then_succeeds_elsewhere() -> None:
    a, b = FakeWorker("a", mode="status", status=503), FakeWorker("b")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a, b), **RR), FakeFleet(a, b)) as (c, gw):
            for i in range(4):
                r = await c.post(CHAT, json=chat(f"q{i}"))
                assert r.status_code == 200
            assert len(a.seen) >= 1 and len(b.seen) == 4
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="status_503") == len(a.seen)
            assert gw.dispatcher.outcomes == {"completed": 4}

    run(body)


def test_worker_killed_before_dispatch_is_ejected_and_retried() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a, b), **RR), FakeFleet(a, b)) as (c, gw):
            a.mode = "refuse"  # dies after the startup health check
            results = await asyncio.gather(*(c.post(CHAT, json=chat(f"q{i}")) for i in range(6)))
            assert [r.status_code for r in results] == [200] * 6
            assert len(b.seen) == 6
            # connection refused ejects at once: exactly one request ever tried `a` … unless several were
            # dispatched to it concurrently before the first refusal came back; never more than 6
            retries = metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="connect")
            assert 1 <= retries <= 6
            assert gw.registry.get("p/a:8000").breaker.is_open(gw.clock())
            assert gw.dispatcher.outcomes == {"completed": 6}

    run(body)


def test_every_worker_503_passes_the_last_worker_error_through() -> None:
    a, b = FakeWorker("a", mode="status", status=503), FakeWorker("b", mode="status", status=503)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a, b), **RR), FakeFleet(a, b)) as (c, gw):
            r = await c.post(CHAT, json=chat())
            assert r.status_code == 503
            assert r.json()["error"]["message"] in (
                "worker a says 503",
                "worker b says 503",
            )  # unchanged body
            assert gw.dispatcher.outcomes == {"failed_before_first_byte": 1}

    run(body)


def test_every_worker_refusing_is_a_502_in_openai_shape() -> None:
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            a.mode = "refuse"
            r = await c.post(CHAT, json=chat())
            assert r.status_code == 502
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert gw.dispatcher.outcomes == {"failed_before_first_byte": 1}

    run(body)


def test_worker_4xx_passes_through_unchanged_without_retry() -> None:
    a, b = FakeWorker("a", mode="status", status=400), FakeWorker("b", mode="status", status=400)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a, b)), FakeFleet(a, b)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True))
            assert r.status_code == 400  # vLLM answers plain JSON 400 even for stream=true
            assert r.json()["error"]["code"] == 400
            assert len(a.seen) + len(b.seen) == 1
            # a refusal is its own outcome, not a completion (the autoscaler counts completions)
            assert gw.dispatcher.outcomes == {"worker_rejected": 1}
            assert (
                metric(gw, "mosaic_request_outcomes_total", model="llama-3-8b", outcome="worker_rejected")
                == 1
            )
            assert metric(gw, "mosaic_request_outcomes_total", model="llama-3-8b", outcome="completed") == 0
            assert metric(gw, "mosaic_requests_total", model="llama-3-8b", pool="p", status="400") == 1

    run(body)


def test_mid_stream_death_ends_with_error_event_and_done() -> None:
    a = FakeWorker("a", mode="die_mid_stream", tokens=6, die_after=2)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=6))
            assert r.status_code == 200
            events = sse_events(r.text)
            assert len(events) == 4  # two content chunks, the error event, [DONE]
            assert json.loads(events[2])["error"]["type"] == "BadGatewayError"
            assert events[3] == "[DONE]"
            assert len(a.seen) == 1  # never retried after the first byte
            assert gw.dispatcher.outcomes == {"worker_error": 1}

    run(body)


def test_stalled_worker_times_out_and_retries() -> None:
    """A stream whose first token does not come within first_token_timeout_s is retried elsewhere and the
    worker charged; a whole answer gets total_timeout_s from arrival, retries included: when that runs out it
    ends 504 `timed_out`, without a retry (none would have time left) and without blaming the worker (a
    long generation is not a broken worker, and the next worker would only have been sent a request to time
    out at once: three such requests ejected every healthy worker, review finding)."""
    a, b = FakeWorker("a", mode="stall"), FakeWorker("b")
    limits = {"first_token_timeout_s": 0.2, "total_timeout_s": 0.3}

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a, b), limits=limits, **RR), FakeFleet(a, b)) as (
            c,
            gw,
        ):
            r1 = await c.post(CHAT, json=chat("s", stream=True))
            assert r1.status_code == 200 and sse_events(r1.text)[-1] == "[DONE]"
            assert len(a.seen) == 1 and len(b.seen) == 1
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="timeout") == 1
            assert gw.registry.get("p/a:8000").breaker.failures == 1
            r2 = await c.post(CHAT, json=chat("n"))  # round robin: to the stalled worker
            assert r2.status_code == 504 and "total timeout of 0.3 s" in r2.json()["error"]["message"]
            assert len(a.seen) == 2 and len(b.seen) == 1  # no retry with nothing left of the budget
            assert gw.registry.get("p/a:8000").breaker.failures == 1  # not blamed for the request's limit
            assert gw.dispatcher.outcomes == {"completed": 1, "timed_out": 1}

    run(body)


def test_usage_injected_upstream_and_stripped_for_the_client() -> None:
    a = FakeWorker("a", tokens=3)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=3))
            events = sse_events(r.text)
            assert len(events) == 4 and not any('"usage"' in e for e in events)  # 3 chunks + [DONE]
            assert a.seen[0]["stream_options"] == {"include_usage": True}
            r = await c.post(
                CHAT, json=chat(stream=True, max_tokens=3, stream_options={"include_usage": True})
            )
            assert json.loads(sse_events(r.text)[-2])["usage"]["completion_tokens"] == 3
            # both counted from upstream usage: 3 + 3 generated, 7 + 7 prompt
            assert metric(gw, "mosaic_generation_tokens_total", model="llama-3-8b") == 6
            assert metric(gw, "mosaic_prompt_tokens_total", model="llama-3-8b") == 14

    run(body)


def test_stream_timings_count_token_events_only() -> None:
    """ITL is one gap per token event after the first: `[DONE]` and the usage-only event end the stream
    in its last token's step and are not gaps, and TPOT ends at the last token; a stream of several
    sequences has no per-token timings; a stream that opens with an error event has no TTFT."""
    a = FakeWorker("a", tokens=4)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            labels = {"model": "llama-3-8b", "pool": "p"}
            for usage in (False, True):  # [DONE] after the tokens; then the usage-only event too
                r = await c.post(
                    CHAT, json=chat(stream=True, max_tokens=4, stream_options={"include_usage": usage})
                )
                assert sse_events(r.text)[-1] == "[DONE]"
            assert metric(gw, "mosaic_time_to_first_token_seconds_count", **labels) == 2
            assert metric(gw, "mosaic_inter_token_latency_seconds_count", **labels) == 2 * 3
            assert metric(gw, "mosaic_time_per_output_token_seconds_count", **labels) == 2
            # TPOT runs to the last token, not to the end of the stream: 3 gaps of 20 ms, then 400 ms to [DONE]
            a.chunk_delay_s, a.tail_delay_s = 0.02, 0.4
            await c.post(CHAT, json=chat(stream=True, max_tokens=4))
            a.chunk_delay_s = a.tail_delay_s = 0.0
            tpot = gw.metrics.registry.get_sample_value("mosaic_time_per_output_token_seconds_sum", labels)
            assert metric(gw, "mosaic_time_per_output_token_seconds_count", **labels) == 3
            assert tpot is not None and 0.02 <= tpot < 0.1 + 2 * 0.01  # ~0.02 + ~0 s for the first two
            # several sequences (n = 2): TTFT, but no per-token timing (their tokens interleave)
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=4, n=2))
            assert sse_events(r.text)[-1] == "[DONE]"
            assert metric(gw, "mosaic_time_to_first_token_seconds_count", **labels) == 4
            assert metric(gw, "mosaic_inter_token_latency_seconds_count", **labels) == 3 * 3
            assert metric(gw, "mosaic_time_per_output_token_seconds_count", **labels) == 3
            a.mode = "error_event"
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=4))
            assert json.loads(sse_events(r.text)[0])["error"]["message"] == "engine died"
            assert metric(gw, "mosaic_time_to_first_token_seconds_count", **labels) == 4
            assert metric(gw, "mosaic_inter_token_latency_seconds_count", **labels) == 3 * 3

    run(body)


@pytest.mark.parametrize(
    "lead_s", [0.0, 0.3], ids=["role event with the first token (vLLM)", "role event early"]
)
def test_a_chat_streams_role_event_is_no_token(lead_s: float) -> None:
    """vLLM opens a chat stream with `delta: {role, content: ""}` per choice: no token. Counted as one, it
    added a near-0 ITL gap per stream; sent early (the simulated worker did), TTFT read ~0 and the whole
    prefill became one ITL gap and part of TPOT. TTFT is the first token's, ITL its gaps only."""
    a = FakeWorker("a", tokens=4, role_lead_s=lead_s, chunk_delay_s=0.01)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            labels = {"model": "llama-3-8b", "pool": "p"}
            for _ in range(2):
                r = await c.post(CHAT, json=chat(stream=True, max_tokens=4))
                events = sse_events(r.text)
                assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                assert len(events) == 1 + 4 + 1  # the role event is relayed as it came
            assert metric(gw, "mosaic_time_to_first_token_seconds_count", **labels) == 2
            assert metric(gw, "mosaic_inter_token_latency_seconds_count", **labels) == 2 * 3
            ttft = gw.metrics.registry.get_sample_value("mosaic_time_to_first_token_seconds_sum", labels)
            itl = gw.metrics.registry.get_sample_value("mosaic_inter_token_latency_seconds_sum", labels)
            tpot = gw.metrics.registry.get_sample_value("mosaic_time_per_output_token_seconds_sum", labels)
            assert ttft is not None and itl is not None and tpot is not None
            assert 2 * lead_s <= ttft < 2 * lead_s + 0.5
            assert itl < 6 * 0.01 + 0.25 and tpot < 2 * 0.01 + 0.1  # 10 ms gaps: the lead is in neither
            # the role event, then the worker's error event: no token, so no TTFT (and no gap)
            a.mode = "error_event"
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=4))
            assert json.loads(sse_events(r.text)[1])["error"]["message"] == "engine died"
            assert metric(gw, "mosaic_time_to_first_token_seconds_count", **labels) == 2
            assert metric(gw, "mosaic_inter_token_latency_seconds_count", **labels) == 2 * 3

    run(body)


def test_request_id_propagated_or_created() -> None:
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, _):
            r = await c.post(CHAT, json=chat(), headers={"X-Request-Id": "client-id-42"})
            assert r.headers["x-request-id"] == "client-id-42" == a.headers_seen[0]["x-request-id"]
            r = await c.post(CHAT, json=chat(), headers={"X-Request-Id": "bad id with spaces"})
            rid = r.headers["x-request-id"]
            assert len(rid) == 32 and rid == a.headers_seen[1]["x-request-id"]
            assert "authorization" not in a.headers_seen[0]  # the client's key never reaches workers

    run(body)


def test_pd_two_hop_handshake() -> None:
    p, d = FakeWorker("p"), FakeWorker("d", tokens=5)
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            r = await c.post(
                CHAT,
                json=chat(
                    LONG_PROMPT,
                    stream=True,
                    max_tokens=5,
                    min_tokens=2,
                    stream_options={"include_usage": True},
                ),
                headers={"X-Request-Id": "pd-1"},
            )
            assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
            hop1, hop2 = p.seen[0], d.seen[0]
            assert hop1["kv_transfer_params"] == {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            assert (hop1["stream"], hop1["max_tokens"], hop1["max_completion_tokens"]) == (False, 1, 1)
            assert "stream_options" not in hop1 and "min_tokens" not in hop1
            assert hop2["kv_transfer_params"]["remote_engine_id"] == "engine-p"
            assert hop2["kv_transfer_params"]["remote_block_ids"] == [1, 2, 3]
            assert (hop2["stream"], hop2["max_tokens"], hop2["min_tokens"]) == (True, 5, 2)
            assert p.headers_seen[0]["x-request-id"] == d.headers_seen[0]["x-request-id"] == "pd-1"
            # short prompt: no prefill hop
            await c.post(CHAT, json=chat("short"))
            assert len(p.seen) == 1 and "kv_transfer_params" not in d.seen[1]
            assert (
                metric(gw, "mosaic_time_to_first_token_seconds_count", model="llama-3-8b", pool="decode") == 1
            )

    run(body)


def test_a_multi_sequence_request_skips_the_prefill_hop() -> None:
    """A batch of long prompts, or n > 1, goes to the decode worker in one hop without kv_transfer_params
    (vLLM's prefill answer carries one sequence's blocks)."""
    p, d = FakeWorker("p"), FakeWorker("d")
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            batch = {"model": "llama-3-8b", "prompt": [LONG_PROMPT, LONG_PROMPT], "max_tokens": 4}
            r1 = await c.post("/v1/completions", json=batch)
            r2 = await c.post(CHAT, json=chat(LONG_PROMPT, n=2))
            assert (r1.status_code, r2.status_code) == (200, 200)
            assert p.seen == [] and [("kv_transfer_params" in b) for b in d.seen] == [False, False]
            assert not [
                m for m in gw.metrics.registry.collect() if m.name == "mosaic_pd_fallbacks" and m.samples
            ]
            assert gw.dispatcher.outcomes == {"completed": 2}

    run(body)


@pytest.mark.parametrize(
    ("mode", "reason", "built"),
    [
        ("refuse", "worker_error", False),
        ("no_kv_params", "no_params", True),
        ("status", "worker_error", False),
        ("stall", "timeout", True),
    ],
    ids=[
        "prefill worker dead",
        "prefill answered without kv_transfer_params",
        "prefill 503",
        "prefill stalls past half the first-token budget",
    ],
)
def test_pd_falls_back_to_decode_only(mode: str, reason: str, built: bool) -> None:
    """Decode-only in the same attempt; and the prefill worker keeps the prompt's prefix affinity only if it
    may have built the KV (it answered, or timed out while running it): a hop it refused or failed before
    running built nothing there, and the prompt's next requests were steered back to it every time."""
    p, d = FakeWorker("p"), FakeWorker("d")
    cfg = config(
        pool("prefill", "H100", "prefill", p),
        pool("decode", "A100", "decode", d),
        limits={"first_token_timeout_s": 0.4, "total_timeout_s": 0.4},
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            p.mode = mode
            r = await c.post(CHAT, json=chat(LONG_PROMPT))
            assert r.status_code == 200
            assert len(d.seen) == 1 and "kv_transfer_params" not in d.seen[0]
            assert metric(gw, "mosaic_pd_fallbacks_total", model="llama-3-8b", reason=reason) == 1
            assert gw.dispatcher.outcomes == {"completed": 1}
            (affinity,) = [s.scorer for s in gw.router.handler.prefill.scorers if s.name == "prefix-affinity"]
            assert (affinity.index.size("prefill/p:8000") > 0) is built
            assert affinity.index.size("decode/d:8000") > 0  # the decode worker prefilled it

    run(body)


def test_a_prefill_worker_gone_between_routing_and_the_hop_means_decode_only() -> None:
    """The prefill worker left the fleet (discovery) after the router chose it: the request runs decode-only
    (`removed`) in the same attempt, as the two-hop path promises for any failed hop. It was an
    `UpstreamFailure` of the whole attempt: a retry (`mosaic_retries_total{reason="removed"}`) routed again,
    and with `max_retries: 0` a 502."""
    p, d = FakeWorker("p"), FakeWorker("d")
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            track = gw.registry.track

            def gone(worker_id: str, *args: Any, **kwargs: Any) -> Any:
                if worker_id == "prefill/p:8000":
                    raise KeyError(worker_id)  # what the registry raises for a worker it no longer has
                return track(worker_id, *args, **kwargs)

            gw.registry.track = gone  # type: ignore[method-assign]
            r = await c.post(CHAT, json=chat(LONG_PROMPT))
            assert r.status_code == 200
            assert p.seen == [] and len(d.seen) == 1 and "kv_transfer_params" not in d.seen[0]
            assert metric(gw, "mosaic_pd_fallbacks_total", model="llama-3-8b", reason="removed") == 1
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="removed") == 0
            assert gw.dispatcher.outcomes == {"completed": 1}
            assert gw.registry.get("prefill/p:8000").breaker.failures == 0  # type: ignore[union-attr]

    run(body)


def test_a_busy_prefill_worker_is_not_ejected() -> None:
    """A 429 on the prefill hop counted as a breaker failure (on the decode hop it is busy, not broken):
    three in a row opened the breaker of a worker that was merely full."""
    p, d = FakeWorker("p", mode="status", status=429), FakeWorker("d")
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            for i in range(4):
                r = await c.post(CHAT, json=chat(LONG_PROMPT + str(i)))
                assert r.status_code == 200
            prefill = gw.registry.get("prefill/p:8000")
            assert prefill is not None and prefill.breaker.failures == 0
            assert not prefill.breaker.is_open(gw.clock()) and len(p.seen) == 4  # still routed to
            assert metric(gw, "mosaic_pd_fallbacks_total", model="llama-3-8b", reason="busy") == 4

    run(body)


def test_a_total_timeout_during_the_prefill_hop_is_not_the_decode_workers() -> None:
    """With less of total_timeout_s left than half the first-token budget, the request's own timeout fired
    during the prefill hop and was charged to the decode worker, which never saw the request (504, a breaker
    failure, excluded). The hop now gets half of what is left, so the decode worker serves the rest."""
    p, d = FakeWorker("p", mode="stall"), FakeWorker("d")
    cfg = config(
        pool("prefill", "H100", "prefill", p),
        pool("decode", "A100", "decode", d),
        limits={"first_token_timeout_s": 4.0, "total_timeout_s": 0.6},
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            r = await c.post(CHAT, json=chat(LONG_PROMPT))
            assert r.status_code == 200, r.text
            assert len(d.seen) == 1 and "kv_transfer_params" not in d.seen[0]
            decode, prefill = gw.registry.get("decode/d:8000"), gw.registry.get("prefill/p:8000")
            assert decode is not None and decode.breaker.failures == 0
            assert prefill is not None and prefill.breaker.failures == 1
            assert metric(gw, "mosaic_upstream_errors_total", worker="decode/d:8000", kind="timeout") == 0

    run(body)


def test_a_total_timeout_swept_with_the_prefill_hops_blames_the_prefill_worker() -> None:
    """Time-outs are swept periodically (up to every 1 s): the prefill hop's and the request's own can
    expire in one sweep, and the request's then surfaces from inside the prefill hop. It was charged to the
    decode worker, which never received the request."""
    p, d = FakeWorker("p", mode="stall"), FakeWorker("d")
    cfg = config(
        pool("prefill", "H100", "prefill", p),
        pool("decode", "A100", "decode", d),
        limits={"first_token_timeout_s": 4.0, "total_timeout_s": 0.6, "max_retries": 0},
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            gw.dispatcher.timeouts.period = 1.0  # one sweep finds both blocks expired
            r = await c.post(CHAT, json=chat(LONG_PROMPT))
            assert r.status_code == 504 and d.seen == []
            decode, prefill = gw.registry.get("decode/d:8000"), gw.registry.get("prefill/p:8000")
            assert decode is not None and decode.breaker.failures == 0
            assert prefill is not None and prefill.breaker.failures == 1

    run(body)


def test_concurrent_faults_every_request_one_outcome() -> None:
    """Mixed failures under concurrency: every request gets exactly one terminal outcome; none hangs."""
    ok = FakeWorker("ok", chunk_delay_s=0.01)
    dying = FakeWorker("dying", mode="die_mid_stream", die_after=1, chunk_delay_s=0.01)
    busy = FakeWorker("busy", mode="status", status=429)

    async def body() -> None:
        async with gateway(
            config(pool("p", "L4", "mixed", ok, dying, busy), **RR), FakeFleet(ok, dying, busy)
        ) as (c, gw):
            reqs = [c.post(CHAT, json=chat(f"q{i}", stream=bool(i % 2), max_tokens=3)) for i in range(24)]
            results = await asyncio.gather(*reqs)
            assert all(r.status_code in (200, 429) for r in results)
            assert sum(gw.dispatcher.outcomes.values()) == 24
            assert set(gw.dispatcher.outcomes) <= {"completed", "worker_error", "failed_before_first_byte"}

    run(body)


def test_client_disconnect_before_first_byte_cancels_the_upstream_call() -> None:
    """The disconnect watcher: the client leaves while the worker is still thinking (non-streaming)."""
    a = FakeWorker("a", mode="stall")

    async def body() -> None:
        cancelled = asyncio.Event()
        original = a.handle

        async def handle(request: httpx.Request) -> httpx.Response:
            try:
                return await original(request)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        a.handle = handle  # type: ignore[method-assign]
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (_, gw):
            disconnect = asyncio.Event()

            async def receive() -> dict[str, Any]:
                await disconnect.wait()
                return {"type": "http.disconnect"}

            parsed = parse_request("chat", json.dumps(chat()).encode())
            rec = RequestRecord("rid-1", "llama-3-8b", "anonymous", gw.clock(), 0)
            task = asyncio.create_task(gw.dispatcher.handle(parsed, CHAT, rec, receive))
            await asyncio.sleep(0.05)
            assert len(a.seen) == 1 and not task.done()
            disconnect.set()
            response = await task
            await asyncio.wait_for(cancelled.wait(), 1)  # the upstream call was cancelled, not left running
            assert response.status_code == 499
            assert gw.dispatcher.outcomes == {"client_disconnected": 1}

    run(body)


def test_kv_reservations_follow_each_request() -> None:
    """The KV ledger reserves on dispatch, settles at the first token, releases at the end; the predictor
    learns output lengths from upstream usage."""
    a = FakeWorker("a", tokens=3, chunk_delay_s=0.05)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            assert gw.ledger is not None and gw.predictor is not None
            task = asyncio.create_task(c.post(CHAT, json=chat(stream=True, max_tokens=3)))
            await asyncio.sleep(0.08)
            (row,) = gw.ledger.snapshot().values()
            # one reservation: prompt ceil(5/4) + 3 + 3 = 8 tokens, + 3 output → ceil(11 / 16) = 1 block
            assert (row["active"], row["reserved_units"]) == (1, 1)
            assert (await task).status_code == 200
            assert gw.ledger.stats.released["completed"] == 1
            assert gw.predictor.samples("llama-3-8b", 7) == (3,)  # usage: 7 prompt, 3 completion tokens
            text = (await c.get("/metrics")).text
            assert 'mosaic_kv_reserved_units{worker="p/a:8000"} 0.0' in text
            # the ledger's own counts (they reached no metric: a refused growth was invisible)
            assert "mosaic_kv_reservations_total 1.0" in text
            assert 'mosaic_kv_reservations_released_total{outcome="completed"} 1.0' in text
            assert (
                "mosaic_kv_reservations_refused_total 0.0" in text
                and "mosaic_kv_grows_refused_total 0.0" in text
            )

    run(body)


def test_a_worker_refusal_releases_its_kv_reservation_as_worker_rejected() -> None:
    """A worker's 4xx releases the request's KV lease under its own outcome, not as a worker error (the
    release counter told a refused request apart from a failing worker no better than a coin)."""
    a = FakeWorker("a", mode="status", status=400)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            assert gw.ledger is not None
            assert (await c.post(CHAT, json=chat(max_tokens=3))).status_code == 400
            assert dict(gw.ledger.stats.released) == {"worker_rejected": 1}
            text = (await c.get("/metrics")).text
            assert 'mosaic_kv_reservations_released_total{outcome="worker_rejected"} 1.0' in text
            assert 'mosaic_kv_reserved_units{worker="p/a:8000"} 0.0' in text

    run(body)


def test_unknown_fields_reach_the_worker_byte_for_byte() -> None:
    a = FakeWorker("a")
    raw = (
        b'{"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,\n'
        b' "guided_json": {"type": "object"}, "vllm_xargs": {"k": [1, 2]}, "top_k": 7, "priority": -1}'
    )

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, _):
            r = await c.post(CHAT, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 200
            assert a.raw_seen[0] == raw  # not re-encoded: spacing, order and unknown fields intact
            r = await c.post(
                CHAT,
                content=raw.replace(b'"max_tokens": 2', b'"max_tokens": 2, "stream": true'),
                headers={"content-type": "application/json"},
            )
            # streaming: only `"stream_options":{"include_usage":true}` is appended, the rest is the same bytes
            assert a.raw_seen[1].startswith(
                raw.replace(b'"max_tokens": 2', b'"max_tokens": 2, "stream": true')[:-1]
            )
            assert a.raw_seen[1].endswith(b',"stream_options":{"include_usage":true}}')

    run(body)


def test_no_retry_once_the_budget_is_spent() -> None:
    a, b = FakeWorker("a", mode="status", status=503), FakeWorker("b")

    async def body() -> None:
        cfg = config(
            pool("p", "L4", "mixed", a, b), limits={"retry_budget_s": 0}, routing={"policy": "round-robin"}
        )
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            statuses = [(await c.post(CHAT, json=chat(f"q{i}"))).status_code for i in range(2)]
            # round-robin sends one of the two to `a`; with no retry budget its 503 reaches the client as is
            assert sorted(statuses) == [200, 503]
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="status_503") == 0

    run(body)


def test_a_text_prompt_over_the_context_by_the_estimate_only_goes_to_the_worker() -> None:
    """The gateway estimates a text prompt at 4 characters a token; refusing on that would turn away
    prompts a real tokenizer fits (here 33,000 characters: 8,250 estimated against an 8,192 context).
    Only a prompt that cannot fit even at 8 characters a token is refused (400 context_length_exceeded)."""
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            r = await c.post(CHAT, json=chat("hello world " * 2750))
            assert r.status_code == 200 and len(a.seen) == 1
            r = await c.post(CHAT, json=chat("x" * 80_000))  # ≥ 10,000 tokens at any rate
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert r.json()["error"]["param"] == "input_tokens"  # as vLLM names it
            assert len(a.seen) == 1
            # labelled by what refused it, not as a worker shortage (it was rejected_no_worker)
            assert gw.dispatcher.outcomes == {"completed": 1, "rejected_context_length_exceeded": 1}
            assert metric(gw, "mosaic_rejections_total", reason="context_length_exceeded") == 1

    run(body)


class SlowToRefuse(FakeWorker):
    """Answers its `status` only after `refuse_after_s` (an overloaded worker's late 503)."""

    refuse_after_s: float = 0.3

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/"):
            await asyncio.sleep(self.refuse_after_s)
        return await super().handle(request)


def test_a_non_streaming_retry_gets_what_is_left_of_the_total_timeout() -> None:
    """`total_timeout_s` bounds a whole non-streaming request from its arrival: the retry after a late 503
    (0.3 s) has 0.3 s of a 0.6 s budget left, so a 0.5 s answer times out with 504 at ~0.6 s (each attempt
    got a fresh 0.6 s: it answered 200 at ~0.8 s)."""
    a = SlowToRefuse("a", mode="status", status=503)
    b = FakeWorker("b", whole_delay_s=0.5)

    async def body() -> None:
        cfg = config(pool("p", "L4", "mixed", a, b), limits={"total_timeout_s": 0.6}, **RR)
        async with gateway(cfg, FakeFleet(a, b)) as (c, gw):
            started = asyncio.get_running_loop().time()
            r = await c.post(CHAT, json=chat("n"))
            took = asyncio.get_running_loop().time() - started
            assert (len(a.seen), len(b.seen)) == (1, 1)  # the 503 first, then the retry
            assert r.status_code == 504 and r.json()["error"]["type"] == "GatewayTimeoutError"
            assert 0.55 < took < 0.75
            assert gw.dispatcher.outcomes == {"timed_out": 1}  # the request's own limit, not b's failure
            assert gw.registry.get("p/b:8000").breaker.failures == 0  # type: ignore[union-attr]

    run(body)


class DoneAfterAPause(FakeWorker):
    """Streams two tokens, then `[DONE]` (usage included) only after `pause_s`."""

    pause_s: float = 0.5

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        chunks = [chunk async for chunk in super()._stream(chat, n, usage)]
        for chunk in chunks[:n]:
            yield chunk
        await asyncio.sleep(self.pause_s)
        yield b"".join(chunks[n:])


def test_a_stream_whose_done_comes_past_the_total_timeout_completes_once() -> None:
    """The piece that ends the stream is the first past `total_timeout_s`: relayed as it is (one [DONE],
    no error event after it) and counted completed, not worker_error."""
    a = DoneAfterAPause("a")

    async def body() -> None:
        async with gateway(
            config(pool("p", "L4", "mixed", a), limits={"total_timeout_s": 0.3}), FakeFleet(a)
        ) as (
            c,
            gw,
        ):
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=2))
            events = sse_events(r.text)
            assert len(events) == 3 and events[-1] == "[DONE]" and '"error"' not in r.text
            assert gw.dispatcher.outcomes == {"completed": 1}

    run(body)


def test_a_stream_cut_by_the_total_timeout_is_timed_out_not_a_worker_error() -> None:
    """The relayed stream (not the pushed one) past `total_timeout_s`: a 504 error event, then [DONE], one
    `timed_out` outcome (it was `worker_error`), and the steadily streaming worker keeps a clean breaker."""
    a = FakeWorker("a", tokens=40, chunk_delay_s=0.02)

    async def body() -> None:
        async with gateway(
            config(pool("p", "L4", "mixed", a), limits={"total_timeout_s": 0.3}), FakeFleet(a)
        ) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True, max_tokens=40))
            events = sse_events(r.text)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 504
            assert gw.dispatcher.outcomes == {"timed_out": 1}
            assert metric(gw, "mosaic_request_outcomes_total", model="llama-3-8b", outcome="timed_out") == 1
            # its truncated 0.3 s is no request latency (status 200 alone put it in the histogram)
            assert metric(gw, "mosaic_e2e_request_latency_seconds_count", model="llama-3-8b", pool="p") == 0
            worker = gw.registry.get("p/a:8000")
            assert worker is not None and worker.breaker.failures == 0

    run(body)


def test_a_stream_that_opens_with_a_server_error_event_is_retried_elsewhere() -> None:
    """vLLM fails a generation that has begun with `data: {"error": ...}` and `[DONE]` on a 200. When that
    is the first event nothing has reached the client: another worker serves it, and the failing worker's
    breaker hears of it. (Before, the error was relayed and the request counted as completed.)"""
    a, b = FakeWorker("a", mode="error_event"), FakeWorker("b")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a, b), **RR), FakeFleet(a, b)) as (c, gw):
            for i in range(4):
                r = await c.post(CHAT, json=chat(f"q{i}", stream=True))
                events = sse_events(r.text)
                assert events[-1] == "[DONE]" and "error" not in events[0]
                assert len(events) == 1 + 4  # four tokens from b
            assert len(a.seen) >= 1 and len(b.seen) == 4
            assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="stream_error") == len(
                a.seen
            )
            assert gw.dispatcher.outcomes == {"completed": 4}

    run(body)


def test_a_stream_failed_after_its_first_token_is_a_worker_error() -> None:
    """Two tokens, then vLLM's error event: relayed as sent (the client already has tokens), counted as
    a worker error (breaker told, no e2e latency, no TPOT), not as completed."""
    a = FakeWorker("a", mode="error_mid_stream", die_after=2)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True, stream_options={"include_usage": True}))
            events = sse_events(r.text)
            assert json.loads(events[2])["error"]["message"] == "engine died" and events[-1] == "[DONE]"
            assert gw.dispatcher.outcomes == {"worker_error": 1}
            assert gw.registry.records()[0].breaker.failures == 1
            labels = {"model": "llama-3-8b", "pool": "p"}
            assert metric(gw, "mosaic_e2e_request_latency_seconds_count", **labels) == 0
            assert metric(gw, "mosaic_time_per_output_token_seconds_count", **labels) == 0

    run(body)


def test_a_stream_refused_with_a_client_error_event_is_not_retried() -> None:
    """An error event with a 4xx code is the worker refusing the request (another would too): relayed once,
    outcome worker_rejected, the worker's breaker not told."""
    a, b = (
        FakeWorker("a", mode="error_event", error_code=400),
        FakeWorker("b", mode="error_event", error_code=400),
    )

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a, b), **RR), FakeFleet(a, b)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True))
            assert json.loads(sse_events(r.text)[0])["error"]["code"] == 400
            assert len(a.seen) + len(b.seen) == 1
            assert gw.dispatcher.outcomes == {"worker_rejected": 1}
            assert all(rec.breaker.failures == 0 for rec in gw.registry.records())

    run(body)


@pytest.mark.parametrize(
    "usage", [{"prompt_tokens": 7, "completion_tokens": "3 tokens"}, ["not", "a", "dict"]]
)
def test_a_malformed_stream_usage_does_not_cut_the_stream(usage: Any) -> None:
    """A usage event whose counts are not integers (or that is not an object) is taken as no usage: the
    stream still ends with `[DONE]` and completes. (Before, it raised in the relay's end: no `[DONE]`, and
    the request counted as a client disconnect.)"""
    a = FakeWorker("a", stream_usage=usage)

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            r = await c.post(CHAT, json=chat(stream=True, stream_options={"include_usage": True}))
            assert sse_events(r.text)[-1] == "[DONE]"
            assert gw.dispatcher.outcomes == {"completed": 1}
            labels = {"model": "llama-3-8b", "pool": "p"}
            assert metric(gw, "mosaic_e2e_request_latency_seconds_count", **labels) == 1

    run(body)


def test_a_gateway_bug_is_an_internal_error_not_a_worker_error() -> None:
    """An unexpected exception in the gateway's own code (here the router raising) is a 500 in OpenAI's
    shape with outcome internal_error: no worker was involved, none is blamed (it was worker_error)."""
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):

            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("a bug")

            gw.dispatcher.router.route = broken  # type: ignore[method-assign]
            r = await c.post(CHAT, json=chat())
            assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
            assert gw.dispatcher.outcomes == {"internal_error": 1} and not a.seen

    run(body)


def test_requests_sharing_an_x_request_id_get_their_own_tickets() -> None:
    """What a request holds in the KV ledger belongs to its ticket, so each routed request must carry its own,
    the same X-Request-Id or not (and every retry of one request the same)."""
    a = FakeWorker("a")

    async def body() -> None:
        async with gateway(config(pool("p", "L4", "mixed", a)), FakeFleet(a)) as (c, gw):
            seen: list[tuple[str, int]] = []
            route = gw.dispatcher.router.route

            def spy(req: Any, *args: Any, **kwargs: Any) -> Any:
                seen.append((req.request_id, req.ticket))
                return route(req, *args, **kwargs)

            gw.dispatcher.router.route = spy  # type: ignore[method-assign]
            for _ in range(3):
                r = await c.post(CHAT, json=chat(), headers={"X-Request-Id": "same"})
                assert r.status_code == 200
            assert [rid for rid, _ in seen] == ["same"] * 3
            tickets = [t for _, t in seen]
            assert len(set(tickets)) == 3 and all(t > 0 for t in tickets)

    run(body)
