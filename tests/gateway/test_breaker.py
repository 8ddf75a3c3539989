"""Circuit breaker (pure, time passed in) and the registry's probe-back through health checks."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from scheduler.fleet import Role, WorkerState, capacity_for
from server.breaker import BreakerState, CircuitBreaker
from server.config import HealthConfig, ScrapeConfig
from server.discovery import StaticSource
from server.metrics import GatewayMetrics
from server.registry import PoolInfo, Registry


@pytest.mark.parametrize(
    ("events", "state"),
    [
        pytest.param(
            [("fail", 0.0), ("fail", 0.1)], BreakerState.CLOSED, id="2 soft failures < threshold 3 → closed"
        ),
        pytest.param(
            [("fail", 0.0), ("fail", 0.1), ("fail", 0.2)], BreakerState.OPEN, id="3 soft failures → open"
        ),
        pytest.param(
            [("fail", 0.0), ("fail", 0.1), ("ok", 0.2), ("fail", 0.3)],
            BreakerState.CLOSED,
            id="a success resets the count",
        ),
        pytest.param([("hard", 0.0)], BreakerState.OPEN, id="connection refused → open at once"),
        pytest.param(
            [("hard", 0.0), ("tick", 5.0)],
            BreakerState.HALF_OPEN,
            id="after open_s 5 → half-open (probe due)",
        ),
        pytest.param(
            [("hard", 0.0), ("probe_fail", 5.0), ("tick", 14.9)],
            BreakerState.OPEN,
            id="failed probe → open for 2·open_s",
        ),
        pytest.param(
            [("hard", 0.0), ("probe_fail", 5.0), ("tick", 15.0)],
            BreakerState.HALF_OPEN,
            id="… then probe-able again",
        ),
        pytest.param([("hard", 0.0), ("probe_ok", 5.0)], BreakerState.CLOSED, id="successful probe → closed"),
    ],
)
def test_breaker_transitions(events: list[tuple[str, float]], state: BreakerState) -> None:
    b = CircuitBreaker(failure_threshold=3, open_s=5.0)
    now = 0.0
    for kind, now in events:
        if kind == "fail":
            b.record_failure(now)
        elif kind == "hard":
            b.record_failure(now, hard=True)
        elif kind == "ok":
            b.record_success()
        elif kind == "probe_fail":
            b.record_probe(False, now)
        elif kind == "probe_ok":
            b.record_probe(True, now)
    assert b.state(now) is state


def test_registry_ejects_and_probes_a_worker_back() -> None:
    up = {"ok": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if not up["ok"]:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text="")

    async def run() -> None:
        clock = [100.0]
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        reg = Registry(
            ScrapeConfig(), HealthConfig(open_s=5.0), GatewayMetrics(), client=client, clock=lambda: clock[0]
        )
        reg.add_pool(
            PoolInfo("p", "llama-3-8b", "L4", Role.MIXED, capacity_for("L4", "llama-3-8b")),
            StaticSource(["http://w:1"]),
        )
        await reg.resync("p")
        await reg.health_once()
        (view,) = reg.view().workers
        assert view.state is WorkerState.READY and not view.breaker_open
        reg.report_failure("p/w:1", "connect", hard=True)  # passive ejection on a refused dispatch
        assert reg.view().workers[0].breaker_open
        up["ok"] = True
        clock[0] += 4.9
        await reg.health_once()  # not yet probe-able: no probe sent, still open
        assert reg.view().workers[0].breaker_open
        clock[0] += 0.2
        await reg.health_once()  # probe succeeds → closed
        (view,) = reg.view().workers
        assert not view.breaker_open and view.state is WorkerState.READY
        await reg.stop()
        await client.aclose()

    asyncio.run(run())
