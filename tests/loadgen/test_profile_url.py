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
