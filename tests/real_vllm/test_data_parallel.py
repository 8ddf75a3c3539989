"""A data-parallel vLLM server (two engines) behind Mosaic: the ledger books each engine and pins each request.

Server: `--data-parallel-size 2 --max-num-seqs 2 --num-gpu-blocks-override 8`: each engine allocates 8 blocks
of 128 tokens (7 usable: one is vLLM's null block) and runs two sequences; `cache_config_info` reports the
server's total, 16, on both engines' rows. Burst (`kv_burst.py`): 8 concurrent requests of 4 blocks each.

- `kv.data_parallel: pooled` books the server as one 16-block worker: floor(16 · 0.98) = 15 → three requests at
  once. vLLM's balancer puts two of them on one engine, where they grow to 4 + 4 = 8 blocks > 7 → preemption.
- `per_engine` (the default): each engine is its own 8-block book (7 reservable), one 4-block request fits per
  engine, so two run at once, one per engine (pinned with `X-data-parallel-rank`), the rest wait in Mosaic's
  queue: zero preemptions, and both engines serve.

The simulated worker configured alike (`sim_dp_url`: `mosaic worker --data-parallel-size 2 --num-gpu-blocks 8
--max-num-seqs 2`) is diffed against it: the same families × engine labels (× finished_reason), the same
cache_config_info rows, the rank header pinning the same engine, and out-of-range ranks refused with the same
bytes; an out-of-range rank on a server without data parallelism too (`real_vllm`, `sim_url`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import vllm_env
from conftest import RealServer
from engine_processes import TRIES, engine_processes, resume, stop_once_running
from kv_burst import BURST, MAX_TOKENS, assert_all_served, run_burst, server_stats
from prometheus_client.parser import text_string_to_metric_families

from server.registry import _engine_stalls
from server.scrape import parse_vllm_metrics

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]
MODEL = vllm_env.SERVED_MODEL_NAME  # what the real servers and the simulated workers serve
RANK = "X-data-parallel-rank"


def test_the_scrape_splits_the_servers_blocks_between_its_engines(real_vllm_dp: RealServer) -> None:
    s = server_stats(real_vllm_dp)
    assert (s.engines, s.num_gpu_blocks) == (2, 16)
    assert [(e.rank, e.num_gpu_blocks) for e in s.engine_views] == [(0, 8), (1, 8)]


def test_per_engine_booking_pins_each_request_and_never_preempts(
    real_vllm_dp: RealServer, tmp_path: Path
) -> None:
    before = [e.num_gpu_blocks for e in server_stats(real_vllm_dp).engine_views]
    tokens_before = _generated_per_engine(real_vllm_dp)
    responses, preempted, depth = run_burst({"enabled": True, "mode": "worst_case"}, real_vllm_dp, tmp_path)
    assert_all_served(responses)
    assert preempted == 0
    assert depth >= 3  # two run (one per engine), the other six arrive together and wait in Mosaic
    served = [after - b for after, b in zip(_generated_per_engine(real_vllm_dp), tokens_before, strict=True)]
    assert sum(served) == BURST * MAX_TOKENS and all(n >= MAX_TOKENS for n in served), served
    assert before == [8, 8]


def test_pooled_booking_lets_vllm_overfill_one_engine(real_vllm_dp: RealServer, tmp_path: Path) -> None:
    responses, preempted, _ = run_burst(
        {"enabled": True, "mode": "worst_case", "data_parallel": "pooled"}, real_vllm_dp, tmp_path
    )
    assert_all_served(responses)  # vLLM recomputes preempted requests: they still finish, only later
    assert preempted >= 1


def _generated_per_engine(server: RealServer) -> list[float]:
    return _generated(server.url)


def _generated(url: str) -> list[float]:
    """Each engine's `vllm:generation_tokens_total`, in rank order."""
    with httpx.Client(timeout=30) as http:
        text = http.get(f"{url}/metrics").text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:generation_tokens":
            for sample in family.samples:
                if sample.name == "vllm:generation_tokens_total":
                    totals[sample.labels["engine"]] = sample.value
    return [totals[e] for e in sorted(totals, key=int)]


def _series(url: str) -> tuple[set[tuple[str, str, str]], list[dict[str, str]]]:
    """(every vllm:* family's (name, engine, finished_reason) series, buckets and `_created` aside; the
    cache_config_info rows' engine, num_gpu_blocks and num_gpu_blocks_override)."""
    with httpx.Client(timeout=30) as http:
        text = http.get(f"{url}/metrics").text
    series: set[tuple[str, str, str]] = set()
    rows: list[dict[str, str]] = []
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            series.add(
                (family.name, sample.labels.get("engine", ""), sample.labels.get("finished_reason", ""))
            )
            if family.name == "vllm:cache_config_info":
                rows.append(
                    {k: sample.labels[k] for k in ("engine", "num_gpu_blocks", "num_gpu_blocks_override")}
                )
    return series, rows


def test_the_simulated_dp_worker_exports_the_same_series_per_engine(
    real_vllm_dp: RealServer, sim_dp_url: str
) -> None:
    (real, real_rows), (sim, sim_rows) = _series(real_vllm_dp.url), _series(sim_dp_url)
    sim_families = {name for name, _, _ in sim}
    assert sim_families <= {
        name for name, _, _ in real
    }  # the simulator's families are vLLM's (fidelity.py lists the rest)
    assert sim == {s for s in real if s[0] in sim_families}
    assert {engine for _, engine, _ in sim} == {"0", "1"}
    # both: every engine's row carries the server's 16 blocks and its own override of 8
    expected = [{"engine": e, "num_gpu_blocks": "16", "num_gpu_blocks_override": "8"} for e in "01"]
    assert (
        sorted(real_rows, key=lambda r: r["engine"])
        == sorted(sim_rows, key=lambda r: r["engine"])
        == expected
    )


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_rank_header_pins_the_same_engine(
    real_vllm_dp: RealServer, sim_dp_url: str, rank: int, chat: bool
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": real_vllm_dp.model, "max_tokens": 4, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    moved = []
    for url in (real_vllm_dp.url, sim_dp_url):
        before = _generated(url)
        with httpx.Client(timeout=60) as http:
            for _ in range(2):
                resp = http.post(url + path, json=body, headers={"X-data-parallel-rank": str(rank)})
                assert resp.status_code == 200, resp.text
        moved.append([after - b for after, b in zip(_generated(url), before, strict=True)])
    expected = [8.0 if e == rank else 0.0 for e in range(2)]  # 2 requests × 4 tokens, all on the named engine
    assert moved == [expected, expected]


@pytest.mark.parametrize("rank", ["2", "5", "-1"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_out_of_range_rank_is_refused_alike(
    real_vllm_dp: RealServer, sim_dp_url: str, rank: str, stream: bool
) -> None:
    _assert_refused_alike(real_vllm_dp.url, sim_dp_url, rank, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_server_without_data_parallelism_checks_the_rank_too(
    real_vllm: RealServer, sim_url: str, stream: bool
) -> None:
    _assert_refused_alike(
        real_vllm.url, sim_url, "1", stream
    )  # "data_parallel_rank 1 is out of range [0, 1)."


def _assert_refused_alike(real_url: str, sim_url: str, rank: str, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": stream}
    answers = []
    for url in (real_url, sim_url):
        with httpx.Client(timeout=60) as http:
            resp = http.post(url + "/v1/completions", json=body, headers={"X-data-parallel-rank": rank})
        answers.append(
            (
                resp.status_code,
                resp.headers["content-type"].split(";")[0],
                resp.text if stream else resp.json(),
            )
        )
    real, sim = answers
    assert real == sim
    assert real[0] == (200 if stream else 400) and "is out of range [0, " in str(real[2])


def test_one_hung_engine_is_seen_beside_a_working_one(real_vllm_dp: RealServer) -> None:
    """Engine 1's processes stopped (SIGSTOP) while it streams a request, engine 0 serving on: `/health` says
    200, the server's summed token counters move, and only engine 1's series stand still with its request
    running, which is what the gateway's stuck-engine check reads per engine (`_engine_stalls`). Last in the
    module: the engine is resumed (SIGCONT) and its stream finishes."""
    server = real_vllm_dp
    if server.process is None:
        pytest.skip(
            "the DP server was started elsewhere (MOSAIC_REAL_VLLM_DP_URL): its processes are not ours"
        )
    engine = engine_processes(server.process.pid, "VLLM::EngineCore_DP1")
    assert engine, "no VLLM::EngineCore_DP1 process below the server"
    streamed: list[int] = []

    def stream_on_engine_1() -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers={RANK: "1"}, timeout=120
        ) as answer:
            streamed.extend(1 for line in answer.iter_lines() if line.startswith("data: "))

    def on_engine_0() -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 20}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, headers={RANK: "0"}, timeout=60)
        assert answer.status_code == 200, answer.text

    for _ in range(TRIES):  # until engine 1 is stopped with the request running (`stop_once_running`)
        streamed.clear()
        streaming = threading.Thread(target=stream_on_engine_1)
        streaming.start()
        if stop_once_running(engine, server.url, streaming, engine="1"):
            break
        streaming.join(120)
    else:
        pytest.fail(f"engine 1 was not stopped with its request running in {TRIES} tries")
    try:
        on_engine_0()
        before = parse_vllm_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
        on_engine_0()
        after = parse_vllm_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
        health = httpx.get(f"{server.url}/health", timeout=10).status_code
    finally:
        resume(engine)
        streaming.join(120)
    assert health == 200
    assert after.generation_tokens_total is not None and before.generation_tokens_total is not None
    assert after.generation_tokens_total > before.generation_tokens_total  # the sums move: engine 0 works
    (hung,) = [m for m in after.engine_marks if m.engine == "1"]
    assert hung.num_running == 1
    assert _engine_stalls({}, before, after, 7.0) == {"1": 7.0}
    assert not streaming.is_alive() and len(streamed) > 400  # resumed: 480 tokens and [DONE]
