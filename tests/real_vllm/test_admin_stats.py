"""What Mosaic reads from a real vLLM server's /metrics, as `/admin/workers` shows it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import RealServer
from gateway_harness import MosaicGateway

from server.scrape import parse_vllm_metrics

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


def worker_stats(gateway: MosaicGateway) -> dict[str, Any]:
    (worker,) = gateway.admin_get("/admin/workers")["workers"]
    return dict(worker)


def wait_for(
    gateway: MosaicGateway, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 20.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        worker = worker_stats(gateway)
        if worker["stats"] is not None and pred(worker):
            return worker
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in {timeout_s} s; last: {worker}")
        time.sleep(0.1)


def test_capacity_comes_from_cache_config_info(mosaic_gateway: MosaicGateway, real_vllm: RealServer) -> None:
    worker = wait_for(mosaic_gateway, lambda w: w["state"] == "ready")
    stats = worker["stats"]
    # 1 GiB of KV (VLLM_CPU_KVCACHE_SPACE=1) / (128 tokens x 512 B per token: 2 layers x 2 KV heads x 32 x 2 x 2 B)
    # = 2^30 / 65,536 = 16,384 blocks of 128 tokens.
    assert stats["num_gpu_blocks"] == 16384
    assert stats["block_size"] == 128
    assert stats["engines"] == 1
    assert stats["legacy_names"] == []
    assert worker["url"] == real_vllm.url


def test_counters_match_what_was_served(mosaic_gateway: MosaicGateway, real_vllm: RealServer) -> None:
    # The gateway's counters before, once a scrape of them has caught up with the server's own: a scrape taken
    # before the previous test's last answer was counted would add its tokens to this test's (seen: 30 for 27)
    served = parse_vllm_metrics(httpx.get(f"{real_vllm.url}/metrics", timeout=10).text)
    before = wait_for(
        mosaic_gateway,
        lambda w: all(
            w["stats"][key] == getattr(served, key)
            for key in ("generation_tokens_total", "prompt_tokens_total", "requests_success_total")
        ),
    )["stats"]
    target = mosaic_gateway.target("tiny-llama")
    with target.openai() as client:
        for _ in range(3):
            client.completions.create(
                model="tiny-llama",
                prompt=list(range(200, 232)),
                max_tokens=9,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
    # 3 requests x 9 generated tokens = 27; 3 x 32 prompt ids = 96 (other tests may not run concurrently).
    after = wait_for(
        mosaic_gateway,
        lambda w: w["stats"]["generation_tokens_total"] >= before["generation_tokens_total"] + 27,
    )["stats"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 27
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 96
    assert after["requests_success_total"] - before["requests_success_total"] == 3
    assert after["ttft_count"] - before["ttft_count"] == 3
    assert after["itl_count"] - before["itl_count"] == 3 * 8  # 8 gaps between 9 tokens per request


def busy_burst(gateway: MosaicGateway, requests: int) -> dict[str, Any] | None:
    """Send `requests` concurrent 32 + 480-token completions; return the first /admin/workers entry that shows the
    worker running something, or None if every scrape during the burst missed it."""
    target = gateway.target("tiny-llama")
    threads_done = threading.Event()
    remaining = [requests]
    lock = threading.Lock()

    def one(i: int) -> None:
        # Plain httpx, not the openai SDK: the SDK's first call in a fresh thread is CPU-heavy (client and
        # model construction) and, with four of them holding the GIL on a 2-core machine shared with the
        # server, starved this process's poller until the burst was over.
        body = {
            "model": "tiny-llama",
            "prompt": list(range(300 + i, 332 + i)),
            "max_tokens": 480,
            "ignore_eos": True,
        }
        try:
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {target.api_key}"}) as http:
                resp = http.post(f"{target.base_url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text  # the gateway's error says which cause
        finally:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    threads_done.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    seen = None
    try:
        while seen is None and not threads_done.is_set():
            worker = worker_stats(gateway)
            if worker["stats"] is not None and (worker["stats"]["num_running"] or 0) >= 1:
                seen = worker
            time.sleep(0.05)
    finally:
        for t in threads:
            t.join(timeout=120)
    return seen


def test_running_and_kv_usage_seen_under_load(mosaic_gateway: MosaicGateway) -> None:
    """Four concurrent 32 + 480-token requests (1-4 s on the CPU server) against a 0.25 s scrape interval.
    On a loaded 2-core machine the server's API process may answer no /metrics during a burst (it shares
    the cores with the engine, and one /admin/workers answer then takes seconds): up to ten bursts are sent
    until one poll catches the worker busy."""
    streams = 4
    busy = None
    for _ in range(10):
        busy = busy_burst(mosaic_gateway, streams)
        if busy is not None:
            break
    if busy is None:
        # Seen here (vLLM 0.32 CPU, 2 shared cores): the server's num_requests_running gauge can read 0 at
        # every scrape while requests run, and /admin/workers answers take seconds during a burst. Nothing to
        # check then; the parse itself is checked against the server's own /metrics below.
        pytest.skip("no scrape caught vllm:num_requests_running > 0 during ten bursts on this machine")
    stats = busy["stats"]
    assert 1 <= stats["num_running"] <= streams
    # Each request holds at most ceil(512 / 128) = 4 blocks of 16,384: usage in (0, 16/16384].
    assert 0 < stats["kv_usage"] <= streams * 4 / 16384
    assert stats["num_waiting"] == 0  # 4 sequences are far below max-num-seqs (256 on CPU)
    idle = wait_for(mosaic_gateway, lambda w: w["stats"]["num_running"] == 0)
    assert idle["stats"]["kv_usage"] == 0.0


def test_gateway_parse_equals_direct_parse(mosaic_gateway: MosaicGateway, real_vllm: RealServer) -> None:
    """The scraped stats /admin/workers shows are what `parse_vllm_metrics` reads from the server right now
    (counters may only grow between the two reads; on an idle server they are equal)."""
    # Idle first (nothing in flight at the gateway), then read the server directly, then wait for a gateway
    # scrape that has caught up with that read: an idle server's counters no longer move, so they are equal.
    wait_for(mosaic_gateway, lambda w: w["inflight"]["requests"] == 0 and w["stats"]["num_running"] == 0)
    with httpx.Client(timeout=10) as http:
        direct = parse_vllm_metrics(http.get(f"{real_vllm.url}/metrics").text)
    worker = wait_for(
        mosaic_gateway, lambda w: w["stats"]["generation_tokens_total"] >= direct.generation_tokens_total
    )
    for key in (
        "num_gpu_blocks",
        "block_size",
        "num_running",
        "num_waiting",
        "kv_usage",
        "generation_tokens_total",
        "prompt_tokens_total",
        "preemptions_total",
    ):
        assert worker["stats"][key] == getattr(direct, key), key
