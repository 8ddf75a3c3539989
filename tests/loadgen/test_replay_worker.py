"""Replay end to end over real sockets against the simulated vLLM worker (simulator.worker_server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console

from loadgen.formats import open_trace
from loadgen.metrics import Slo
from loadgen.replay import ReplayOutcome, ReplayRequest, run_replay_async
from loadgen.schedule import ScheduleOptions
from simulator.worker_app import WorkerConfig
from simulator.worker_server import start_worker_server

FIX = Path(__file__).parent / "fixtures"
SPEC = "synthetic:rate=50,n=40,input=uniform:16:400,output=uniform:1:24,seed=11"


def replay_against_worker(make_request: object, time_scale: float = 200.0) -> ReplayOutcome:
    async def go() -> ReplayOutcome:
        worker = await start_worker_server(
            WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=time_scale)
        )
        try:
            with open("/dev/null", "w") as sink:
                return await run_replay_async(make_request(worker.url), Console(file=sink))  # type: ignore[operator]
        finally:
            await worker.stop()

    return asyncio.run(go())


def test_synthetic_replay_counts_and_lengths_are_exact() -> None:
    out = replay_against_worker(
        lambda url: ReplayRequest(SPEC, url, "llama-3-8b", progress=False, slo=Slo(ttft_ms=1e6))
    )
    expected = list(open_trace(SPEC))
    m = out.metrics
    assert (m.sent, m.completed, m.failed) == (40, 40, 0)
    assert m.total_input_tokens == sum(r.input_tokens for r in expected)
    assert m.total_output_tokens == sum(r.output_tokens for r in expected)
    recs = sorted(out.result.records, key=lambda r: r.index)
    # the worker's usage agrees: prompt tokens exact (token-id prompts), output = max_tokens (ignore_eos)
    assert [r.usage_prompt_tokens for r in recs] == [e.input_tokens for e in expected]
    assert [r.output_tokens for r in recs] == [e.output_tokens for e in expected]
    assert [len(r.chunk_s) for r in recs] == [e.output_tokens for e in expected]  # one chunk per token
    assert m.output_length_mismatches == 0 and m.goodput is not None and m.slo_attainment == 1.0


def test_chat_prompt_is_counted_as_target_length_plus_the_template() -> None:
    spec = "synthetic:rate=50,n=5,input=uniform:10:300,output=3,seed=2"
    out = replay_against_worker(
        lambda url: ReplayRequest(spec, url, "llama-3-8b", endpoint="chat", progress=False)
    )
    expected = [e.input_tokens for e in open_trace(spec)]
    # the worker counts ceil(chars / 4); our text has 4·n − 1 characters plus its template
    # "<|user|>\n" + text + "\n" + "<|assistant|>\n" = 24 more characters → n + 6 tokens
    got = [r.usage_prompt_tokens for r in sorted(out.result.records, key=lambda r: r.index)]
    assert got == [n + 6 for n in expected]


def test_mooncake_slice_against_the_worker() -> None:
    out = replay_against_worker(
        lambda url: ReplayRequest(
            str(FIX / "mooncake.jsonl"),
            url,
            "llama-3-8b",
            schedule=ScheduleOptions(rate_scale=10),
            progress=False,
        )
    )
    assert out.metrics.completed == 3
    assert sorted(r.usage_prompt_tokens or 0 for r in out.result.records) == [10, 600, 1100]


def test_replay_through_the_gateway_over_the_embedded_fleet() -> None:
    """The embedded default (P/D H100→A100 and mixed L4 pools) behind the gateway: every request served, exact."""
    from server.embedded import default_config
    from server.runner import start_gateway_server

    spec = "synthetic:rate=40,n=30,input=uniform:16:3000,output=uniform:1:20,seed=5"

    async def go() -> ReplayOutcome:
        gw = await start_gateway_server(default_config(time_scale=200.0), "127.0.0.1", 0)
        try:
            with open("/dev/null", "w") as sink:
                req = ReplayRequest(spec, gw.url, "llama-3-8b", progress=False)
                return await run_replay_async(req, Console(file=sink))
        finally:
            await gw.stop()

    out = asyncio.run(go())
    expected = list(open_trace(spec))
    assert (out.metrics.completed, out.metrics.failed) == (30, 0)
    assert out.metrics.total_input_tokens == sum(e.input_tokens for e in expected)
    assert out.metrics.total_output_tokens == sum(e.output_tokens for e in expected)
    assert out.metrics.output_length_mismatches == 0


def _replay_on_a_pooling_worker(endpoint: str, **options: int) -> ReplayOutcome:
    """`SPEC` replayed at `endpoint` against a simulated pooling worker (`--runner pooling`)."""

    async def go() -> ReplayOutcome:
        worker = await start_worker_server(
            WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=200.0, runner="pooling")
        )
        try:
            with open("/dev/null", "w") as sink:
                req = ReplayRequest(
                    SPEC, worker.url, "llama-3-8b", endpoint=endpoint, progress=False, **options
                )  # type: ignore[arg-type]
                return await run_replay_async(req, Console(file=sink))
        finally:
            await worker.stop()

    return asyncio.run(go())


def test_an_embeddings_replay_against_a_pooling_worker() -> None:
    """`--endpoint embeddings`: each request the trace's input as token ids, answered whole by a pooling
    worker; exact prompt tokens, no output tokens (no length mismatch), TTFT = E2EL, no TPOT or ITL."""
    out = _replay_on_a_pooling_worker("embeddings")
    expected = list(open_trace(SPEC))
    m = out.metrics
    assert (m.sent, m.completed, m.failed) == (40, 40, 0)
    assert m.total_input_tokens == sum(r.input_tokens for r in expected)
    assert (m.total_output_tokens, m.output_length_mismatches) == (0, 0)
    recs = sorted(out.result.records, key=lambda r: r.index)
    assert [r.usage_prompt_tokens for r in recs] == [e.input_tokens for e in expected]
    assert all(r.ttft_s == r.e2el_s and r.ttft_s is not None and r.ttft_s > 0 for r in recs)
    assert all(r.tpot_s is None and r.itls_s() == [] for r in recs)


def test_a_rerank_replay_against_a_pooling_worker() -> None:
    """`--endpoint rerank`: each request the trace's input words as a query and three documents, scored by a
    pooling worker (vLLM's /rerank), answered whole: every document ranked, the words' tokens the worker's
    usage (each text encoded once: an embedding model's scoring), TTFT = E2EL, no output tokens."""
    out = _replay_on_a_pooling_worker("rerank", rerank_documents=3)
    expected = list(open_trace(SPEC))
    m = out.metrics
    assert (m.sent, m.completed, m.failed) == (40, 40, 0)
    assert (m.total_output_tokens, m.output_length_mismatches) == (0, 0)
    recs = sorted(out.result.records, key=lambda r: r.index)
    # three-letter words, one token each by the worker's ceil(characters / 4) (no separator between texts)
    assert [r.usage_prompt_tokens for r in recs] == [e.input_tokens for e in expected]
    assert all(r.ttft_s == r.e2el_s and r.ttft_s is not None and r.ttft_s > 0 for r in recs)
    assert out.report["config"]["rerank_documents"] == 3
