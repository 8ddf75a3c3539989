"""`mosaic profile --url` against a simulated worker over HTTP (plumbing: the worker runs 500× real time)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from loadgen.profile_search import SearchConfig
from placement.profiles import load_profile
from server.cli import build_app


def test_profile_url_writes_a_url_profile(worker_url: str, tmp_path: Path) -> None:
    out = tmp_path / "h100.json"
    args = ["profile", "--url", worker_url, "--gpu", "H100", "--model", "llama-3-8b", "--out", str(out)]
    args += ["--input-edges", "1,64", "--output-edges", "2,8", "--slo-tpot-ms", "40", "--min-rate", "5"]
    args += [
        "--max-rate",
        "40",
        "--probe-window-s",
        "0.5",
        "--probe-requests",
        "10",
        "--probe-e2e-factor",
        "0",
    ]
    res = CliRunner().invoke(build_app(), args)
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert (p.source, p.gpu, p.input_edges, p.output_edges) == ("url", "H100-SXM", (1, 64), (2, 8))
    # at 500× real time every probe meets 40 ms, so the search ends at the grid's top: 5 · 1.05^k ≤ 40
    assert p.max_rate[0][0] == round(SearchConfig(5, 40).grid()[-1], 4)
    m = p.measured[0][0] if p.measured else None
    assert m is not None and m.n > 0 and m.tpot_p90_ms is not None and m.tpot_p90_ms < 40
    # a live profile says what runs as each baseline and probe starts (it printed nothing for an hour)
    lines = res.stderr.splitlines()
    assert any(
        line.strip().startswith("in [1,64) × out [2,8): unloaded baseline, 13 requests one at a time")
        for line in lines
    ), lines
    probes = [line for line in lines if ": probing " in line]
    assert probes and all(" req/s, " in line and " requests over " in line for line in probes)


def test_each_probe_sends_its_own_prompts() -> None:
    """The probes of a bucket reuse its lengths and arrival gaps; with the same prompts too, a server with
    prefix caching (vLLM's default) served every probe after the first from its cache (99.6% of prompt
    tokens hit in a review's run). A worker with prefix caching sees no hit across two probes and the
    unloaded baseline."""
    import asyncio
    import threading

    from loadgen.profile_url import url_measure_factory
    from loadgen.profiling import Bucket, ProbePlan
    from loadgen.runner import Target
    from simulator.engine import EngineConfig
    from simulator.worker_app import WorkerConfig
    from simulator.worker_server import start_worker_server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cfg = WorkerConfig(
        gpu="H100", model="llama-3-8b", time_scale=500, engine=EngineConfig(enable_prefix_caching=True)
    )
    worker = asyncio.run_coroutine_threadsafe(start_worker_server(cfg), loop).result(30)
    try:
        plan = ProbePlan(min_window_s=0.2, min_requests=8, e2e_factor=0)
        factory = url_measure_factory(Target(worker.url, "llama-3-8b"), 8192, plan=plan)
        bucket = Bucket(0, 0, 512, 1024, 2, 8)
        measure = factory(bucket)
        assert measure is not None and measure.unloaded_ttft_ms is not None
        for _ in range(2):
            assert measure.measure(20.0).n > 0
        counters = worker.runtime.engine.counters
        assert counters.prefix_cache_queries > 0 and counters.prefix_cache_hits == 0
    finally:
        asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_probe_the_generator_could_not_send_on_time_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server answered every request at once, but the sends fell ever further behind their times (this
    process could not offer the rate): the probe does not pass, where before it was stable with no failure."""
    import loadgen.profile_url as profile_url
    from loadgen.client import RequestRecord
    from loadgen.profiling import Bucket, ProbePlan
    from loadgen.runner import RunOptions, RunResult, Target
    from loadgen.schedule import ScheduledRequest

    def fake_run(lag_per_request_s: float) -> Callable[..., Coroutine[Any, Any, RunResult]]:
        async def replay(
            sched: list[ScheduledRequest],
            target: Target,
            opts: RunOptions,
            observer: object,
            transport: object,
        ) -> RunResult:
            result = RunResult(started_at="")
            for k, req in enumerate(sched):
                rec = RequestRecord(req.index, req.send_at_s, req.input_tokens, req.output_tokens)
                rec.slot_s = req.send_at_s
                rec.sent_s = req.send_at_s + k * lag_per_request_s
                rec.chunk_s.extend([rec.sent_s + 0.01, rec.sent_s + 0.02])
                rec.output_tokens, rec.success, rec.end_s = 2, True, rec.sent_s + 0.02
                result.records.append(rec)
            return result

        return replay

    plan = ProbePlan(min_window_s=2.0, min_requests=10, e2e_factor=0)
    for lag, stable in ((0.0, True), (0.002, False)):  # 0.002 s more per request: ~0.8 s behind at the end
        monkeypatch.setattr(profile_url, "replay", fake_run(lag))
        factory = profile_url.url_measure_factory(Target("http://unused", "m"), 8192, plan=plan)
        measure = factory(Bucket(0, 0, 16, 32, 2, 3))
        assert measure is not None
        m = measure.measure(100.0)
        assert (m.failed, m.stable) == (0, stable), (lag, m)


def test_profile_url_against_nothing_exits_2_at_once(closed_url: str, tmp_path: Path) -> None:
    """Nothing listening: every probe failed and, after all of them (days at the default sizes), the command
    exited 0 with an all-zero profile. A first 1-token request now fails it at once, naming URL and error."""
    out = tmp_path / "p.yaml"
    args = ["profile", "--url", closed_url, "--gpu", "H100", "--model", "llama-3-8b", "--out", str(out)]
    # small probes, so that without the preflight the test ends (in seconds) rather than hangs
    args += ["--input-edges", "1,64", "--output-edges", "2,8", "--min-rate", "5", "--max-rate", "40"]
    args += ["--probe-window-s", "0.2", "--probe-requests", "5", "--probe-e2e-factor", "0"]
    res = CliRunner().invoke(build_app(), args)
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        f"error: cannot profile {closed_url}: a first request (1 output token) failed: "
        "connect_error: All connection attempts failed"
    ]
    assert not out.exists()


def test_preflight_names_the_url_and_the_server_s_refusal() -> None:
    import httpx
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from loadgen.profile_url import ProfileError, preflight
    from loadgen.runner import Target
    from tests.loadgen.loadgen_fakes import FakeWorker

    app = FastAPI()

    @app.post("/v1/completions")
    async def refuse() -> JSONResponse:
        return JSONResponse({"error": {"message": "invalid\nAPI key"}}, status_code=401)

    with pytest.raises(ProfileError) as info:
        preflight(Target("http://fake", "m"), transport=httpx.ASGITransport(app=app))
    assert str(info.value) == (
        "cannot profile http://fake: a first request (1 output token) failed: http_401: invalid API key"
    )
    worker = FakeWorker()
    preflight(Target("http://fake", "m"), transport=httpx.ASGITransport(app=worker.app()))
    assert [(len(b["prompt"]), b["max_tokens"]) for b in worker.received] == [(16, 1)]


def failing_replay(error_types: list[str | None]) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A stand-in for `runner.replay` whose n-th call fails every request with error_types[n] (None: every
    request succeeds)."""
    from loadgen.client import RequestRecord
    from loadgen.runner import RunResult

    calls = iter(error_types)

    async def replay(sched: list[Any], *args: object) -> RunResult:
        error_type = next(calls)
        result = RunResult(started_at="")
        for req in sched:
            rec = RequestRecord(req.index, req.send_at_s, req.input_tokens, req.output_tokens)
            rec.slot_s = rec.sent_s = req.send_at_s
            if error_type is None:
                rec.chunk_s.extend([rec.sent_s + 0.01, rec.sent_s + 0.02])
                rec.output_tokens, rec.success = 2, True
            else:
                rec.error_type, rec.error = error_type, f"{error_type} happened"
            rec.end_s = rec.sent_s + 0.02
            result.records.append(rec)
        return result

    return replay


@pytest.mark.parametrize(
    ("error_type", "fatal"),
    [
        pytest.param("connect_error", True, id="nothing listens any more: fatal"),
        pytest.param("http_404", True, id="404 (unknown model or path): fatal"),
        pytest.param("http_401", True, id="401 (the key): fatal"),
        pytest.param("http_503", False, id="503 is load: that rate fails"),
        pytest.param("timeout", False, id="a timeout is load: that rate fails"),
        pytest.param("http_400", False, id="400 may be the bucket's length (max_model_len): that rate fails"),
    ],
)
def test_a_probe_failing_for_no_load_reason_stops_the_profile(
    monkeypatch: pytest.MonkeyPatch, error_type: str, fatal: bool
) -> None:
    """Every request of a probe refused (or unconnectable) read as "cannot serve this rate": the profile went
    on, probe after probe, to an all-zero file. Now it raises, and the CLI exits 2."""
    import loadgen.profile_url as profile_url
    from loadgen.profiling import Bucket, ProbePlan
    from loadgen.runner import Target

    plan = ProbePlan(min_window_s=1.0, min_requests=5, e2e_factor=0)
    factory = profile_url.url_measure_factory(Target("http://unused", "m"), 8192, plan=plan)
    bucket = Bucket(0, 0, 16, 32, 2, 3)
    monkeypatch.setattr(profile_url, "replay", failing_replay([None, error_type]))  # baseline, then a probe
    measure = factory(bucket)
    assert measure is not None
    if fatal:
        with pytest.raises(
            profile_url.ProfileError, match=rf"every request of the probe of .* failed: {error_type}"
        ):
            measure.measure(10.0)
    else:
        m = measure.measure(10.0)
        assert m.n == 0 and m.failed > 0
    monkeypatch.setattr(profile_url, "replay", failing_replay([error_type]))  # the unloaded baseline
    if fatal:
        with pytest.raises(profile_url.ProfileError, match="every request of the unloaded baseline"):
            factory(bucket)
    else:
        assert factory(bucket) is not None


@pytest.mark.parametrize(
    ("tpot_s", "status", "probed"),
    [
        pytest.param(0.2, 200, False, id="200 ms per token one at a time: misses 100 ms at any rate"),
        pytest.param(0.05, 400, False, id="the server refuses the bucket's lengths (400): 0 at once"),
        pytest.param(0.05, 200, True, id="50 ms per token one at a time: searched"),
    ],
)
def test_a_bucket_that_misses_the_slo_one_request_at_a_time_is_0_without_probing(
    monkeypatch: pytest.MonkeyPatch, tpot_s: float, status: int, probed: bool
) -> None:
    """Reaching 0 by probing down to --min-rate took up to a day of real time (the lowest rates' probes
    are the longest: 300 requests at 0.01 req/s). The unloaded baseline now decides it."""
    import loadgen.profile_url as profile_url
    from loadgen.client import RequestRecord
    from loadgen.profile_search import SearchSlo
    from loadgen.profiling import ProbePlan, profile_grid
    from loadgen.runner import RunOptions, RunResult, Target
    from loadgen.schedule import ScheduledRequest

    calls: list[int] = []

    async def replay(
        sched: list[ScheduledRequest], target: Target, opts: RunOptions, observer: object, transport: object
    ) -> RunResult:
        calls.append(len(sched))
        result = RunResult(started_at="")
        for req in sched:
            rec = RequestRecord(req.index, req.send_at_s, req.input_tokens, req.output_tokens)
            rec.slot_s = rec.sent_s = req.send_at_s
            if status != 200:
                rec.error_type, rec.end_s = f"http_{status}", rec.sent_s
            else:
                rec.chunk_s.extend(rec.sent_s + 0.02 + k * tpot_s for k in range(req.output_tokens))
                rec.output_tokens, rec.success, rec.end_s = req.output_tokens, True, rec.chunk_s[-1]
            result.records.append(rec)
        return result

    monkeypatch.setattr(profile_url, "replay", replay)
    plan = ProbePlan(min_window_s=2.0, min_requests=10, e2e_factor=0)
    factory = profile_url.url_measure_factory(Target("http://unused", "m"), 8192, plan=plan)
    grid = profile_grid([16, 32], [4, 8], factory, SearchSlo(tpot_ms=100), SearchConfig(1.0, 8.0))
    result = grid.results[(0, 0)]
    assert calls[0] == 10 + 3  # the baseline: 10 requests of one token, 3 of them again whole
    if probed:
        assert len(calls) > 1 and result.max_rate > 0 and not result.unloaded_miss
    else:
        assert len(calls) == 1 and (result.max_rate, result.unloaded_miss) == (0.0, True)
