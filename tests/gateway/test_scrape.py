"""Scraping vLLM's /metrics: v1 names summed across engines, legacy names, rates, staleness.

Fixtures (`fixtures/*.metrics.txt`) were produced with prometheus_client — the library vLLM exposes its
metrics with — using vLLM's documented families and labels (REFERENCE.md, REAL_VLLM.md): a data-parallel
v1 server with two engines, and a pre-v1 server with the legacy names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler.fleet import EngineView, Role, capacity_for
from server.config import HealthConfig, ScrapeConfig
from server.discovery import StaticSource
from server.metrics import GatewayMetrics
from server.registry import PoolInfo, Registry
from server.scrape import WorkerStats, counter_rate, parse_vllm_metrics

FIXTURES = Path(__file__).parent / "fixtures"


def test_v1_two_engines_sums_counts_and_weights_kv_usage() -> None:
    s = parse_vllm_metrics((FIXTURES / "vllm_v1_two_engines.metrics.txt").read_text())
    assert s.engines == 2
    assert (s.num_running, s.num_waiting) == (12, 2)  # 7 + 5, 2 + 0
    assert s.kv_usage == pytest.approx(0.375)  # (0.5 + 0.25) / 2: each engine's fraction of its own half
    # vLLM repeats the server's total on each engine's cache_config_info row: not summed again
    assert (s.num_gpu_blocks, s.block_size) == (27000, 16)
    assert s.prompt_tokens_total == 200000  # 120000 + 80000
    assert s.generation_tokens_total == 50000
    assert s.preemptions_total == 4
    assert s.requests_success_total == 165  # 90 + 10 + 60 + 5 over finished_reason
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (200000, 4096)
    assert s.itl_count == 1500 and s.mean_itl_s == pytest.approx((1000 * 0.0125 + 500 * 0.015625) / 1500)
    assert s.ttft_count == 165 and s.mean_ttft_s == pytest.approx((100 * 0.05 + 65 * 0.07) / 165)
    assert s.legacy_names == ()


def test_legacy_names_are_read_and_reported() -> None:
    s = parse_vllm_metrics((FIXTURES / "vllm_legacy.metrics.txt").read_text())
    assert s.engines == 0  # no engine label before v1
    assert (s.num_running, s.num_waiting, s.kv_usage) == (4, 1, 0.625)
    assert (s.num_gpu_blocks, s.block_size) == (4000, 16)
    assert (s.prefix_cache_queries_total, s.prefix_cache_hits_total) == (5000, 1000)
    assert s.mean_itl_s == pytest.approx(0.03125)  # 64 observations of 0.03125 s
    assert "vllm:gpu_cache_usage_perc" in s.legacy_names
    assert "vllm:time_per_output_token_seconds_sum" in s.legacy_names


def test_v1_name_wins_when_both_present() -> None:
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.9\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.2\n"
        "# TYPE vllm:gpu_prefix_cache_hits_total counter\nvllm:gpu_prefix_cache_hits_total 50\n"
        "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total 7\n"
    )
    s = parse_vllm_metrics(text)
    assert (s.kv_usage, s.prefix_cache_hits_total) == (0.2, 7)


def test_usage_is_plain_mean_without_block_counts() -> None:
    text = '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.6\n'
    assert parse_vllm_metrics(text).kv_usage == pytest.approx(0.4)  # (0.2 + 0.6) / 2


def test_non_finite_samples_read_as_missing() -> None:
    """A NaN kv_cache_usage_perc made the worker look emptiest to every scorer; a NaN gauge raised in round()."""
    text = (
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} +Inf\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3\n'
    )
    s = parse_vllm_metrics(text)
    assert (s.kv_usage, s.num_running, s.num_waiting) == (None, None, 3)


def test_unrelated_exposition_gives_empty_stats() -> None:
    assert parse_vllm_metrics("# TYPE up gauge\nup 1\n") == WorkerStats()


@pytest.mark.parametrize(
    ("prev", "cur", "dt", "rate"),
    [
        pytest.param(100.0, 300.0, 2.0, 100.0, id="200 tokens over 2 s → 100/s"),
        pytest.param(300.0, 10.0, 1.0, None, id="counter reset (worker restarted) → no rate, never negative"),
        pytest.param(None, 10.0, 1.0, None, id="first scrape → no rate yet"),
        pytest.param(1.0, 2.0, 0.0, None, id="zero interval → no rate"),
    ],
)
def test_counter_rate(prev: float | None, cur: float, dt: float, rate: float | None) -> None:
    assert counter_rate(prev, cur, dt) == rate


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _registry(
    handler: Callable[[httpx.Request], Any], clock: _Clock, scrape: ScrapeConfig, *urls: str
) -> tuple[httpx.AsyncClient, Registry]:
    """A registry of one L4 pool of `urls`, listed, its HTTP answered by `handler` (MockTransport)."""
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    reg = Registry(scrape, HealthConfig(), GatewayMetrics(), client=client, clock=clock)
    info = PoolInfo("p", "llama-3-8b", "L4", Role.MIXED, capacity_for("L4", "llama-3-8b"))
    reg.add_pool(info, StaticSource(list(urls)))
    await reg.resync("p")
    return client, reg


def test_registry_scrapes_rates_and_drops_stale_stats() -> None:
    counts = iter([1000.0, 1300.0])
    alive = {"up": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if not alive["up"]:
            raise httpx.ConnectError("down", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path != "/metrics":  # /v1/models (LoRA adapters): none here
            return httpx.Response(404)
        gen = next(counts)
        return httpx.Response(
            200,
            text=f'# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{{engine="0"}} {gen}\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3\n'
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n',
        )

    async def run() -> None:
        clock = _Clock()
        client, reg = await _registry(handler, clock, ScrapeConfig(stale_after_s=5.0), "http://w1:8000")
        await reg.scrape_once()
        clock.t += 3.0
        await reg.scrape_once()
        v = reg.view().workers[0]
        assert v.num_running == 3
        assert v.generation_tokens_per_s == pytest.approx(100.0)  # (1300 − 1000) / 3 s
        assert v.scrape_age_s == 0.0
        alive["up"] = False
        clock.t += 5.5  # last good scrape is now 5.5 s old > stale_after_s 5
        await reg.scrape_once()
        v = reg.view().workers[0]
        assert v.num_running is None and v.generation_tokens_per_s is None and v.scrape_age_s is None
        # the engine's cache config stays what it was (the KV ledger fell back to the perf model's guess,
        # here 2,183 blocks where the worker has 1,000)
        assert (v.num_gpu_blocks, v.block_size, v.kv_blocks_total) == (1000, 16, 1000)
        await client.aclose()
        await reg.stop()

    asyncio.run(run())


@pytest.mark.parametrize("blocks", ["1e400", "inf", "-5", "abc"])
def test_a_cache_config_count_that_is_no_finite_count_reads_as_missing(blocks: str) -> None:
    """`int(float("inf"))` raised OverflowError, which the registry's scrape did not catch: the round's
    follow-up work (KV tick, admission wake-up, autoscaler sample) was skipped for the whole fleet."""
    text = (
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{blocks}",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3\n'
    )
    s = parse_vllm_metrics(text)
    assert (s.num_gpu_blocks, s.block_size, s.num_waiting) == (None, None, 3)


def test_v1_two_engines_are_kept_per_engine_in_rank_order() -> None:
    s = parse_vllm_metrics((FIXTURES / "vllm_v1_two_engines.metrics.txt").read_text())
    assert s.engine_views == (
        EngineView(rank=0, num_gpu_blocks=13500, kv_usage=0.5, preemptions_total=3),
        EngineView(rank=1, num_gpu_blocks=13500, kv_usage=0.25, preemptions_total=1),
    )


def test_a_real_vllm_dp_server_reports_its_total_blocks_on_every_engine() -> None:
    # recorded from vLLM 0.32 (CPU) `--data-parallel-size 2 --num-gpu-blocks-override 8`: each engine
    # allocates 8 blocks (its log: "CPU KV cache size: 1,024 tokens" at 128 per block), and both rows say 16
    s = parse_vllm_metrics((FIXTURES / "vllm_0_32_dp2.metrics.txt").read_text())
    assert (s.engines, s.num_gpu_blocks, s.block_size) == (2, 16, 128)
    assert [(e.rank, e.num_gpu_blocks, e.kv_usage, e.preemptions_total) for e in s.engine_views] == [
        (0, 8, 0.0, 0.0),
        (1, 8, 0.0, 0.0),
    ]
    assert s.generation_tokens_total == 62  # 22 on engine 0 + 40 on engine 1 (two requests pinned there)


def _engines_text(labels: list[str], blocks: str) -> str:
    lines = ["# TYPE vllm:cache_config_info gauge"]
    lines += [
        f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="{blocks}"}} 1.0'
        for e in labels
    ]
    lines += ["# TYPE vllm:kv_cache_usage_perc gauge"]
    lines += [
        f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} 0.{i + 1}' for i, e in enumerate(labels)
    ]
    return "\n".join(lines) + "\n"


def test_engine_ranks_follow_numeric_label_order_not_text_order() -> None:
    # a server fronting engines 2..11 of a multi-node group: rank = place in label order, by value ("10" > "9")
    views = parse_vllm_metrics(_engines_text(["10", "2", "9", "11"], "400")).engine_views
    assert [(v.rank, v.num_gpu_blocks, v.kv_usage) for v in views] == [
        (0, 100, 0.2),
        (1, 100, 0.3),
        (2, 100, 0.1),
        (3, 100, 0.4),
    ]
    assert views[0].preemptions_total is None  # the family is absent: unknown, not 0


def test_engines_are_not_split_without_the_servers_blocks() -> None:
    one = parse_vllm_metrics(_engines_text(["0"], "500"))
    assert one.engines == 1 and one.engine_views == () and one.num_gpu_blocks == 500  # the worker itself
    unknown = parse_vllm_metrics(_engines_text(["0", "1"], "None"))  # vLLM's "None": blocks unknown
    assert unknown.engines == 2 and unknown.engine_views == () and unknown.num_gpu_blocks is None


def test_lora_load_is_read_from_the_latest_lora_requests_info_series() -> None:
    """vLLM sets `vllm:lora_requests_info` to the current time under each step's labels and never removes an
    old label set: the series with the largest value is the current one, whatever its place in the text."""
    text = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters="chat,sum"} 1.7650000042e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7650000021e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7650000093e+09
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""
    s = parse_vllm_metrics(text)
    assert (s.lora_running, s.lora_waiting, s.max_lora) == (frozenset({"sql", "chat"}), frozenset(), 2)
    assert s.num_running == 2
    none = parse_vllm_metrics('vllm:num_requests_running{engine="0",model_name="m"} 0.0\n')
    assert (none.lora_running, none.lora_waiting, none.max_lora) == (None, None, None)


def test_a_hung_worker_with_an_open_breaker_is_scraped_beside_the_round_not_in_it() -> None:
    """A worker whose breaker is open is scraped only while requests of the gateway's run there (their
    severing waits on whether its token counters move: `progress_at`), and beside the scrape round: its
    hung /metrics must not hold the round, and with it every other worker's stats, for the scrape timeout."""
    gen = {"w2": 0.0}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "w1":  # hung
            await asyncio.sleep(3600)
        gen["w2"] += 10
        return httpx.Response(200, text=f'vllm:generation_tokens_total{{engine="0"}} {gen["w2"]}\n')

    async def run() -> None:
        clock = _Clock()
        client, reg = await _registry(
            handler, clock, ScrapeConfig(timeout_s=5.0), "http://w1:8000", "http://w2:8000"
        )
        hung = next(r for r in reg.records() if r.url == "http://w1:8000")
        for _ in range(
            hung.breaker.failure_threshold
        ):  # open, by timeouts (a refused one is probed each round)
            hung.breaker.record_failure(clock())
        ticket = reg.track(hung.id, 100, False)
        for _ in range(3):  # each round is quick; one scrape of the hung worker is outstanding at a time
            await asyncio.wait_for(reg.scrape_once(), 1.0)
            clock.t += 1.0
        assert hung.side_scraping and len(reg._tasks) == 1
        other = next(r for r in reg.records() if r is not hung)
        assert other.progress_at == clock.t - 1.0  # its counters moved between the last two rounds
        ticket.done()
        await reg.stop()
        await client.aclose()

    asyncio.run(run())
