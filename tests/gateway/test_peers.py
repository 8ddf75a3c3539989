"""`gateway.peers` (`server.peers`): the KV share follows the gateway replicas listed at run time — smaller at
once when one more is listed, larger again only after `grow_back_after_s` of fewer — and a listing that fails
or lists nobody changes nothing."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from scheduler.kv.ledger import KvLedger, LedgerSettings
from scheduler.routing.reasons import Outcome
from server.app import create_app
from server.config import ConfigError, GatewayPeersConfig
from server.discovery import Endpoint
from server.peers import GatewayPeers, PeerWindow
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool
from tests.kv.kvkit import request, worker

PEERS = {"kubernetes": {"label_selector": "kubernetes.io/service-name=mosaic"}, "grow_back_after_s": 60}


def replicas(n: int) -> list[Endpoint]:
    return [Endpoint(f"gw-{i}", f"http://10.0.0.{i}:8080", True, False, None) for i in range(n)]


class FakeLister:
    def __init__(self, *listings: list[Endpoint] | Exception) -> None:
        self.listings = list(listings)
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1

    async def list(self) -> list[Endpoint]:
        item = self.listings.pop(0) if len(self.listings) > 1 else self.listings[0]
        if isinstance(item, Exception):
            raise item
        return item


def test_window_rises_at_once_and_falls_after_the_window() -> None:
    w = PeerWindow(60.0, initial=4)
    assert w.current == 4  # before any listing: the configured replicas
    assert w.observe(2, now=0.0) == 2  # the first listing replaces it
    assert w.observe(3, now=10.0) == 3  # a surge pod: at once
    assert w.observe(2, now=20.0) == 3  # gone for 0 s
    assert w.observe(2, now=69.0) == 3  # 59 s
    assert w.observe(2, now=71.0) == 2  # the 3 was seen 61 s ago
    assert w.observe(0, now=80.0) == 2  # never below 1, and 0 counts as 1
    assert PeerWindow(0.0, 1).observe(5, 0.0) == 5


def test_set_share_recomputes_capacity_and_keeps_what_is_reserved() -> None:
    ledger = KvLedger(LedgerSettings(share=0.5, watermark=0.01))
    w = worker(blocks=1000)
    assert ledger.capacity(w) == 495  # floor(min(990, 999) · 0.5)
    big = ledger.reserve(request("a", prompt=16 * 300, max_out=16), w, now=0.0)
    assert big is not None and big.units == 301
    ledger.set_share(0.25)
    assert ledger.capacity(w) == 247
    assert ledger.reserve(request("b", prompt=16, max_out=16), w, now=0.0) is None  # 301 held of 247
    assert big.outcome is None  # nothing taken back
    big.release(Outcome.COMPLETED)
    assert ledger.reserve(request("c", prompt=16, max_out=16), w, now=0.0) is not None
    ledger.set_share(1.0)
    assert ledger.capacity(w) == 990
    with pytest.raises(ValueError):
        ledger.set_share(0.0)


def test_a_request_fitting_the_share_ceiling_is_not_refused_for_good() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.01))
    w = worker(blocks=1000)
    big = request("big", prompt=16 * 300, max_out=16)  # 301 blocks
    ledger.set_share(0.25, ceiling=0.5)  # 247 now, 495 lately
    assert ledger.exceeds_capacity(big, w) is None and ledger.reserve(big, w, now=0.0) is None  # it waits
    ledger.set_share(0.25)  # the ceiling followed the share down
    # the most one request could get alone: floor((1000 − the null block) · 0.25) = 249
    assert ledger.exceeds_capacity(big, w) == (301, 249)
    with pytest.raises(ValueError):
        ledger.set_share(0.5, ceiling=1.5)


def test_reconcile_allowance_follows_the_share() -> None:
    """The other replicas' shares explain usage this process did not reserve: 1 − share of the total."""
    ledger = KvLedger(LedgerSettings(share=0.5, reconcile_tolerance=0.0))
    w = worker(blocks=1000, kv_usage=0.6)  # 600 in use, nothing reserved here: the other half explains 500
    ledger.reserve(request("a", prompt=16, max_out=16), worker(blocks=1000), now=0.0)
    ledger.set_share(0.25)  # three others: 750 explained
    sample = ledger.reconcile([w], now=1.0)[0]
    assert sample.shrink_units == 0
    ledger.set_share(1.0)
    w2 = worker(blocks=1000, kv_usage=0.61)
    assert ledger.reconcile([w2], now=2.0)[0].shrink_units == 608  # 610 in use − 2 reserved, no others


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def peers(lister: FakeLister, ledger: Any, initial: int = 6, t: list[float] | None = None) -> GatewayPeers:
    clock = t if t is not None else [0.0]
    cfg = GatewayPeersConfig(**PEERS)
    return GatewayPeers(
        cfg, ledger, initial, CollectorRegistry(), lambda: clock[0], lister=lister, own_name=""
    )


class Shares:
    def __init__(self) -> None:
        self.seen: list[float] = []

    def set_share(self, share: float, ceiling: float | None = None) -> None:
        self.seen.append(share)


def test_listing_sets_the_share_and_failures_change_nothing(caplog: pytest.LogCaptureFixture) -> None:
    t = [0.0]
    lister = FakeLister(
        replicas(2), replicas(3), RuntimeError("403 forbidden"), [], RuntimeError("again"), replicas(1)
    )
    shares = Shares()
    p = peers(lister, shares, t=t)

    async def go() -> None:
        await p.refresh()
        assert (p.listed, shares.seen) == (2, [0.5])
        t[0] = 10.0
        await p.refresh()
        assert shares.seen[-1] == pytest.approx(1 / 3)
        with caplog.at_level(logging.WARNING, "mosaic.gateway.peers"):
            for _ in range(3):  # a failure, an empty listing, a failure: logged once, share unchanged
                await p.refresh()
        assert len(shares.seen) == 2 and len(caplog.records) == 1
        assert "KV share stays 1/3" in caplog.records[0].getMessage()
        t[0] = 30.0
        await p.refresh()  # 1 listed, but 3 were seen 20 s ago
        assert shares.seen[-1] == pytest.approx(1 / 3) and p.listed == 1
        t[0] = 71.0
        await p.refresh()
        assert shares.seen[-1] == 1.0

    run(go())
    assert lister.starts == 1


def test_a_lister_that_cannot_start_is_retried() -> None:
    class Flaky(FakeLister):
        async def start(self) -> None:
            self.starts += 1
            if self.starts == 1:
                raise RuntimeError("no cluster config")

    lister, shares = Flaky(replicas(2)), Shares()
    p = peers(lister, shares)
    run(p.refresh())
    assert shares.seen == [] and p.window.current == 6  # the configured replicas until a listing works
    run(p.refresh())
    assert shares.seen == [0.5] and lister.starts == 2


def test_kv_share_and_peers_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match=r"kv\.share"):
        config(pool("p", "L4", "mixed", FakeWorker("a")), kv={"share": 0.5}, gateway={"peers": PEERS})


def test_gateway_with_peers_reserves_the_listed_share_end_to_end() -> None:
    """`gateway.replicas: 6` (an HPA's maxReplicas) with two replicas listed: each owns half a worker, not a
    sixth; a request needing a third of the worker's KV is served, where 1/6 refused it for good (400
    kv_exceeds_capacity). When a third and fourth replica are listed (a rollout's surge, say), the same request
    no longer fits: it waits, for the share it had within CEILING_WINDOW_S may come back (here until the
    queue deadline: 429); once four have been listed for that long it is refused for good."""
    a = FakeWorker("a")
    cfg = config(
        pool("p", "L4", "mixed", a), gateway={"replicas": 6, "peers": PEERS}, limits={"queue_deadline_s": 0.5}
    )
    app = create_app(cfg, transport=FakeFleet(a).transport)
    gw = app.state.gateway
    assert gw.peers is not None
    gw.peers.lister = FakeLister(replicas(2))
    gw.peers.own_name = "gw-0"  # this replica is the first listed (not this machine's HOSTNAME)
    # the fake worker reports 1,000 blocks of 16 tokens: a third of it is ~5,300 tokens
    body = {"model": "llama-3-8b", "prompt": [1] * 4000, "max_tokens": 1300}

    async def go() -> None:
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c,
        ):
            assert gw.ledger.settings.share == 0.5  # listed before serving
            await gw.registry.scrape_once()  # the worker's real num_gpu_blocks
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            gw.peers.lister = FakeLister(replicas(4))
            await gw.peers.refresh()
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
            gw.peers.fewest = PeerWindow(0.0, 4, pick=min)  # as if CEILING_WINDOW_S had passed
            await gw.peers.refresh()
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "kv_exceeds_capacity"
            sample = gw.metrics.registry.get_sample_value
            assert (sample("mosaic_gateway_peers"), sample("mosaic_kv_share")) == (4, 0.25)

    run(go())


def test_this_replica_counts_when_the_listing_misses_it() -> None:
    """A pod that just started may not be in its Service's EndpointSlice yet: counted all the same."""
    shares = Shares()
    cfg = GatewayPeersConfig(**PEERS)
    p = GatewayPeers(
        cfg, shares, 1, CollectorRegistry(), lambda: 0.0, lister=FakeLister(replicas(2)), own_name="gw-9"
    )
    run(p.refresh())
    assert (p.listed, shares.seen) == (3, [pytest.approx(1 / 3)])
    p.own_name = "gw-1"  # listed: counted once
    run(p.refresh())
    assert p.listed == 2
