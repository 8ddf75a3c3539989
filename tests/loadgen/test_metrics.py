"""Metric definitions (vLLM benchmark_serving's) on streams with known chunk timings."""

from __future__ import annotations

import asyncio
import json
from array import array
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import httpx
import pytest
from rich.console import Console

from loadgen.client import RequestRecord, send_request
from loadgen.console import latency_table, percent_down
from loadgen.metrics import Slo, Stats, compute_metrics
from server.commands.common import table_console


def rec(
    index: int, sent: float, chunks: list[float], out: int, inp: int, *, scheduled: float | None = None
) -> RequestRecord:
    r = RequestRecord(index, sent if scheduled is None else scheduled, inp, out)
    r.slot_s = r.scheduled_s
    r.sent_s = sent
    r.chunk_s = array("d", chunks)
    r.output_tokens = out
    r.success = True
    r.end_s = chunks[-1]
    return r


def failed(index: int, sent: float, end: float, kind: str, inp: int) -> RequestRecord:
    r = RequestRecord(index, sent, inp, 10)
    r.slot_s = r.sent_s = sent
    r.end_s, r.error_type, r.error = end, kind, "boom"
    return r


# Times are binary fractions so that SLO boundaries compare exactly (≤ is inclusive, as in vLLM).
# A: sent 1.0, chunks 1.125 1.1875 1.3125 1.375, 5 tokens (one chunk carries 2):
#    TTFT 125, E2EL 375, TPOT (375 − 125)/(5 − 1) = 62.5, ITL 62.5 125 62.5
# B: sent 2.0, one chunk at 2.25, 1 token: TTFT 250, E2EL 250, no TPOT (0 for goodput), no ITL
# D: sent 0.5, chunks 0.875 1.0 1.125, 3 tokens: TTFT 375, E2EL 625, TPOT 250/2 = 125, ITL 125 125
# C: HTTP 503, excluded from latencies and tokens
RECORDS = [
    rec(0, 1.0, [1.125, 1.1875, 1.3125, 1.375], 5, 100, scheduled=0.998),
    rec(1, 2.0, [2.25], 1, 50),
    failed(2, 0.25, 0.75, "http_503", 1000),
    rec(3, 0.5, [0.875, 1.0, 1.125], 3, 30),
]


def test_latencies_follow_vllm_definitions() -> None:
    m = compute_metrics(RECORDS)
    assert (m.sent, m.completed, m.failed) == (4, 3, 1)
    # TTFT [125, 250, 375]: mean 250; np.percentile linear: p90 at rank 0.9·2 = 1.8 → 250 + 0.8·125 = 350
    assert m.ttft.mean == 250 and m.ttft.median == 250
    assert (m.ttft.p90, m.ttft.p95, m.ttft.p99) == pytest.approx((350, 362.5, 372.5))
    # TPOT [62.5, 125] (B has one token: excluded): mean 93.75, p90 = 62.5 + 0.9·62.5 = 118.75
    assert (m.tpot.count, m.tpot.mean, m.tpot.p90) == (2, 93.75, pytest.approx(118.75))
    # ITL [62.5, 125, 62.5, 125, 125]: mean 100, median 125
    assert (m.itl.count, m.itl.mean, m.itl.median) == (5, 100, 125)
    # E2EL [375, 250, 625]: mean 1250/3
    assert m.e2el.mean == pytest.approx(1250 / 3) and m.e2el.max == 625


def test_input_tokens_are_the_servers_count_when_its_usage_gives_one() -> None:
    """As vLLM's benchmark: a chat template adds tokens the trace's length does not count."""
    with_usage = rec(0, 1.0, [1.125, 1.25], 2, 100)
    with_usage.usage_prompt_tokens = 106
    m = compute_metrics([with_usage, rec(1, 2.0, [2.25], 1, 50)])
    assert m.total_input_tokens == 106 + 50


def test_throughput_counts_completed_requests_over_the_duration() -> None:
    m = compute_metrics(RECORDS)
    # the replay's start (0, as vLLM's benchmark clock starts before the first request's delay; the first
    # send, C's, is at 0.25) → B's last chunk (2.25)
    assert m.duration_s == 2.25
    assert m.total_input_tokens == 180 and m.total_output_tokens == 9  # 100 + 50 + 30; 5 + 1 + 3
    assert m.request_throughput == pytest.approx(3 / 2.25)
    assert m.output_throughput == pytest.approx(9 / 2.25)
    assert m.total_token_throughput == pytest.approx(189 / 2.25)
    assert m.errors == {"http_503": 1}


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        pytest.param(
            Slo(ttft_ms=250, tpot_ms=62.5),
            2,
            id="TTFT ≤ 250 and TPOT ≤ 62.5: A and B (B's TPOT counts as 0); D fails",
        ),
        pytest.param(Slo(ttft_ms=375), 3, id="TTFT ≤ 375 inclusive: all three completed"),
        pytest.param(Slo(tpot_ms=62.4), 1, id="TPOT ≤ 62.4: only B (TPOT 0); A is 62.5"),
        pytest.param(Slo(e2el_ms=250), 1, id="E2EL ≤ 250: only B (250, inclusive)"),
    ],
)
def test_goodput_and_slo_attainment(slo: Slo, good: int) -> None:
    m = compute_metrics(RECORDS, slo=slo)
    assert m.goodput == pytest.approx(good / 2.25)  # over the duration from t = 0
    assert m.slo_attainment == pytest.approx(good / 4)  # the failed request misses its SLO


def test_no_slo_means_no_goodput() -> None:
    m = compute_metrics(RECORDS)
    assert m.goodput is None and m.slo_attainment is None


def test_send_lag_and_its_loud_threshold() -> None:
    m = compute_metrics(RECORDS, lag_threshold_ms=1.0)
    # lags: A 1.0 − 0.998 = 2 ms, others 0 → p99 at rank 2.97 of [0, 0, 0, 2] = 0 + 0.97·2 = 1.94 ms
    assert m.send_lag.max == pytest.approx(2.0) and m.send_lag.p99 == pytest.approx(1.94)
    assert m.lag_exceeded
    assert not compute_metrics(RECORDS, lag_threshold_ms=5.0).lag_exceeded


def test_concurrency_wait_is_not_send_lag() -> None:
    r = rec(0, 3.0, [3.5], 1, 1, scheduled=1.0)
    r.slot_s = 2.999  # waited ~2 s for a slot, then sent 1 ms after the slot freed
    assert r.send_lag_s == pytest.approx(0.001)


def test_empty_statistics_are_zero() -> None:
    assert Stats.of_seconds([]).as_dict() == {
        "count": 0,
        "mean": 0,
        "std": 0,
        "median": 0,
        "p90": 0,
        "p95": 0,
        "p99": 0,
        "max": 0,
    }


# ---- the client on scripted streams: a fake clock advanced by the server gives exact chunk times ----


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def scripted(
    clock: FakeClock, events: list[tuple[float, bytes]], status: int = 200
) -> Callable[[httpx.Request], httpx.Response]:
    """A transport handler that streams `events`: before each one, the clock jumps to its time."""

    def handler(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for t, data in events:
                clock.t = t
                yield data

        return httpx.Response(status, content=body(), headers={"content-type": "text/event-stream"})

    return handler


def run_client(
    handler: Callable[[httpx.Request], httpx.Response], clock: FakeClock, timeout: float = 5.0
) -> RequestRecord:
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            r = RequestRecord(0, 0.0, 10, 4)
            return await send_request(client, "http://w/v1/completions", b"{}", {}, r, 100.0, timeout, clock)

    return asyncio.run(go())


def text_chunk(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def test_client_times_chunks_and_reads_usage() -> None:
    clock = FakeClock()
    events = [
        (100.25, sse(text_chunk("a"))),
        (100.3125, sse(text_chunk("b"))),
        (100.4375, sse(text_chunk("cd"))),  # two tokens in one chunk
        (100.5, sse({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4}})),
        (100.5, b"data: [DONE]\n\n"),
    ]
    r = run_client(scripted(clock, events), clock)
    assert r.success and r.output_tokens == 4 and r.usage_prompt_tokens == 10
    # sent at clock 100.0 → 0; TTFT 250 ms; E2EL 437.5 ms (the usage chunk is not content);
    # TPOT (437.5 − 250)/(4 − 1) = 62.5 ms; ITL 62.5, 125
    assert (r.ttft_s, r.e2el_s, r.tpot_s) == (0.25, 0.4375, 0.0625)
    assert r.itls_s() == [0.0625, 0.125]
    m = compute_metrics([r], slo=Slo(ttft_ms=250, tpot_ms=62.5))
    assert m.goodput == 2.0  # 1 good request / duration 0.5 s (the end of the request)


def test_chat_role_chunk_counts_as_first_chunk_like_vllm() -> None:
    clock = FakeClock()
    events = [
        (100.1, sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
        (100.3, sse({"choices": [{"index": 0, "delta": {"content": "x"}}]})),
        (100.4, b"data: [DONE]\n\n"),
    ]
    r = run_client(scripted(clock, events), clock)
    # no usage: one token per content chunk → 2 tokens; TTFT 100 ms at the role chunk
    assert r.success and r.output_tokens == 2 and r.ttft_s == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("events", "status", "kind", "message"),
    [
        pytest.param(
            [(100.1, b'{"error": {"message": "model is busy", "type": "x", "param": null, "code": 503}}')],
            503,
            "http_503",
            "model is busy",
            id="HTTP 503 with an OpenAI error body → http_503 and its message",
        ),
        pytest.param(
            [
                (100.1, sse(text_chunk("a"))),
                (100.2, sse({"error": {"message": "worker died"}})),
                (100.3, b"data: [DONE]\n\n"),
            ],
            200,
            "stream_error",
            "worker died",
            id="error event after streaming began → stream_error",
        ),
        pytest.param(
            [(100.1, sse({"choices": [], "usage": {"completion_tokens": 0}})), (100.2, b"data: [DONE]\n\n")],
            200,
            "no_content",
            "without a content chunk",
            id="stream without content → no_content",
        ),
        pytest.param(
            [(100.1, b"data: {not json\n\n")],
            200,
            "bad_chunk",
            "not JSON",
            id="garbage chunk → bad_chunk",
        ),
    ],
)
def test_failures_have_one_error_type(
    events: list[tuple[float, bytes]], status: int, kind: str, message: str
) -> None:
    clock = FakeClock()
    r = run_client(scripted(clock, events, status), clock)
    assert not r.success and r.error_type == kind and message in (r.error or "")
    assert r.ttft_s is None and r.tpot_s is None and r.itls_s() == []


def test_connect_error_and_timeout() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    r = run_client(refuse, FakeClock())
    assert r.error_type == "connect_error"

    def broken_pipe(request: httpx.Request) -> httpx.Response:
        raise httpx.WriteError("broken pipe", request=request)

    assert run_client(broken_pipe, FakeClock()).error_type == "transport_error"

    def stall(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            yield sse(text_chunk("a"))
            await asyncio.sleep(5)
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=body())

    r = run_client(stall, FakeClock(), timeout=0.05)
    assert r.error_type == "timeout" and not r.success


def test_a_chunk_nested_too_deep_to_decode_fails_that_request_only() -> None:
    """json.loads raises RecursionError, not a decode error, on deep nesting: it escaped send_request and
    the whole replay (every record lost, a traceback). Now it is that request's bad_chunk."""
    clock = FakeClock()
    events = [(100.1, sse(text_chunk("a"))), (100.2, b"data: " + b"[" * 200_000 + b"\n\n")]
    r = run_client(scripted(clock, events), clock)
    assert not r.success and r.error_type == "bad_chunk"


@pytest.mark.parametrize(
    ("fraction", "shown"),
    [(1.0, "100.00%"), (0.99995, "99.99%"), (19_999 / 20_000, "99.99%"), (0.29, "29.00%"), (0.0, "0.00%")],
)
def test_percent_down_never_rounds_a_shortfall_up_to_100(fraction: float, shown: str) -> None:
    assert percent_down(fraction) == shown


def test_the_latency_table_is_whole_when_the_output_is_no_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich sizes a console that is no terminal (a pipe, a CI log) at 80 columns: the 8-column latency table
    of a real replay cut its numbers to `4,151.…`; the commands' table console is wide enough for it."""
    monkeypatch.delenv("COLUMNS", raising=False)
    big = Stats(300, 4_151.31, 0.0, 5_022.54, 6_790.12, 8_168.33, 13_680.27, 37_607.91)
    m = SimpleNamespace(ttft=big, tpot=big, itl=big, e2el=big, send_lag=big)

    def rendered(console: Console) -> str:
        with console.capture() as out:
            console.print(latency_table(m))  # type: ignore[arg-type]
        return out.get()

    assert "…" in rendered(Console())  # what the commands printed before
    text = rendered(table_console())
    assert "…" not in text and "37,607.91" in text and "13,680.27" in text
