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
        pytest.param(
            [("fail", 0.0), ("fail", 0.1), ("first", 0.2), ("fail", 0.3)],
            BreakerState.CLOSED,
            id="a stream's first byte excuses failures that said the worker was unreachable",
        ),
        pytest.param(
            [("stream_fail", 0.0), ("stream_fail", 0.1), ("first", 0.2), ("stream_fail", 0.3)],
            BreakerState.OPEN,
            id="... not streams that broke after they began",
        ),
        # on probation after a probe: one request failure re-opens it, for twice as long
        pytest.param(
            [("fail", 0.0), ("fail", 0.1), ("fail", 0.2), ("probe_ok", 5.2), ("fail", 5.3), ("tick", 15.2)],
            BreakerState.OPEN,
            id="a failure after a probe's success → open again at once, for 2·open_s",
        ),
        pytest.param(
            [("fail", 0.0), ("fail", 0.1), ("fail", 0.2), ("probe_ok", 5.2), ("fail", 5.3), ("tick", 15.3)],
            BreakerState.HALF_OPEN,
            id="… then probe-able again",
        ),
        pytest.param(
            [("hard", 0.0), ("probe_ok", 5.0), ("ok", 5.1), ("fail", 5.2), ("fail", 5.3)],
            BreakerState.CLOSED,
            id="a request's success ends the probation: the threshold counts again",
        ),
        # a failed health check on probation counts toward the threshold, as when closed: an idle gateway
        # never ends its probation, and one slow /health re-opened a worker serving fine for up to 40 s
        pytest.param(
            [("hard", 0.0), ("probe_ok", 5.0), ("check_fail", 7.0), ("check_fail", 9.0)],
            BreakerState.CLOSED,
            id="on probation, failed checks below the threshold leave it closed",
        ),
        pytest.param(
            [
                ("hard", 0.0),
                ("probe_ok", 5.0),
                ("check_fail", 7.0),
                ("check_fail", 9.0),
                ("check_fail", 11.0),
            ],
            BreakerState.OPEN,
            id="... the threshold's worth re-opens it",
        ),
        pytest.param(
            [("check_fail", 0.0), ("check_fail", 2.0), ("check_ok", 4.0), ("check_fail", 6.0)],
            BreakerState.CLOSED,
            id="a passed check excuses the failed checks before it: they were not in a row",
        ),
        pytest.param(
            [("fail", 0.0), ("fail", 0.1), ("check_ok", 2.0), ("fail", 2.1)],
            BreakerState.OPEN,
            id="... not the requests' failures (a /health 200 does not show requests succeed)",
        ),
        pytest.param(
            [("hard", 0.0), ("probe_ok", 5.0), ("check_fail", 7.0), ("fail", 7.5)],
            BreakerState.OPEN,
            id="... and a request's failure still re-opens it at once",
        ),
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
        elif kind == "stream_fail":
            b.record_failure(now, stream=True)
        elif kind == "check_fail":
            b.record_failure(now, check=True)
        elif kind == "check_ok":
            b.record_check_ok()
        elif kind == "first":
            b.record_first_byte()
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


def test_a_worker_failing_requests_but_passing_health_is_kept_out_longer_each_time() -> None:
    """A worker answering /health 200 but failing every request: each probe lets it back on probation, its
    first failed request re-opens it, and the open time doubles up to 8 · open_s. Before, the probe reset the
    backoff and three client requests failed every open_s."""
    b = CircuitBreaker(failure_threshold=3, open_s=5.0)
    for t in (0.0, 0.1, 0.2):
        b.record_failure(t)
    opened, lost = [], 3
    now = 0.2
    for _ in range(5):
        now = b.opened_at + b.open_s * min(8, 2**b.reopens)  # type: ignore[operator]
        assert b.probe_due(now)
        b.record_probe(True, now)
        assert b.state(now) is BreakerState.CLOSED and b.probation
        assert b.record_failure(now + 0.1)  # one client request lost per probe, not failure_threshold
        lost += 1
        opened.append(round(now - 0.2, 1))
    assert b.trips == 6 and lost == 8
    # open for 5, 10, 20, 40, 40 s: the probes come 5, 15.1, 35.2, 75.3, 115.4 s after the first trip
    assert opened == [5.0, 15.1, 35.2, 75.3, 115.4]
    b.record_probe(True, 200.0)
    b.record_success()  # a request succeeded: healthy again, backoff and probation gone
    assert (b.reopens, b.probation, b.failures) == (0, False, 0)


def test_a_worker_failing_every_stream_midway_is_ejected() -> None:
    """Each stream's first byte had reset the worker's breaker count, so its failures never reached the
    threshold: a worker failing every stream after its first tokens stayed in rotation. A stream's success is
    now told at its end: three such streams in a row open the breaker, and the healthy worker takes the rest."""
    from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool
    from tests.gateway.test_faults import CHAT, RR, chat, gateway, run

    broken = FakeWorker("broken", mode="error_mid_stream", die_after=2, tokens=5)
    healthy = FakeWorker("healthy", tokens=5)

    async def body() -> None:
        cfg = config(pool("p", "H100", "mixed", broken, healthy), health={"failure_threshold": 3}, **RR)
        async with gateway(cfg, FakeFleet(broken, healthy)) as (c, gw):
            texts = [(await c.post(CHAT, json=chat(f"q{i}", stream=True))).text for i in range(12)]
            failed = sum('"error"' in t for t in texts)
            assert failed == 3 and len(broken.seen) == 3 and len(healthy.seen) == 9
            (rec,) = [r for r in gw.registry.records() if "broken" in r.url]
            assert rec.breaker.opened_at is not None and rec.breaker.trips == 1

    run(body)


def test_streams_that_begin_excuse_scattered_failed_checks_but_not_broken_streams() -> None:
    """Three isolated failed health checks, a long stream begun after each: the streams' first bytes show the
    worker reachable, so the checks' failures do not add up to an ejection (they did once first bytes stopped
    resetting the count). Failures of streams after they began are not excused by a first byte (the test
    above)."""
    from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool
    from tests.gateway.test_faults import CHAT, chat, gateway, run

    w = FakeWorker("w", tokens=40, chunk_delay_s=0.05)

    async def body() -> None:
        cfg = config(pool("p", "H100", "mixed", w), health={"failure_threshold": 3})
        async with gateway(cfg, FakeFleet(w)) as (c, gw):
            (rec,) = list(gw.registry.records())
            tasks = []
            for i in range(3):
                w.health_ok = False
                await gw.registry.health_once()
                w.health_ok = True
                await gw.registry.health_once()
                tasks.append(
                    asyncio.create_task(c.post(CHAT, json=chat(f"q{i}", stream=True, max_tokens=40)))
                )
                await asyncio.sleep(0.3)  # its first tokens flowed; it has not ended
            assert rec.breaker.trips == 0 and rec.breaker.failures == 0
            assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))

    run(body)


def test_an_idle_gateways_worker_on_probation_survives_one_slow_health_check() -> None:
    """Seen in `make test-vllm` on a loaded machine: a gateway without traffic never ends a worker's probation
    (only a request's success does), and each slow /health re-opened it at once, the backoff doubling to 40 s,
    so the next requests waited out their queue deadline (503). A failed check on probation now counts toward
    the threshold as when closed; three in a row still re-open it, for twice as long."""

    async def run() -> None:
        clock = [100.0]
        answer = {"status": 200}
        client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(answer["status"])))
        reg = Registry(
            ScrapeConfig(), HealthConfig(open_s=5.0), GatewayMetrics(), client=client, clock=lambda: clock[0]
        )
        reg.add_pool(
            PoolInfo("p", "llama-3-8b", "L4", Role.MIXED, capacity_for("L4", "llama-3-8b")),
            StaticSource(["http://w:1"]),
        )
        await reg.resync("p")
        await reg.health_once()
        for _ in range(3):
            reg.report_failure("p/w:1", "timeout")
        clock[0] += 5.0
        await reg.health_once()  # the probe succeeds: closed, on probation
        breaker = reg.records()[0].breaker
        assert not reg.view().workers[0].breaker_open and breaker.probation
        answer["status"] = 503  # /health slow or failing for a moment
        for _ in range(2):
            clock[0] += 2.0
            await reg.health_once()
            assert not reg.view().workers[0].breaker_open  # before: open again at the first
        answer["status"] = 200
        clock[0] += 2.0
        await reg.health_once()
        assert not reg.view().workers[0].breaker_open and breaker.failures == 0
        answer["status"] = 503
        for _ in range(3):  # the threshold's worth in a row: re-opened, the backoff doubled
            clock[0] += 2.0
            await reg.health_once()
        assert reg.view().workers[0].breaker_open and breaker.reopens == 1
        await client.aclose()

    asyncio.run(run())
