"""Defects of the live autoscaling signals and controller found by a review (2026-12-05): the busy proxy
counted draining workers, `static:` targets bypassed the pool bounds, knobs that crash every cycle passed
config load, and the embedded actuator logged a "ready" for a worker stopped during its cold start."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from scheduler.autoscaler.baselines import HpaPolicy
from scheduler.autoscaler.signals import Observation, PoolSpec
from scheduler.fleet import Role, capacity_for
from server.autoscale_signals import SignalReader
from server.config import HealthConfig, ScrapeConfig
from server.discovery import Endpoint
from server.gateway_signals import RegistrySource
from server.metrics import GatewayMetrics
from server.registry import PoolInfo, Registry


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class _Listed:
    """A discovery source listing fixed endpoints."""

    resync_s = None

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self.endpoints = endpoints

    async def start(self) -> None:
        return None

    async def list(self) -> list[Endpoint]:
        return list(self.endpoints)

    async def stop(self) -> None:
        return None


def _metrics(running: int) -> str:
    return (
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:generation_tokens_total{model_name="m"} 0\n'
        'vllm:prompt_tokens_total{model_name="m"} 0\n'
    )


def test_gpu_busy_proxy_leaves_draining_workers_out() -> None:
    """One idle ready worker and one draining worker still finishing 3 streams: the HPA averages its metric
    over ready pods, so the pool reads 0% busy. Before, the draining one counted busy over the one ready
    worker: 100%, and hpa-util at 0.5 bought the scale-in back (2 replicas)."""
    running = {"a": 0, "b": 3}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, text=_metrics(running[request.url.host]))

    async def main() -> Any:
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        clock = _Clock(10.0)
        metrics = GatewayMetrics()
        registry = Registry(
            ScrapeConfig(stale_after_s=60.0), HealthConfig(), metrics, client=client, clock=clock
        )
        source = _Listed(
            [Endpoint("a:8000", "http://a:8000"), Endpoint("b:8000", "http://b:8000", terminating=True)]
        )
        registry.add_pool(
            PoolInfo("dec", "llama-3-8b", "L4", Role.DECODE, capacity_for("L4", "llama-3-8b")), source
        )
        reader = SignalReader(registry, 60.0, clock, {}, RegistrySource(metrics.registry, clock))
        registry.on_refresh.append(reader.on_scrape)
        try:
            await registry.resync("dec")
            await registry.health_once()
            reader.observe(10.0, {})
            for t in (12.0, 14.0):
                clock.t = t
                await registry.scrape_once()
            return reader.observe(14.0, {}).pools["dec"]
        finally:
            await registry.stop()
            await client.aclose()

    pool = asyncio.run(main())
    assert (pool.ready, pool.draining) == (1, 1)
    assert pool.gpu_utilization == 0.0
    spec = PoolSpec("dec", "llama-3-8b", "decode", "L4", 1.0, 1, 8, decode_tps_capacity=100)
    assert HpaPolicy([spec], "gpu_utilization", 0.5).decide(Observation(14.0, {"dec": pool})).targets == {
        "dec": 1
    }


def test_a_worker_stopped_during_its_cold_start_is_never_reported_ready() -> None:
    """Scaled out to 2, then back to 1 within the 1 s cold start: the starting worker is stopped at once.
    Its cold-start timer must not log a "ready" for it afterwards (it did: started, draining, stopped, ready
    on /admin/autoscaler for a worker no longer listed)."""
    import time

    from server.runner import start_gateway_server
    from tests.autoscaling.test_controller import simulated_config

    config = simulated_config(
        enabled=True, actuator="embedded", policy="static:l4=1", interval_s=3600, cold_start_s=1.0
    )

    async def main() -> tuple[list[tuple[str, str]], list[str]]:
        running = await start_gateway_server(config, "127.0.0.1", 0)
        try:
            actuator = running.gateway.autoscaler.actuator.by_pool["l4"]
            actuator.scale("l4", 2, time.monotonic())
            await asyncio.sleep(0.3)
            actuator.scale("l4", 1, time.monotonic())  # the starting worker goes first
            await asyncio.sleep(1.5)  # past its cold start
            async with httpx.AsyncClient(base_url=running.url) as client:
                answer = await client.get("/admin/autoscaler", headers={"Authorization": "Bearer adm"})
            events = [(e["event"], e["worker"]) for e in answer.json()["actuator_events"]]
            return events, [r.id for r in running.gateway.registry.records()]
        finally:
            await running.stop()

    events, listed = asyncio.run(main())
    assert [e for e in events if e[1] == "l4/sim-1"] == [
        ("started", "l4/sim-1"),
        ("draining", "l4/sim-1"),
        ("stopped", "l4/sim-1"),
    ]
    assert listed == ["l4/sim-0"]


KNOB_POOL = {
    "name": "dec",
    "model": "llama-3-8b",
    "gpu": "L4",
    "role": "mixed",
    "min_replicas": 1,
    "max_replicas": 4,
    "endpoints": {"static": ["http://127.0.0.1:9"]},
}


@pytest.mark.parametrize(
    ("knob", "value", "says"),
    [
        ("queue_drain_s", 0, "queue_drain_s must be > 0"),  # a divisor: ZeroDivisionError every cycle
        ("lookahead_s", "30", "lookahead_s must be a number"),  # TypeError every cycle
        ("max_scale_up_step", "4", "max_scale_up_step must be an integer"),  # TypeError at the first scale-up
        ("max_scale_up_step", 2.5, "max_scale_up_step must be an integer"),
        ("max_scale_up_step", -2, "max_scale_up_step must be ≥ 1"),
        # 0: a pool scaled to zero could never come back (the step cap is max(0 + 0, ceil(0 · factor)) = 0)
        ("max_scale_up_step", 0, "max_scale_up_step must be ≥ 1"),
        ("max_scale_up_factor", 0.1, "max_scale_up_factor must be ≥ 1"),  # a "scale-up" from 4 to 2
        ("max_scale_down_fraction", 0, "max_scale_down_fraction must be in (0, 1]"),
        ("moderate_boost", 0.5, "moderate_boost must be ≥ 1"),  # the latency net would remove capacity
        ("scale_down_window_s", -1, "scale_down_window_s must be ≥ 0"),
        ("observed_context", "yes", "observed_context must be true or false"),
        ("utilization_target", True, "utilization_target must be a number"),
    ],
)
def test_policy_knobs_that_would_fail_every_cycle_are_refused_at_load(
    knob: str, value: Any, says: str
) -> None:
    from server.config import ConfigError, validate_config

    config = {"pools": [KNOB_POOL], "autoscaler": {"actuator": "dry-run", "policy": "mosaic", knob: value}}
    with pytest.raises(ConfigError) as caught:
        validate_config(config)
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_knob_given_twice_with_two_values_is_refused() -> None:
    """Flat under `autoscaler:` and under `autoscaler.knobs:`: `knobs` won silently."""
    from server.config import ConfigError, validate_config

    autoscaler = {"actuator": "dry-run", "utilization_target": 0.6, "knobs": {"utilization_target": 0.5}}
    with pytest.raises(ConfigError) as caught:
        validate_config({"pools": [KNOB_POOL], "autoscaler": autoscaler})
    assert str(caught.value) == (
        "config: autoscaler: utilization_target is set both under autoscaler (0.6) and under autoscaler.knobs "
        "(0.5); give it once"
    )
    autoscaler["knobs"] = {"utilization_target": 0.6}  # the same value twice is no conflict
    assert validate_config({"pools": [KNOB_POOL], "autoscaler": autoscaler}).autoscaler.knobs == {
        "utilization_target": 0.6
    }


def test_a_fleet_files_misspelt_knob_names_the_file_and_the_valid_knobs(tmp_path: Any) -> None:
    """It was `autoscaler: AutoscalerConfig.__init__() got an unexpected keyword argument ...`."""
    from simulator.cluster_config import FleetConfigError, load_fleet

    path = tmp_path / "fleet.yaml"
    path.write_text(
        "model: llama-3-8b\nautoscaler: {utilisation_target: 0.5}\n"
        "pools: [{name: l4, gpu: L4, role: mixed, replicas: 1}]\n"
    )
    with pytest.raises(FleetConfigError) as caught:
        load_fleet(path)
    message = str(caught.value)
    assert message.startswith(
        f"{path}: autoscaler: unknown knob 'utilisation_target'; valid: utilization_target, "
    )
    assert "\n" not in message


def test_serve_says_when_its_autoscaler_runs_elsewhere(caplog: pytest.LogCaptureFixture) -> None:
    """`enabled: true` with the kubernetes actuator in `mosaic serve` scales nothing here: it says so."""
    from server.config import validate_config
    from server.gateway import Gateway

    cfg = validate_config(
        {
            "pools": [KNOB_POOL],
            "autoscaler": {
                "enabled": True,
                "actuator": "kubernetes",
                "kubernetes": {"deployments": {KNOB_POOL["name"]: "d"}},
            },
        }
    )
    with caplog.at_level("INFO", logger="mosaic.gateway"):
        gw = Gateway(cfg)
    asyncio.run(gw.stop())
    assert gw.autoscaler is None
    # a WARNING here (no Kubernetes pool: nothing will ever scale them); INFO on the chart's gateway pods
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "mosaic.gateway"] == [
        (
            "WARNING",
            "autoscaler.actuator kubernetes runs in `mosaic autoscale` (the Helm chart's controller), not in "
            "this gateway: this process does not scale the pools",
        )
    ]
