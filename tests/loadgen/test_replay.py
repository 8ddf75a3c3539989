"""Replay end to end against an in-process fake worker (httpx.ASGITransport): counts and lengths exact."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from loadgen import runner
from loadgen.formats import open_trace
from loadgen.metrics import Slo
from loadgen.prompts import BLOCK_TOKENS
from loadgen.replay import ReplayError, ReplayRequest, run_replay_async
from loadgen.report import SCHEMA, load_report
from loadgen.runner import RunOptions, RunResult, Target, replay
from loadgen.schedule import ScheduledRequest, ScheduleOptions, schedule
from loadgen.trace import TraceError
from tests.loadgen.loadgen_fakes import FakeWorker

FIX = Path(__file__).parent / "fixtures"
SPEC = "synthetic:rate=400,n=25,arrival=constant,input=uniform:5:60,output=uniform:1:9,seed=3"


def run(req: ReplayRequest, worker: FakeWorker) -> object:
    transport = httpx.ASGITransport(app=worker.app())
    console = Console(file=open("/dev/null", "w"), force_terminal=False)  # noqa: SIM115 - closed below
    try:
        return asyncio.run(run_replay_async(req, console, transport))
    finally:
        console.file.close()


def test_synthetic_replay_sends_every_request_with_exact_lengths(tmp_path: Path) -> None:
    worker = FakeWorker()
    expected = list(open_trace(SPEC))
    out = run(ReplayRequest(SPEC, "http://fake", "m", out=tmp_path / "r.json", progress=False), worker)
    m = out.metrics  # type: ignore[attr-defined]
    assert (m.sent, m.completed, m.failed) == (25, 25, 0)
    assert m.total_input_tokens == sum(r.input_tokens for r in expected)
    assert m.total_output_tokens == sum(r.output_tokens for r in expected)
    assert m.output_length_mismatches == 0
    # the worker saw exactly the trace's prompt lengths and max_tokens, in order
    assert [(len(b["prompt"]), b["max_tokens"], b["ignore_eos"]) for b in worker.received] == [
        (r.input_tokens, r.output_tokens, True) for r in expected
    ]
    report = load_report(tmp_path / "r.json")
    assert report["schema"] == SCHEMA and report["summary"]["completed"] == 25
    assert report["config"]["format"] == "synthetic" and len(report["requests"]) == 25
    assert [row["output_tokens"] for row in report["requests"]] == [r.output_tokens for r in expected]


def test_chat_endpoint_sends_text_of_the_target_length() -> None:
    worker = FakeWorker()
    run(ReplayRequest(SPEC, "http://fake", "m", endpoint="chat", progress=False), worker)
    expected = list(open_trace(SPEC))
    assert [len(b["messages"][0]["content"].split(" ")) for b in worker.received] == [
        r.input_tokens for r in expected
    ]


def test_mooncake_replay_reproduces_shared_prefixes() -> None:
    worker = FakeWorker()
    req = ReplayRequest(
        str(FIX / "mooncake.jsonl"),
        "http://fake",
        "m",
        schedule=ScheduleOptions(rate_scale=100),
        progress=False,
    )
    out = run(req, worker)
    assert out.metrics.completed == 3  # type: ignore[attr-defined]
    a, b, c = (body["prompt"] for body in worker.received)
    assert (len(a), len(b), len(c)) == (1100, 600, 10)
    assert a[:BLOCK_TOKENS] == b[:BLOCK_TOKENS]  # hash id 0 leads both
    assert a[BLOCK_TOKENS:600] != b[BLOCK_TOKENS:600]  # ids 1 vs 3
    assert a[0] != c[0]  # id 4 shares nothing


def test_failures_are_counted_by_type_and_goodput_uses_all_sent() -> None:
    worker = FakeWorker(fail_every=5)
    out = run(ReplayRequest(SPEC, "http://fake", "m", slo=Slo(ttft_ms=60_000), progress=False), worker)
    m = out.metrics  # type: ignore[attr-defined]
    assert m.errors == {"http_503": 5} and m.completed == 20  # requests 5, 10, 15, 20, 25 fail
    assert m.slo_attainment == pytest.approx(20 / 25)


def test_an_undecodable_body_fails_that_request_and_the_replay_goes_on() -> None:
    """A 200 whose gzip body does not decode used to raise out of the replay (traceback, every record lost)."""
    worker = FakeWorker(corrupt_gzip_every=5)
    out = run(ReplayRequest(SPEC, "http://fake", "m", progress=False), worker)
    m = out.metrics  # type: ignore[attr-defined]
    assert m.errors == {"decode_error": 5} and m.completed == 20


def test_chunks_with_a_null_error_field_are_not_failures() -> None:
    worker = FakeWorker(null_error=True)
    out = run(ReplayRequest(SPEC, "http://fake", "m", progress=False), worker)
    m = out.metrics  # type: ignore[attr-defined]
    assert m.errors == {} and m.completed == 25


def count_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[bodies built so far], counted as the replay loop builds them."""
    import loadgen.runner as runner

    built = [0]
    real_build = runner.build_body

    def counting_build(*args: object) -> bytes:
        built[0] += 1
        return real_build(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "build_body", counting_build)
    return built


def test_sends_start_while_the_replay_is_behind_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """All 300 requests are due at once and nothing was built ahead (the opening burst is built before the
    clock starts: `test_the_opening_burst_leaves_together`; here no window, as when the replay falls behind
    mid-run): the first must reach the worker after a few bodies are built, not after all 300 (the loop built
    every overdue body before yielding to the tasks that send them)."""
    monkeypatch.setattr(runner, "PREBUILD_WINDOW_S", 0.0)
    built = count_builds(monkeypatch)
    worker = FakeWorker()
    first_seen: list[int] = []
    handle = worker._handle

    async def recording(body: dict[str, object], chat: bool) -> object:
        if not first_seen:
            first_seen.append(built[0])
        return await handle(body, chat)

    worker._handle = recording  # type: ignore[method-assign]
    spec = "synthetic:rate=1000000,n=300,arrival=constant,input=8,output=1"
    out = run(ReplayRequest(spec, "http://fake", "m", progress=False), worker)
    assert out.metrics.completed == 300  # type: ignore[attr-defined]
    assert first_seen and first_seen[0] < 30, first_seen


def test_the_opening_burst_leaves_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten requests due at 0: every body is built before the clock starts, so none is built behind its send
    time. Before, the clock started after the first body and the other nine were built one by one after it:
    on the Mooncake trace, whose first ten rows all arrive at 0, lags of 12–35 ms and the lag warning."""
    built = count_builds(monkeypatch)
    at_first_send: list[int] = []

    class Watch:
        def sent(self, rec: object) -> None:
            at_first_send.append(built[0])

        def done(self, rec: object) -> None:
            pass

    sched = [ScheduledRequest(k, 0.0, 8, 2) for k in range(10)]
    transport = httpx.ASGITransport(app=FakeWorker().app())
    asyncio.run(replay(sched, Target("http://fake", "m"), RunOptions(), Watch(), transport))
    assert at_first_send[0] == 10


@pytest.mark.parametrize("concurrency", [1, 2, 4])
def test_a_slot_freed_while_the_loop_waited_for_another_is_concurrency_wait_not_send_lag(
    concurrency: int,
) -> None:
    """Sixteen requests due at once under a limit of n, each taking ~20 ms: every request but the first n
    waits for a slot, and that wait is concurrency wait. Before, only the request the loop blocked on got it:
    those behind, finding a slot that a burst of releases had freed meanwhile, had their whole wait booked
    as send lag (p99 9 s in a replay of 80 requests at --concurrency 4, and the lag warning)."""
    worker = FakeWorker(step_s=0.01)  # two tokens: ~20 ms per request
    sched = [ScheduledRequest(k, 0.0, 8, 2) for k in range(16)]
    transport = httpx.ASGITransport(app=worker.app())
    opts = RunOptions(concurrency=concurrency)
    result = asyncio.run(replay(sched, Target("http://fake", "m"), opts, None, transport))
    records = sorted(result.records, key=lambda r: r.index)
    assert all(r.success for r in records) and worker.max_in_flight <= concurrency
    assert max(r.send_lag_s for r in records) < 0.01
    waits = [r.slot_s - r.scheduled_s for r in records]
    assert waits[:concurrency] == [0.0] * concurrency and min(waits[concurrency:]) > 0.01
    # a request's slot came free when an earlier one ended, never after it was sent
    ends = sorted(r.end_s for r in records)
    for k, r in enumerate(records[concurrency:]):
        assert r.slot_s == pytest.approx(ends[k], abs=0.005) and r.slot_s <= r.sent_s


def test_window_and_max_requests_on_a_timed_trace() -> None:
    worker = FakeWorker()
    # azure fixture arrivals 0, 0.3, 1.5, 1.5: the window [0.3, 1.6) keeps 3, the cap keeps 2
    opts = ScheduleOptions(start_s=0.3, duration_s=1.3, max_requests=2, rate_scale=50)
    out = run(
        ReplayRequest(str(FIX / "azure_2023.csv"), "http://fake", "m", schedule=opts, progress=False), worker
    )
    assert [len(b["prompt"]) for b in worker.received] == [396, 879]
    assert [r.trace_line for r in out.result.records] == [3, 4]  # type: ignore[attr-defined]


def test_a_bad_row_mid_replay_stops_it_with_file_and_line() -> None:
    worker = FakeWorker()
    req = ReplayRequest(
        str(FIX / "azure_bad_tokens.csv"),
        "http://fake",
        "m",
        schedule=ScheduleOptions(rate_scale=1000),
        progress=False,
    )
    with pytest.raises(TraceError, match=r"azure_bad_tokens\.csv:3:"):
        run(req, worker)
    skip = ReplayRequest(
        req.trace, req.url, req.model, schedule=req.schedule, skip_bad_rows=True, progress=False
    )
    out = run(skip, worker)
    assert out.report["trace"]["skipped_bad_rows"] == 5  # type: ignore[attr-defined]


def test_plots_are_written(tmp_path: Path) -> None:
    out = run(
        ReplayRequest(SPEC, "http://fake", "m", plot_dir=tmp_path / "plots", progress=False), FakeWorker()
    )
    names = sorted(p.name for p in out.plots)  # type: ignore[attr-defined]
    assert names == ["latency_cdf.png", "timeline.png"]
    for p in out.plots:  # type: ignore[attr-defined]
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_report_is_strict_json(tmp_path: Path) -> None:
    run(ReplayRequest(SPEC, "http://fake", "m", out=tmp_path / "r.json", progress=False), FakeWorker())
    json.loads(
        (tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")
    )


def test_concurrency_bounds_requests_in_flight_and_reports_the_wait() -> None:
    worker = FakeWorker(step_s=0.01)  # 10 ms per token: a request holds its slot 10–90 ms
    out = run(ReplayRequest(SPEC, "http://fake", "m", concurrency=2, progress=False), worker)
    assert out.metrics.completed == 25 and worker.max_in_flight == 2  # type: ignore[attr-defined]
    wait = out.report["summary"]["concurrency_wait_ms"]  # type: ignore[attr-defined]
    # 25 requests arrive within 60 ms; two at a time need Σ output · 10 ms / 2 (≥ 25 · 10 / 2 = 125 ms)
    assert wait["max"] > 100 and out.metrics.send_lag.p99 < wait["max"]  # type: ignore[attr-defined]


def test_a_burst_after_a_quiet_spell_is_built_before_it_is_due(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Real traces send dozens of requests in the same millisecond after seconds of quiet: their bodies
    are built during the quiet, so the burst's first request reaches the worker with all of them ready
    (before, each body was built as its turn came, after the previous send, and the burst's last request
    left tens of milliseconds late)."""
    built = count_builds(monkeypatch)
    trace = tmp_path / "burst.jsonl"
    rows = [{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [0]}]
    rows += [{"timestamp": 300, "input_length": 2000, "output_length": 1, "hash_ids": []} for _ in range(20)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    worker = FakeWorker()
    seen_at: list[int] = []
    handle = worker._handle

    async def recording(body: dict[str, object], chat: bool) -> object:
        seen_at.append(built[0])
        return await handle(body, chat)

    worker._handle = recording  # type: ignore[method-assign]
    out = run(ReplayRequest(str(trace), "http://fake", "m", progress=False), worker)
    assert out.metrics.completed == 21  # type: ignore[attr-defined]
    assert seen_at[1] == 21, seen_at  # the burst's first request: every body already built


def test_requests_waiting_for_a_concurrency_slot_hold_no_task_of_their_own() -> None:
    """A throughput run (a whole trace due at once, concurrency 2) stopped after 0.5 s: only the requests
    that got a slot were sent and recorded. Before, every due request got a task holding its body at once,
    waiting on the semaphore (3,000 tasks here; a 100k-request trace held every body in memory)."""
    spec = "synthetic:rate=100000,n=3000,arrival=constant,input=uniform:5:60,output=uniform:1:9,seed=3"
    worker = FakeWorker(step_s=0.05)  # 50 ms per token: ≥ 50 ms a request, two at a time

    handle = worker._handle

    async def main() -> RunResult:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def first_send_starts_the_clock(body: dict[str, object], chat: bool) -> object:
            # 0.5 s from the first send: the opening burst's 3,000 bodies are built before it (~0.3 s here),
            # and a timer started before the replay left too little time for three records on a slow machine
            if not worker.received:
                loop.call_later(0.5, stop.set)
            return await handle(body, chat)

        worker._handle = first_send_starts_the_clock  # type: ignore[method-assign]
        loop.call_later(10.0, stop.set)  # bounded even if no request ever reached the worker
        scheduled = schedule(open_trace(spec), ScheduleOptions())
        transport = httpx.ASGITransport(app=worker.app())
        return await replay(
            scheduled, Target("http://fake", "m"), RunOptions(concurrency=2), None, transport, stop
        )

    result = asyncio.run(main())
    assert result.interrupted
    # ≤ 0.5 s / 50 ms · 2 slots = 20 completed, plus the two in flight when it stopped (cancelled)
    assert 2 < len(result.records) <= 22
    assert sum(r.error_type == "cancelled" for r in result.records) <= 2
    assert len(worker.received) == len(result.records) and worker.max_in_flight == 2


def test_an_unreachable_target_stops_the_replay_after_the_first_requests(closed_url: str) -> None:
    """Every request failed to connect, and the whole schedule was played before the replay said so (hours,
    for a real trace). Now it stops once the first 8 to finish all failed to connect: the rest are not sent."""
    sched = [ScheduledRequest(k, k / 200, 8, 2) for k in range(400)]  # 2 s of sends
    result = asyncio.run(replay(sched, Target(closed_url, "m")))
    assert result.gave_up and not result.interrupted
    assert 8 <= len(result.records) < 100
    errors = {r.error_type for r in result.records}
    assert "connect_error" in errors and errors <= {"connect_error", "cancelled"}


def test_a_server_refusing_every_request_stops_the_replay_after_the_first_requests() -> None:
    """A wrong key (401, as a wrong model's 404 or path's 405) fails every request whatever the load: the
    whole schedule was played (hours, for a real trace) and the run exited 0 with an empty measurement."""
    worker = FakeWorker(refuse_status=401)
    sched = [ScheduledRequest(k, k / 200, 8, 2) for k in range(400)]  # 2 s of sends
    result = asyncio.run(
        replay(sched, Target("http://fake", "m"), transport=httpx.ASGITransport(app=worker.app()))
    )
    assert result.gave_up and not result.interrupted
    assert 8 <= len(result.records) < 100
    assert {r.error_type for r in result.records} <= {"http_401", "cancelled"}
    with pytest.raises(
        ReplayError,
        match=r"^http://fake refused the first 8 requests \(http_401\): Unauthorized; the rest were not sent$",
    ):
        run(ReplayRequest(SPEC, "http://fake", "m", progress=False), worker)


def test_one_answer_among_the_first_requests_keeps_the_replay_going() -> None:
    """Only a target that never answered is given up on: a server that fails requests is measured."""
    worker = FakeWorker(fail_every=1)  # every request a 503
    out = run(ReplayRequest(SPEC, "http://fake", "m", progress=False), worker)
    m = out.metrics  # type: ignore[attr-defined]
    assert m.errors == {"http_503": 25} and not out.result.gave_up  # type: ignore[attr-defined]


@pytest.mark.parametrize("concurrency", [None, 1000])
def test_a_stalled_generator_shows_as_send_lag_whatever_the_concurrency_limit(
    concurrency: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop stalls 150 ms building one body: the requests due meanwhile leave late, and that lateness is
    the generator's send lag. With a limit that never binds it was booked as concurrency wait (the slot's
    time was stamped when the loop woke, not when a slot was free) and the lag warning stayed silent."""
    import time as _time

    import loadgen.runner

    real = loadgen.runner.build_body

    def slow(req: ScheduledRequest, *a: object) -> bytes:
        if req.index == 3:
            _time.sleep(0.15)  # a huge body built on the event loop
        return real(req, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(loadgen.runner, "build_body", slow)
    monkeypatch.setattr(
        loadgen.runner, "PREBUILD_WINDOW_S", 0.0
    )  # built as each comes due: the stall is mid-run
    sched = [ScheduledRequest(k, k * 0.001, 8, 2) for k in range(10)]  # due before the body can be built
    transport = httpx.ASGITransport(app=FakeWorker().app())
    result = asyncio.run(
        replay(sched, Target("http://fake", "m"), RunOptions(concurrency=concurrency), None, transport)
    )
    lag = max(r.sent_s - r.slot_s for r in result.records)
    wait = max(r.slot_s - r.scheduled_s for r in result.records)
    assert lag > 0.08 and wait == 0.0
