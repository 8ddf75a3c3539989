"""The live autoscaler's observation: exact rates from recorded vLLM /metrics, the busy proxy, gateway-side
latency quantiles, request rate and token means, model-time conversion, and managed-pool counts."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import httpx
import pytest

from scheduler.autoscaler.signals import Observation
from scheduler.fleet import Role, capacity_for
from server.autoscale_signals import SignalReader, quantile
from server.config import HealthConfig, ScrapeConfig
from server.discovery import StaticSource
from server.gateway_signals import RegistrySource
from server.metrics import GatewayMetrics
from server.registry import PoolInfo, Registry

FIXTURES = Path(__file__).parent / "fixtures"
INF = math.inf


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        pytest.param(
            0.9,
            [(0, 0.1, 0), (0.1, 0.2, 5), (0.2, 0.4, 5), (0.4, INF, 0)],
            0.36,
            id="one histogram: 0.2 + 0.2 · (9 − 5) / 5 = 0.36, as histogram_quantile",
        ),
        pytest.param(0.5, [(0, 0.1, 10)], 0.05, id="median of one uniform bucket is its middle"),
        pytest.param(
            0.9, [(0, 1, 5), (1, INF, 5)], 1.0, id="quantile in the +Inf bucket → largest finite bound"
        ),
        pytest.param(0.9, [(0.4, INF, 3)], 0.4, id="everything above the last bound → that bound"),
        pytest.param(
            0.9,
            [(0, 0.1, 5), (0.1, 0.5, 0), (0.5, 1.0, 0), (1.0, INF, 5)],
            1.0,
            id="+Inf bucket above empty finite ones → the largest finite bound, not the top non-empty one",
        ),
        pytest.param(
            0.9,
            [(0, 1, 10), (0, 2, 10)],
            1.6,
            id="mixture of two rescaled histograms: cdf(x) = 10 + 5x on [1, 2] reaches 18 at 1.6",
        ),
        pytest.param(0.9, [(0, 1, 0)], None, id="no samples → None"),
    ],
)
def test_quantile(q: float, buckets: list[tuple[float, float, float]], expected: float | None) -> None:
    got = quantile(q, buckets)
    assert got == (pytest.approx(expected) if expected is not None else None)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _recorded(scrape: dict[str, int]) -> httpx.MockTransport:
    """Workers a and b answer /health, and /metrics with their recorded scrape number `scrape["n"]`."""

    def handler(request: httpx.Request) -> httpx.Response:
        worker = request.url.host
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, text=(FIXTURES / f"worker_{worker}_{scrape['n']}.metrics.txt").read_text())

    return httpx.MockTransport(handler)


async def _observe(desired: dict[str, int]) -> tuple[Observation, Observation]:
    clock = Clock(10.0)
    scrape = {"n": 1}
    metrics = GatewayMetrics()
    metrics.attach_live(
        lambda: [], lambda: {"llama-3-8b": 3}
    )  # the admission queue, as the gateway exports it
    async with httpx.AsyncClient(transport=_recorded(scrape)) as client:
        reg = Registry(ScrapeConfig(stale_after_s=5.0), HealthConfig(), metrics, client=client, clock=clock)
        reg.add_pool(
            PoolInfo("dec", "llama-3-8b", "L4", Role.DECODE, capacity_for("L4", "llama-3-8b")),
            StaticSource(["http://a:8000", "http://b:8000"]),
        )
        reader = SignalReader(reg, 5.0, clock, {"dec": 2.0}, RegistrySource(metrics.registry, clock))
        reg.on_refresh.append(reader.on_scrape)
        await reg.resync("dec")
        await reg.health_once()
        await reg.scrape_once()  # scrape 1 at t = 10
        first = reader.observe(10.0, desired)  # baseline
        # what the gateway measured during the interval
        metrics.received.labels("llama-3-8b").inc(8)
        for _ in range(6):
            metrics.outcomes.labels("llama-3-8b", "completed").inc()
        metrics.prompt_tokens.labels("llama-3-8b").inc(600)
        metrics.generation_tokens.labels("llama-3-8b").inc(1200)
        for value in (0.15,) * 5 + (0.3,) * 5:
            metrics.ttft.labels("llama-3-8b", "dec").observe(value)
        for _ in range(10):
            metrics.itl.labels("llama-3-8b", "dec").observe(0.03)
        for n, t in ((2, 12.0), (3, 14.0)):
            scrape["n"], clock.t = n, t
            await reg.scrape_once()
        second = reader.observe(14.0, desired)
        await reg.stop()
    return first, second


def test_observation_from_recorded_metrics_has_exact_rates() -> None:
    first, obs = asyncio.run(_observe({}))
    assert first.pools["dec"].decode_tokens_per_s == 0.0  # nothing to difference against yet
    pool = obs.pools["dec"]
    assert (pool.ready, pool.starting, pool.draining) == (2, 0, 0)
    # (a: 2000 − 1000 + b: 420 − 300) tokens over 14 − 10 s = 280 tokens/s of wall time; ÷ time scale 2 → 140
    assert pool.decode_tokens_per_s == pytest.approx(140.0)
    # (a: 5000 − 4000 + b: 1100 − 900) / 4 s = 300 / s; ÷ 2 → 150
    assert pool.prompt_tokens_per_s == pytest.approx(150.0)
    assert pool.num_waiting == 1  # the last scrape: a waits 1, b 0
    # busy proxy over scrapes 2 and 3: (a busy, b idle) + (a busy, b busy) = 3 busy of 4 ready samples
    assert pool.gpu_utilization == pytest.approx(0.75)
    assert obs.admission_queue == {"llama-3-8b": 3}
    assert obs.request_rate == pytest.approx(1.0)  # 8 arrived / 4 s = 2 / s; ÷ 2 → 1 request per model-time s
    # lengths from the 6 completed: 600 / 6 = 100 prompt tokens, 1200 / 6 = 200 output tokens
    assert (obs.mean_input_tokens, obs.mean_output_tokens) == (pytest.approx(100.0), pytest.approx(200.0))
    # TTFT: 0.2 + 0.2 · (9 − 5)/5 = 0.36 s of wall time → × 2 = 0.72 s of model time
    assert obs.ttft_p90_s == pytest.approx(0.72)
    # ITL: all 10 gaps in (0.02, 0.04] → 0.02 + 0.02 · 9/10 = 0.038 → × 2 = 0.076
    assert obs.tpot_p90_s == pytest.approx(0.076)


@pytest.mark.parametrize(
    ("desired", "expected"),
    [
        pytest.param(
            3, (2, 1, 0), id="actuator wants 3, 2 ready → 1 counted as starting (arriving capacity)"
        ),
        pytest.param(
            1, (1, 0, 1), id="actuator wants 1, 2 still ready → the surplus one is leaving (draining)"
        ),
    ],
)
def test_managed_pool_counts_follow_the_actuator(desired: int, expected: tuple[int, int, int]) -> None:
    _, obs = asyncio.run(_observe({"dec": desired}))
    pool = obs.pools["dec"]
    assert (pool.ready, pool.starting, pool.draining) == expected
    assert pool.provisioned == desired


async def _starting_etas(cold_start_s: float) -> list[tuple[int, tuple[float, ...]]]:
    """Two ready workers; the actuator's desired count goes 2 → 4 → 5 → 3 over cycles at 10, 25, 40, 55 s."""
    clock = Clock(10.0)
    metrics = GatewayMetrics()
    async with httpx.AsyncClient(transport=_recorded({"n": 1})) as client:
        reg = Registry(ScrapeConfig(stale_after_s=500.0), HealthConfig(), metrics, client=client, clock=clock)
        reg.add_pool(
            PoolInfo("dec", "llama-3-8b", "L4", Role.DECODE, capacity_for("L4", "llama-3-8b")),
            StaticSource(["http://a:8000", "http://b:8000"]),
        )
        reader = SignalReader(
            reg, 500.0, clock, {}, RegistrySource(metrics.registry, clock), cold_start_s=cold_start_s
        )
        await reg.resync("dec")
        await reg.health_once()
        await reg.scrape_once()
        out = []
        for t, desired in ((10.0, 2), (25.0, 4), (40.0, 5), (55.0, 3)):
            clock.t = t
            pool = reader.observe(t, {"dec": desired}).pools["dec"]
            out.append((pool.starting, pool.starting_ready_in_s))
        await reg.stop()
    return out


def test_starting_instances_get_ready_estimates_from_the_cold_start() -> None:
    # raised to 4 after the cycle at 10 s: two started then, ready at 70 s; one more after 25 s (ready at 85 s);
    # cut from 5 to 3 after 40 s: the two newest starting instances are cancelled first (as the actuators pick
    # them), so the one still starting is one of 10 s, ready at 70 s (it was read as the newest's, 85 s)
    assert asyncio.run(_starting_etas(60.0)) == [
        (0, ()),
        (2, (45.0, 45.0)),
        (3, (30.0, 30.0, 45.0)),
        (1, (15.0,)),
    ]


def test_without_a_cold_start_there_are_no_estimates() -> None:
    assert [etas for _, etas in asyncio.run(_starting_etas(0.0))] == [(), (), (), ()]


def test_a_worker_that_left_since_the_last_cycle_still_counts_its_tokens() -> None:
    """A worker whose drain finished between two cycles is gone from the registry at the second: what it
    decoded since the first cycle's scrape was dropped with it, so every cycle after a scale-in read the
    pool's rate low (toward more scale-in). The simulator adds retired workers' totals; so does this now."""

    async def run() -> Observation:
        clock = Clock(10.0)
        scrape = {"n": 1}
        metrics = GatewayMetrics()
        async with httpx.AsyncClient(transport=_recorded(scrape)) as client:
            reg = Registry(
                ScrapeConfig(stale_after_s=5.0), HealthConfig(), metrics, client=client, clock=clock
            )
            source = StaticSource(["http://a:8000", "http://b:8000"])
            reg.add_pool(
                PoolInfo("dec", "llama-3-8b", "L4", Role.DECODE, capacity_for("L4", "llama-3-8b")), source
            )
            reader = SignalReader(reg, 5.0, clock, {}, RegistrySource(metrics.registry, clock))
            reg.on_refresh.append(reader.on_scrape)
            await reg.resync("dec")
            await reg.health_once()
            await reg.scrape_once()
            reader.observe(10.0, {})  # baseline at t = 10
            for n, t in ((2, 12.0), (3, 14.0)):
                scrape["n"], clock.t = n, t
                await reg.scrape_once()
            source._endpoints = source._endpoints[:1]  # b has drained and left
            await reg.resync("dec")
            obs = reader.observe(14.0, {})
            await reg.stop()
        return obs

    pool = asyncio.run(run()).pools["dec"]
    assert pool.ready == 1
    # a: 2000 − 1000 and b (gone): 420 − 300 tokens over 14 − 10 s = 280 / s (a alone would read 250)
    assert pool.decode_tokens_per_s == pytest.approx(280.0)
    assert pool.prompt_tokens_per_s == pytest.approx((1000 + 200) / 4)
