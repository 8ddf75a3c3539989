"""The P/D prefill hop's verdicts (`server.prefill_hop`, docs/gateway.md "P/D: the two-hop path"): which
answers hand `kv_transfer_params` to the decode worker, why a hop fell back (`mosaic_pd_fallbacks_total`'s
`reason`), whose breaker hears of it, and the bounded warning for a misconfigured prefill pool. Through fake
workers behind `httpx.MockTransport`, and over real sockets where the gateway's own connection pool is the
point — there also the decode hop's wait for a connection, which the request's own time-out may end."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from server.app import create_app
from server.gateway import Gateway
from server.prefill_hop import MAX_KV_DEPTH, MAX_KV_VALUES, Fallback, LogThrottle, kv_params_fault
from tests.gateway.fakes import METRICS_TEXT, FakeFleet, FakeWorker, config, pd_config, pool
from tests.gateway.scripted_http import read_request
from tests.gateway.test_faults import CHAT, LONG_PROMPT, chat, gateway, run

# vLLM's NixlConnector answer (request_finished), with the fields later releases added
NIXL = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "0f4c-engine",
    "remote_block_ids": [7, 8, 9],
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "remote_request_id": "cmpl-abc-0",
    "tp_size": 2,
}


def nested(levels: int) -> Any:
    """A value with `levels` levels of lists: nested(1) == [], nested(2) == [[]]."""
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("params", "fault"),
    [
        pytest.param(NIXL, None, id="vLLM NixlConnector's answer → handed on"),
        pytest.param(
            {**NIXL, "remote_block_ids": [[1, 2], [3]]}, None, id="block ids per KV-cache group → handed on"
        ),
        pytest.param(
            {**NIXL, "other_connector": {"session": "s1", "ranks": [0, 1]}},
            None,
            id="another connector's own keys → handed on",
        ),
        pytest.param({"do_remote_prefill": True}, None, id="only do_remote_prefill → handed on"),
        pytest.param(
            {**NIXL, "do_remote_decode": None},
            None,
            id="do_remote_decode null → handed on (vLLM reads it falsy)",
        ),
        pytest.param(None, Fallback.NO_PARAMS, id="null (vLLM without a KV connector) → no_params"),
        pytest.param({}, Fallback.BAD_RESPONSE, id="empty object → bad_response"),
        pytest.param([NIXL], Fallback.BAD_RESPONSE, id="a list → bad_response"),
        pytest.param(json.dumps(NIXL), Fallback.BAD_RESPONSE, id="the object as a string → bad_response"),
        pytest.param(
            {**NIXL, "do_remote_prefill": False},
            Fallback.BAD_RESPONSE,
            id="do_remote_prefill false → bad_response",
        ),
        pytest.param(
            {k: v for k, v in NIXL.items() if k != "do_remote_prefill"},
            Fallback.BAD_RESPONSE,
            id="no do_remote_prefill → bad_response",
        ),
        pytest.param(
            {**NIXL, "do_remote_prefill": "true"},
            Fallback.BAD_RESPONSE,
            id='do_remote_prefill "true" → bad_response',
        ),
        pytest.param(
            {**NIXL, "do_remote_decode": True},
            Fallback.BAD_RESPONSE,
            id="do_remote_decode true (the decode worker would hold its KV) → bad_response",
        ),
        pytest.param(
            {**NIXL, "x": nested(MAX_KV_DEPTH - 1)}, None, id="nested to the depth bound → handed on"
        ),
        pytest.param(
            {**NIXL, "x": nested(MAX_KV_DEPTH)}, Fallback.BAD_RESPONSE, id="one level deeper → bad_response"
        ),
        pytest.param(
            # 9 values at the top (NIXL's 8 and x) + 3 block ids = 12; x's fill the bound exactly
            {**NIXL, "x": [0] * (MAX_KV_VALUES - 12)},
            None,
            id="MAX_KV_VALUES values in all → handed on",
        ),
        pytest.param(
            {**NIXL, "x": [0] * (MAX_KV_VALUES - 11)},
            Fallback.BAD_RESPONSE,
            id="one value more → bad_response",
        ),
    ],
)
def test_kv_params_fault(params: Any, fault: Fallback | None) -> None:
    assert kv_params_fault(params) is fault


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("timeout", Fallback.TIMEOUT),
        ("connect_timeout", Fallback.TIMEOUT),
        ("pool_timeout", Fallback.POOL_TIMEOUT),
        ("connect", Fallback.WORKER_ERROR),
        ("protocol", Fallback.WORKER_ERROR),
        ("bad_response", Fallback.BAD_RESPONSE),
    ],
)
def test_fallback_reason_of_a_failure(kind: str, reason: Fallback) -> None:
    assert Fallback.of_failure(kind) is reason


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (429, Fallback.BUSY),
        (500, Fallback.WORKER_ERROR),
        (503, Fallback.WORKER_ERROR),
        (401, Fallback.REFUSED),
        (403, Fallback.REFUSED),
        (404, Fallback.REFUSED),
        (400, Fallback.REFUSED),
        (307, Fallback.REFUSED),
    ],
)
def test_fallback_reason_of_a_status(status: int, reason: Fallback) -> None:
    assert Fallback.of_status(status) is reason


def test_log_throttle_once_per_key_per_period_with_what_it_held_back() -> None:
    now = [0.0]
    throttle = LogThrottle(60.0, lambda: now[0], max_keys=2)
    assert throttle.due("a") == 0  # the first line
    now[0] = 59.0
    assert (throttle.due("a"), throttle.due("a"), throttle.due("b")) == (None, None, 0)  # b: its own
    now[0] = 60.0
    assert throttle.due("a") == 2  # 60 s after its last line, with the 2 held back since
    assert throttle.due("a") is None
    now[0] = 200.0
    assert throttle.due("c") == 0  # a third key over max_keys: a and b, long past, forgotten
    assert throttle._last.keys() == {"c"}


# --------------------------------------------------------------------------------- through the gateway
PD = ("prefill/p:8000", "decode/d:8000")


def fallbacks(gw: Gateway) -> dict[str, float]:
    """mosaic_pd_fallbacks_total by reason (those counted)."""
    return {
        s.labels["reason"]: s.value
        for m in gw.metrics.registry.collect()
        for s in m.samples
        if s.name == "mosaic_pd_fallbacks_total"
    }


def failures(gw: Gateway, worker: str) -> int:
    rec = gw.registry.get(worker)
    assert rec is not None
    return rec.breaker.failures


@pytest.mark.parametrize(
    ("params", "reason", "prefill_failures"),
    [
        pytest.param(NIXL, None, 0, id="vLLM's answer → handed on as it came"),
        pytest.param(
            {**NIXL, "do_remote_decode": True},
            "bad_response",
            1,
            id="do_remote_decode true → decode-only, a prefill fault",
        ),
        pytest.param(
            {**NIXL, "do_remote_prefill": False},
            "bad_response",
            1,
            id="do_remote_prefill false → decode-only",
        ),
        pytest.param(
            {**NIXL, "remote_block_ids": nested(50)}, "bad_response", 1, id="nested 50 deep → decode-only"
        ),
        pytest.param("{}", "bad_response", 1, id="a string → decode-only, a prefill fault"),
        pytest.param(None, "no_params", 0, id="null (no KV connector) → decode-only, no fault"),
    ],
)
def test_the_decode_hop_gets_only_checked_params(
    params: Any, reason: str | None, prefill_failures: int
) -> None:
    """The prefill answer's `kv_transfer_params` went to the decode worker whenever they were a non-empty
    object: `do_remote_decode: true` among them made the decode worker hold its own KV for nobody."""
    p, d = FakeWorker("p", mode="kv_params", kv_params=params), FakeWorker("d")
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            r = await c.post(CHAT, json=chat(LONG_PROMPT))
            assert r.status_code == 200 and gw.dispatcher.outcomes == {"completed": 1}
            assert len(p.seen) == 1 and len(d.seen) == 1
            assert d.seen[0].get("kv_transfer_params") == (params if reason is None else None)
            assert fallbacks(gw) == ({} if reason is None else {reason: 1})
            assert (failures(gw, PD[0]), failures(gw, PD[1])) == (prefill_failures, 0)

    run(body)


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        pytest.param(CHAT, {"prompt_logprobs": 1}, id="chat prompt_logprobs"),
        pytest.param(CHAT, {"echo": True}, id="chat echo (top_logprobs 0 by default)"),
        pytest.param("/v1/completions", {"echo": True, "logprobs": 2}, id="completions echo + logprobs"),
    ],
)
def test_prompt_logprobs_never_take_the_two_hop_path(path: str, extra: dict[str, Any]) -> None:
    """Prompt logprobs need the prompt run where they are asked: a vLLM 0.32 decode worker loads no KV for
    such a request and recomputes the prompt, so a prefill hop would be paid twice (and a vLLM without that
    guard fails: vLLM issue #50792). The request goes to the decode worker alone; not counted as a fallback,
    and the prefill worker never sees it."""
    p, d = FakeWorker("p"), FakeWorker("d")
    cfg = pd_config(p, d)
    body_ = (
        chat(LONG_PROMPT) if path == CHAT else {"model": "llama-3-8b", "prompt": LONG_PROMPT, "max_tokens": 4}
    )

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            r = await c.post(path, json=body_ | extra)
            assert r.status_code == 200 and gw.dispatcher.outcomes == {"completed": 1}
            assert p.seen == [] and len(d.seen) == 1 and "kv_transfer_params" not in d.seen[0]
            assert fallbacks(gw) == {}
            r = await c.post(path, json=body_)  # the same request without them: two hops
            assert r.status_code == 200 and len(p.seen) == 1
            assert d.seen[1]["kv_transfer_params"]["do_remote_prefill"] is True

    run(body)


def test_a_prefill_answer_over_its_bound_is_not_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill answer was read whole, however long, only to pick its `kv_transfer_params`: now reading
    stops past `MAX_ANSWER_BYTES` (here 200 bytes, under the fake's ~400-byte answer) and the request runs
    decode-only, a fault of the prefill worker's."""
    monkeypatch.setattr("server.dispatch.MAX_ANSWER_BYTES", 200)
    p, d = FakeWorker("p"), FakeWorker("d")
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            r = await c.post(CHAT, json=chat(LONG_PROMPT))
            assert r.status_code == 200 and gw.dispatcher.outcomes == {"completed": 1}
            assert len(p.seen) == 1 and d.seen[0].get("kv_transfer_params") is None
            assert fallbacks(gw) == {"bad_response": 1}
            assert (failures(gw, PD[0]), failures(gw, PD[1])) == (1, 0)

    run(body)


def test_a_full_connection_pool_on_the_prefill_hop_is_not_the_prefill_workers() -> None:
    """A prefill hop that got no connection (the gateway's own pool full: httpx.PoolTimeout from a transport)
    was charged to the prefill worker, which never saw the request; the decode hop charges nobody for it."""
    p, d = FakeWorker("p", mode="pool_timeout"), FakeWorker("d")
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            for i in range(3):
                r = await c.post(CHAT, json=chat(LONG_PROMPT + str(i)))
                assert r.status_code == 200
            assert p.seen == [] and [b.get("kv_transfer_params") for b in d.seen] == [None] * 3
            assert (failures(gw, PD[0]), failures(gw, PD[1])) == (0, 0)
            assert fallbacks(gw) == {"pool_timeout": 3}
            assert gw.metrics.registry.get_sample_value(
                "mosaic_upstream_errors_total", {"worker": PD[0], "kind": "prefill_pool_timeout"}
            ) in (None, 0.0)

    run(body)


@pytest.mark.parametrize(
    ("status", "reason", "prefill_failures"),
    [
        pytest.param(401, "refused", 0, id="401 (wrong api_key_env) → refused, a warning"),
        pytest.param(404, "refused", 0, id="404 (wrong model or path) → refused, a warning"),
        pytest.param(429, "busy", 0, id="429 → busy, no warning"),
        pytest.param(503, "worker_error", 3, id="503 → worker_error, no warning (its breaker hears of it)"),
    ],
)
def test_a_refusing_prefill_pool_is_a_bounded_warning(
    status: int, reason: str, prefill_failures: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill pool answering 401/403/404 (its key, model or path wrong) fell back to decode-only with
    nothing but an info line and an unlabelled counter: P/D silently off. Now counted as `refused` and
    logged as a WARNING, once per worker per minute however many requests it refuses."""
    p, d = FakeWorker("p", mode="status", status=status), FakeWorker("d")
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            for i in range(3):
                r = await c.post(CHAT, json=chat(LONG_PROMPT + str(i)))
                assert r.status_code == 200
            assert fallbacks(gw) == {reason: 3}
            assert failures(gw, PD[0]) == prefill_failures

    with caplog.at_level(logging.INFO, logger="mosaic.dispatch"):
        run(body)
    mine = [r for r in caplog.records if r.name == "mosaic.dispatch"]
    warnings = [r.getMessage() for r in mine if r.levelno >= logging.WARNING]
    if reason == "refused":
        assert len(warnings) == 1, warnings
        assert f"prefill worker {PD[0]} refused the prefill hop with HTTP {status}" in warnings[0]
    else:
        assert warnings == []
    infos = [r for r in mine if r.levelno == logging.INFO and "decode-only" in r.getMessage()]
    assert len(infos) == (2 if reason == "refused" else 3)  # the rest, and every other reason, at INFO


@pytest.mark.parametrize("status", [400, 422])
@pytest.mark.parametrize("decode_serves", [False, True], ids=["decode refuses too", "decode serves it"])
def test_a_prefill_refusal_counts_against_the_pool_only_when_the_decode_worker_serves_the_request(
    status: int, decode_serves: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A 400 or 422 from the prefill hop goes decode-only. When the decode worker refuses the request too, the
    request was invalid: its answer reaches the client and nothing is counted or warned of (every invalid
    request used to count and warn as a misconfigured prefill pool; helper walkthrough, 2026-12-06). When the
    decode worker serves it, the pools are set up apart: counted `refused`, one WARNING."""
    p = FakeWorker("p", mode="status", status=status)
    d = FakeWorker("d") if decode_serves else FakeWorker("d", mode="status", status=status)
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            for i in range(3):
                r = await c.post(CHAT, json=chat(LONG_PROMPT + str(i)))
                assert r.status_code == (200 if decode_serves else status)
                if not decode_serves:
                    assert r.json()["error"]["message"] == f"worker d says {status}"  # the decode worker's
            assert len(p.seen) == 3 and [b.get("kv_transfer_params") for b in d.seen] == [None] * 3
            assert fallbacks(gw) == ({"refused": 3} if decode_serves else {})
            assert (failures(gw, PD[0]), failures(gw, PD[1])) == (0, 0)
            want = "completed" if decode_serves else "worker_rejected"
            assert gw.dispatcher.outcomes == {want: 3}

    with caplog.at_level(logging.INFO, logger="mosaic.dispatch"):
        run(body)
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "mosaic.dispatch" and r.levelno >= logging.WARNING
    ]
    if decode_serves:
        assert len(warnings) == 1 and f"refused the prefill hop with HTTP {status}" in warnings[0], warnings
    else:
        assert warnings == []


def test_a_prefill_pool_without_a_kv_connector_is_a_bounded_warning(caplog: pytest.LogCaptureFixture) -> None:
    p, d = FakeWorker("p", mode="no_kv_params"), FakeWorker("d")
    cfg = pd_config(p, d)

    async def body() -> None:
        async with gateway(cfg, FakeFleet(p, d)) as (c, gw):
            for i in range(2):
                assert (await c.post(CHAT, json=chat(LONG_PROMPT + str(i)))).status_code == 200
            assert fallbacks(gw) == {"no_params": 2}

    with caplog.at_level(logging.INFO, logger="mosaic.dispatch"):
        run(body)
    mine = [r for r in caplog.records if r.name == "mosaic.dispatch"]
    warnings = [r.getMessage() for r in mine if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "answered without kv_transfer_params" in warnings[0], warnings


# ------------------------------------------------------------------------------------ over real sockets
async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    head = b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    writer.write(head % (status, len(body)) + body)
    await writer.drain()


def _metrics() -> bytes:
    return METRICS_TEXT.format(model="llama-3-8b", running=0, generated=0).encode()


@asynccontextmanager
async def _socket_worker(
    stall: bool, connections: list[int], delay_s: float = 0.0, kv_params: Any = None
) -> Any:
    """A worker on 127.0.0.1: /health and /metrics answered; a completion or /tokenize answered whole after
    `delay_s` (`stall`: never, it holds the connection until the gateway closes it), with `kv_params` as its
    `kv_transfer_params` when given. `connections` counts those that sent one."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counted = False
        try:
            while True:
                path, _ = await read_request(reader)
                if path == b"/metrics":
                    await _answer(writer, 200, _metrics())
                    continue
                if not path.endswith((b"/completions", b"/tokenize")):
                    await _answer(writer, 200, b"{}")
                    continue
                if not counted:
                    connections.append(1)
                    counted = True
                if stall:
                    await reader.read()  # until the gateway gives up and closes
                    return
                await asyncio.sleep(delay_s)
                msg = {"role": "assistant", "content": "w0"}
                answer = {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "model": "llama-3-8b",
                    "choices": [{"index": 0, "message": msg, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
                }
                if kv_params is not None:
                    answer["kv_transfer_params"] = kv_params
                await _answer(writer, 200, json.dumps(answer).encode())
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.mark.parametrize(
    ("limits", "status"),
    [
        pytest.param(
            {"first_token_timeout_s": 0.6, "total_timeout_s": 10.0},
            200,
            id="the hop's own bound ends the wait → decode-only, the prefill worker not charged",
        ),
        pytest.param(
            {"first_token_timeout_s": 4.0, "total_timeout_s": 0.6, "max_retries": 0},
            504,
            id="the request's own time-out, swept with the hop's, ends the wait → the prefill worker not charged",
        ),
    ],
)
def test_a_prefill_hop_waiting_for_a_connection_slot_is_not_the_prefill_workers(
    limits: dict[str, Any], status: int
) -> None:
    """At `max_upstream_connections` the prefill hop waits for a connection to the worker; its own bound
    (half the first-token budget) is shorter than the pool's wait (`pool_timeout_s`, the whole of it), so it
    ends that wait with a plain time-out, which was charged to the prefill worker as `prefill_timeout` —
    for a request it never received. Two requests over one connection: the first stalls on the worker (its
    fault), the second never gets the connection (nobody's)."""

    async def body() -> tuple[list[int], dict[str, float], tuple[int, int], list[int]]:
        prefill_conns: list[int] = []
        async with (
            _socket_worker(True, prefill_conns) as p_url,
            _socket_worker(False, []) as d_url,
        ):
            cfg = config(
                {**pool("prefill", "H100", "prefill"), "endpoints": {"static": [p_url]}},
                {**pool("decode", "A100", "decode"), "endpoints": {"static": [d_url]}},
                limits={"max_upstream_connections": 1, **limits},
            )
            app = create_app(cfg)
            gw: Gateway = app.state.gateway
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10
            )
            async with app.router.lifespan_context(app), client as c:
                # the hop's block and the request's expire in one sweep, the first request's and the second's
                # alike: the connection the first one closes can no longer reach the second
                gw.dispatcher.timeouts.period = 1.0
                first = asyncio.create_task(c.post(CHAT, json=chat(LONG_PROMPT + "a")))
                while not prefill_conns:  # the first request holds the only connection
                    await asyncio.sleep(0.01)
                second = await c.post(CHAT, json=chat(LONG_PROMPT + "b"))
                statuses = [(await first).status_code, second.status_code]
                prefill = next(r for r in gw.registry.records() if r.pool.name == "prefill")
                decode = next(r for r in gw.registry.records() if r.pool.name == "decode")
                return (
                    prefill_conns,
                    fallbacks(gw),
                    (prefill.breaker.failures, decode.breaker.failures),
                    statuses,
                )

    conns, fell_back, breakers, statuses = asyncio.run(asyncio.wait_for(body(), 30))
    assert conns == [1]  # the second request's prefill hop never reached the worker
    assert statuses == [status, status]
    assert breakers == (1, 0)  # the first request's stall only
    if status == 200:
        assert fell_back == {"timeout": 1, "pool_timeout": 1}


# ------------------------------------------------------- the decode hop's wait for a connection slot
def _upstream_errors(gw: Gateway, worker: str) -> dict[str, float]:
    """mosaic_upstream_errors_total of `worker` by kind (a counter: a later success does not reset it)."""
    return {
        s.labels["kind"]: s.value
        for m in gw.metrics.registry.collect()
        for s in m.samples
        if s.name == "mosaic_upstream_errors_total" and s.labels["worker"] == worker
    }


def test_a_streams_budget_ending_the_decode_hops_wait_for_a_connection_is_not_the_workers() -> None:
    """At `max_upstream_connections: 1` the decode hop of a P/D stream waits for the connection a whole answer
    holds. Its first-token budget started before the prefill hop (0.5 s of it spent there), so it runs out
    0.5 s before the pool's own `pool_timeout_s` (as long, from the start of the wait) would: that plain
    time-out was classed `timeout` and charged to the decode worker, which never got the request. Now it is a
    `pool_timeout`, as the pool's: no mark, the decode worker excluded, and with no other one a 504 that
    says so."""

    async def body() -> tuple[list[int], int, dict[str, float], dict[str, int], httpx.Response, int]:
        decode_conns: list[int] = []
        async with (
            _socket_worker(False, [], delay_s=0.5, kv_params=NIXL) as p_url,
            _socket_worker(False, decode_conns, delay_s=3.0) as d_url,
        ):
            cfg = config(
                {**pool("prefill", "H100", "prefill"), "endpoints": {"static": [p_url]}},
                {**pool("decode", "A100", "decode"), "endpoints": {"static": [d_url]}},
                # the prefill hop's bound is half of 1.6 s: its 0.5 s answer is in time
                limits={"max_upstream_connections": 1, "first_token_timeout_s": 1.6, "total_timeout_s": 10.0},
            )
            app = create_app(cfg)
            gw: Gateway = app.state.gateway
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10
            )
            async with app.router.lifespan_context(app), client as c:
                # the stream's budget ends 1.6 to 1.65 s after dispatch, the pool's wait 0.5 + 1.6 s after it
                gw.dispatcher.timeouts.period = 0.05
                decode = next(r for r in gw.registry.records() if r.pool.name == "decode")
                whole = asyncio.create_task(c.post(CHAT, json=chat(LONG_PROMPT + "a")))
                while not decode_conns:  # the whole answer's decode hop holds the only connection for 3 s
                    await asyncio.sleep(0.01)
                stream = await c.post(CHAT, json=chat(LONG_PROMPT + "b", stream=True))
                charged = decode.breaker.failures  # before the whole answer's success resets it
                outcomes = dict(gw.dispatcher.outcomes)
                status = (await whole).status_code
                return decode_conns, charged, _upstream_errors(gw, decode.id), outcomes, stream, status

    conns, charged, errors, outcomes, stream, whole = asyncio.run(asyncio.wait_for(body(), 30))
    assert conns == [1]  # the stream's decode hop never reached the worker
    assert (charged, errors) == (0, {})  # was (1, {"timeout": 1.0})
    assert stream.status_code == 504 and outcomes == {"failed_before_first_byte": 1}
    assert "(pool_timeout)" in stream.json()["error"]["message"]
    assert whole == 200


def test_a_whole_answers_budget_ending_the_decode_hops_wait_for_a_connection_is_not_the_workers() -> None:
    """A whole answer's time-out is what is left of its `total_timeout_s` (0.6 s here, under the pool's 4 s):
    ending the wait for the connection a slow /tokenize holds, it was charged `timeout_no_progress` to the
    worker, whose scraped generation counter had not moved — for a request it never got. It still ends 504
    `timed_out` (no time left for a retry), with no mark."""

    async def body() -> tuple[list[int], int, dict[str, float], dict[str, int], httpx.Response, int]:
        conns: list[int] = []
        async with _socket_worker(False, conns, delay_s=1.5) as url:
            cfg = config(
                {**pool("mixed", "A100", "mixed"), "endpoints": {"static": [url]}},
                limits={"max_upstream_connections": 1, "first_token_timeout_s": 4.0, "total_timeout_s": 0.6},
                scrape={"interval_s": 0.1},  # a scrape during the wait: a counter that did not move
            )
            app = create_app(cfg)
            gw: Gateway = app.state.gateway
            client = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=10
            )
            async with app.router.lifespan_context(app), client as c:
                worker = next(iter(gw.registry.records()))
                while worker.stats_at is None:  # scraped once: the request has a progress mark
                    await asyncio.sleep(0.01)
                tokenize = asyncio.create_task(
                    c.post("/tokenize", json={"model": "llama-3-8b", "prompt": "hi"})
                )
                while not conns:  # /tokenize holds the only connection for 1.5 s
                    await asyncio.sleep(0.01)
                answer = await c.post(CHAT, json=chat("hello"))
                charged = worker.breaker.failures
                outcomes = dict(gw.dispatcher.outcomes)
                status = (await tokenize).status_code
                return conns, charged, _upstream_errors(gw, worker.id), outcomes, answer, status

    conns, charged, errors, outcomes, answer, tokenized = asyncio.run(asyncio.wait_for(body(), 30))
    assert conns == [1]  # the completion never reached the worker
    assert (charged, errors) == (0, {})  # was (1, {"timeout_no_progress": 1.0})
    assert answer.status_code == 504 and outcomes == {"timed_out": 1}
    assert tokenized == 200
