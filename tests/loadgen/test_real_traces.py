"""The readers and a replay slice on the real traces in ../shared/data/traces (skipped when absent).

Expected figures are SOURCES.md's statistics for each file.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from loadgen.formats import open_trace
from loadgen.prompts import BLOCK_TOKENS
from loadgen.replay import ReplayOutcome, ReplayRequest, run_replay_async
from loadgen.schedule import ScheduleOptions
from tests.loadgen.loadgen_fakes import FakeWorker


@pytest.fixture(scope="module")
def traces(shared_data: Path) -> Path:
    return shared_data / "traces"


@pytest.mark.parametrize(
    ("name", "fmt", "rows", "mean_in", "mean_out", "span_s"),
    [
        pytest.param("azure_llm_2023_conv.csv", "azure", 19366, 1155, 211, 3502, id="Azure 2023 conversation: 19,366 rows over ~3,502 s"),
        pytest.param("mooncake_fast25_conversation_first4000.jsonl", "mooncake", 4000, 13312, 347, 1302, id="Mooncake conversation: 4,000 rows over ~1,302 s"),
        pytest.param("mooncake_fast25_synthetic_first2000.jsonl", "mooncake", 2000, 12366, 191, 533, id="Mooncake synthetic: 2,000 rows over ~533 s"),
        pytest.param("burstgpt_lengths_sample8000.csv", "burstgpt-lengths", 8000, 363, 57, None, id="BurstGPT length sample: 8,000 rows, no times"),
        pytest.param("sharegpt_val10k_llama2_lengths.csv", "sharegpt-lengths", 10000, 246, 326, None, id="ShareGPT lengths: 10,000 rows, no times"),
    ],
)  # fmt: skip
def test_real_trace_statistics_match_the_sources(
    traces: Path, name: str, fmt: str, rows: int, mean_in: int, mean_out: int, span_s: int | None
) -> None:
    trace = open_trace(traces / name)
    n = total_in = total_out = 0
    last = None
    for r in trace:
        n += 1
        total_in += r.input_tokens
        total_out += r.output_tokens
        last = r.arrival_s
    assert trace.format == fmt and n == rows and trace.stats.skipped_total == 0
    assert round(total_in / n) == pytest.approx(mean_in, abs=1) and round(total_out / n) == pytest.approx(
        mean_out, abs=1
    )
    if span_s is None:
        assert last is None
    else:
        assert last == pytest.approx(span_s, abs=1.0)


def test_mooncake_hash_ids_cover_the_prompt_and_repeat(traces: Path) -> None:
    reqs = list(open_trace(traces / "mooncake_fast25_conversation_first4000.jsonl"))
    assert all(
        len(r.hash_ids) == -(-r.input_tokens // BLOCK_TOKENS) for r in reqs
    )  # one id per 512-token block
    seen: set[int] = set()
    reused = total = 0
    for r in reqs:
        reused += sum(h in seen for h in r.hash_ids)
        total += len(r.hash_ids)
        seen.update(r.hash_ids)
    assert reused / total == pytest.approx(0.33, abs=0.02)  # SOURCES.md: block reuse 0.33 (over both files)


def test_azure_inter_arrival_cv(traces: Path) -> None:
    t = [r.arrival_s or 0.0 for r in open_trace(traces / "azure_llm_2023_conv.csv")]
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.09, abs=0.02)


def replay(req: ReplayRequest, worker: FakeWorker) -> ReplayOutcome:
    async def go() -> ReplayOutcome:
        with open("/dev/null", "w") as sink:
            return await run_replay_async(req, Console(file=sink), httpx.ASGITransport(app=worker.app()))

    return asyncio.run(go())


def test_azure_window_replays_exactly_the_window(traces: Path) -> None:
    path = traces / "azure_llm_2023_conv.csv"
    window = [r for r in open_trace(path) if r.arrival_s is not None and 600 <= r.arrival_s < 610]
    worker = FakeWorker()
    opts = ScheduleOptions(start_s=600, duration_s=10, rate_scale=20)  # 10 trace seconds in 0.5 s
    out = replay(ReplayRequest(str(path), "http://fake", "m", schedule=opts, progress=False), worker)
    assert out.metrics.completed == len(window) > 20
    assert [len(b["prompt"]) for b in worker.received] == [r.input_tokens for r in window]
    assert [b["max_tokens"] for b in worker.received] == [r.output_tokens for r in window]
    # send times are the trace's, shifted to the window and divided by 20
    sched = [rec.scheduled_s for rec in sorted(out.result.records, key=lambda r: r.index)]
    assert sched == pytest.approx([((r.arrival_s or 0) - 600) / 20 for r in window])


def test_mooncake_slice_shares_prefix_blocks_as_the_trace_says(traces: Path) -> None:
    path = traces / "mooncake_fast25_conversation_first4000.jsonl"
    first = list(open_trace(path))[:12]
    worker = FakeWorker()
    opts = ScheduleOptions(max_requests=12, rate_scale=1000)
    replay(ReplayRequest(str(path), "http://fake", "m", schedule=opts, progress=False), worker)
    prompts = {len(b["prompt"]): b["prompt"] for b in worker.received}
    by_len = {r.input_tokens: r for r in first}
    assert len(prompts) == len(by_len) == 12  # distinct lengths: match requests by length
    a, b = by_len[6758], by_len[7322]  # the file's first two rows: hash_ids [0, 1, …] and [0, 14, …]
    assert a.hash_ids[0] == b.hash_ids[0] and a.hash_ids[1] != b.hash_ids[1]
    assert prompts[6758][:BLOCK_TOKENS] == prompts[7322][:BLOCK_TOKENS]
    assert prompts[6758][BLOCK_TOKENS : 2 * BLOCK_TOKENS] != prompts[7322][BLOCK_TOKENS : 2 * BLOCK_TOKENS]


@pytest.mark.parametrize("name", ["burstgpt_lengths_sample8000.csv", "sharegpt_val10k_llama2_lengths.csv"])
def test_length_samples_replay_at_a_fixed_rate(traces: Path, name: str) -> None:
    worker = FakeWorker()
    opts = ScheduleOptions(rate=500, max_requests=30, seed=4)
    out = replay(ReplayRequest(str(traces / name), "http://fake", "m", schedule=opts, progress=False), worker)
    expected = list(open_trace(traces / name))[:30]
    assert out.metrics.completed == 30
    assert [len(b["prompt"]) for b in worker.received] == [r.input_tokens for r in expected]
