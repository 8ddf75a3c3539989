"""A data-parallel vLLM server (two engines) behind Mosaic: the ledger books each engine and pins each request.

Server: `--data-parallel-size 2 --max-num-seqs 2 --num-gpu-blocks-override 8`: each engine allocates 8 blocks
of 128 tokens (7 usable: one is vLLM's null block) and runs two sequences; `cache_config_info` reports the
server's total, 16, on both engines' rows. Burst (`kv_burst.py`): 8 concurrent requests of 4 blocks each.

- `kv.data_parallel: pooled` books the server as one 16-block worker: floor(16 · 0.98) = 15 → three requests at
  once. vLLM's balancer puts two of them on one engine, where they grow to 4 + 4 = 8 blocks > 7 → preemption.
- `per_engine` (the default): each engine is its own 8-block book (7 reservable), one 4-block request fits per
  engine, so two run at once, one per engine (pinned with `X-data-parallel-rank`), the rest wait in Mosaic's
  queue: zero preemptions, and both engines serve.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import RealServer
from kv_burst import BURST, MAX_TOKENS, assert_all_served, run_burst, server_stats
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


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
    """Each engine's `vllm:generation_tokens_total`, in rank order."""
    with httpx.Client(timeout=30) as http:
        text = http.get(f"{server.url}/metrics").text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:generation_tokens":
            for sample in family.samples:
                if sample.name == "vllm:generation_tokens_total":
                    totals[sample.labels["engine"]] = sample.value
    return [totals[e] for e in sorted(totals, key=int)]
