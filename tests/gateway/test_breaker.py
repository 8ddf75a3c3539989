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


def _one_worker(
    health: HealthConfig, clock: list[float]
) -> tuple[dict[str, bool], httpx.AsyncClient, Registry]:
    """A registry of one worker, http://w:1, whose /health answers 200 while `up["ok"]`, else refuses."""
    up = {"ok": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if not up["ok"]:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text="")

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    reg = Registry(ScrapeConfig(), health, GatewayMetrics(), client=client, clock=lambda: clock[0])
    reg.add_pool(
        PoolInfo("p", "llama-3-8b", "L4", Role.MIXED, capacity_for("L4", "llama-3-8b")),
        StaticSource(["http://w:1"]),
    )
    return up, client, reg


def test_registry_ejects_and_probes_a_worker_back() -> None:
    async def run() -> None:
        clock = [100.0]
        up, client, reg = _one_worker(HealthConfig(open_s=5.0), clock)
        await reg.resync("p")
        await reg.health_once()
        (view,) = reg.view().workers
        assert view.state is WorkerState.READY and not view.breaker_open
        for _ in range(3):  # three timeouts (the threshold): ejected, backed off for open_s
            reg.report_failure("p/w:1", "timeout")
        assert reg.view().workers[0].breaker_open
        clock[0] += 4.9
        await reg.health_once()  # not yet probe-able: no probe sent, still open
        assert reg.view().workers[0].breaker_open
        clock[0] += 0.2
        await reg.health_once()  # probe succeeds → closed
        (view,) = reg.view().workers
        assert not view.breaker_open and view.state is WorkerState.READY
        # a refused connection (nothing listens: restarting): every health round probes, whatever the backoff
        up["ok"] = False
        reg.report_failure("p/w:1", "connect", hard=True)  # passive ejection on a refused dispatch
        for _ in range(3):
            clock[0] += 1.0
            await reg.health_once()  # refused probes: open, backoff growing
        assert reg.view().workers[0].breaker_open
        up["ok"] = True  # it listens again
        clock[0] += 1.0  # well inside the backed-off open time (5 · 2³ s)
        await reg.health_once()
        (view,) = reg.view().workers
        assert not view.breaker_open and view.state is WorkerState.READY
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


def test_a_refused_connection_is_probed_at_every_check_a_failing_answer_waits_its_backoff() -> None:
    b = CircuitBreaker(failure_threshold=3, open_s=5.0)
    b.record_failure(0.0, hard=True)
    assert b.probe_due(0.1)  # nothing listens: a probe costs the worker nothing
    b.record_probe(False, 1.0, hard=True)
    assert b.probe_due(1.1) and b.state(1.1) is BreakerState.OPEN  # still refused: next check probes too
    b.record_probe(False, 2.0)  # now it answers, but fails (a timeout, a 5xx): back to the backoff
    assert not b.probe_due(2.1) and b.probe_due(2.0 + 5.0 * 4)  # second re-open: 4 · open_s
    b.record_probe(True, 30.0)
    assert b.state(30.0) is BreakerState.CLOSED and not b.refused


def test_health_transitions_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    """An operator sees a worker go down and come back in the gateway's log (it logged nothing until a request
    hit the dead worker, and nothing when it came back)."""

    async def run() -> None:
        up, client, reg = _one_worker(HealthConfig(failure_threshold=2), [0.0])
        await reg.resync("p")
        await reg.health_once()
        up["ok"] = False
        for _ in range(4):
            await reg.health_once()
        up["ok"] = True
        for _ in range(2):
            await reg.health_once()
        await reg.stop()
        await client.aclose()

    with caplog.at_level("INFO", logger="mosaic.registry"):
        asyncio.run(run())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "worker p/w:1 is" in r.getMessage()]
    assert lines == [
        ("WARNING", "worker p/w:1 is unhealthy: health: connect (2 failed checks)"),
        ("INFO", "worker p/w:1 is healthy again"),
    ]
