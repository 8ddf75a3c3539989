"""KV pressure on a real vLLM server: without Mosaic's reservation it preempts; with it, it does not.

Server: `--max-num-seqs 2 --num-gpu-blocks-override 8` → `cache_config_info` says 8 blocks of 128 tokens.
vLLM keeps one block as its null block, so 7 hold sequences. Burst: 8 concurrent requests of 200 prompt token
ids + 300 output tokens (`ignore_eos`), 500 tokens = ceil(500 / 128) = 4 blocks each.

- Without reservation (`kv: {enabled: false}`): the burst reaches vLLM; two sequences run, growing to 4 + 4 =
  8 blocks > 7 → vLLM preempts (`vllm:num_preemptions_total` rises; measured 1 preemption per pair).
- With reservation (`kv: {enabled: true, mode: worst_case}`, uniform footprint, capacity from
  `cache_config_info`): capacity = floor(8 · (1 − 0.02 watermark)) = 7 blocks, so one 4-block request is
  admitted at a time and the rest wait in Mosaic's admission queue: zero preemptions, all 8 succeed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import RealServer
from kv_burst import assert_all_served, run_burst

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


def test_without_reservation_the_server_preempts(real_vllm_kv: RealServer, tmp_path: Path) -> None:
    responses, preempted, _ = run_burst({"enabled": False}, real_vllm_kv, tmp_path)
    assert_all_served(responses)  # vLLM recomputes preempted requests: they still finish, only later
    assert preempted >= 1


def test_with_reservation_no_preemption_and_requests_wait_in_mosaic(
    real_vllm_kv: RealServer, tmp_path: Path
) -> None:
    responses, preempted, depth = run_burst({"enabled": True, "mode": "worst_case"}, real_vllm_kv, tmp_path)
    assert_all_served(responses)
    assert preempted == 0
    # One request at a time fits (4 of 7 blocks): the other 7 arrive together and wait in Mosaic's queue.
    assert depth >= 3
