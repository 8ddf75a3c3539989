"""`GET /ready`, the chart's readiness probe: ready once discovery has listed every pool and while not draining;
a model without a ready worker is reported in the body but does not take the gateway (and every other model
with it) out of the Service, unless `readiness.require_all_models` asks for the strict probe."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from server.discovery import Endpoint
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool
from tests.gateway.serverkit import GatewayThread

OTHER = "qwen2.5-7b"


def _two_models(**sections: Any) -> tuple[FakeFleet, Any]:
    """llama-3-8b on a healthy worker; qwen2.5-7b on a worker whose /health fails (its pool is down)."""
    fleet = FakeFleet(FakeWorker("up"), FakeWorker("down", model=OTHER, health_ok=False))
    cfg = config(
        pool("llama", "L4", "mixed", fleet.workers["up"]),
        pool("qwen", "L4", "mixed", fleet.workers["down"], model=OTHER),
        **sections,
    )
    return fleet, cfg


def _ready(gw: GatewayThread) -> httpx.Response:
    with httpx.Client(base_url=gw.url, timeout=10) as http:
        return http.get("/ready")


def test_one_models_pool_down_keeps_the_gateway_ready_and_says_which() -> None:
    fleet, cfg = _two_models()
    with GatewayThread(cfg, transport=fleet.transport) as gw:
        ready = _ready(gw)
        assert ready.status_code == 200, ready.text  # before: 503, every gateway pod out of the Service
        body = ready.json()
        assert body["ready"] is True and body["require_all_models"] is False
        assert body["ready_workers"] == {"llama-3-8b": 1, OTHER: 0}
        assert body["models_without_ready_worker"] == [OTHER]
        assert body["discovery_synced"] is True and body["unsynced_pools"] == {}


def test_require_all_models_restores_the_strict_probe() -> None:
    fleet, cfg = _two_models(readiness={"require_all_models": True})
    with GatewayThread(cfg, transport=fleet.transport) as gw:
        ready = _ready(gw)
        assert ready.status_code == 503
        assert ready.json()["models_without_ready_worker"] == [OTHER]
        fleet.workers["down"].health_ok = True
        gw.call(gw.gateway.registry.health_once())
        ready = _ready(gw)
        assert ready.status_code == 200, ready.text
        assert ready.json()["ready_workers"] == {"llama-3-8b": 1, OTHER: 1}


@pytest.mark.parametrize("strict", [False, True])
def test_draining_is_never_ready(strict: bool) -> None:
    fleet = FakeFleet(FakeWorker("a"))
    cfg = config(pool("p", "L4", "mixed", fleet.workers["a"]), readiness={"require_all_models": strict})
    with GatewayThread(cfg, transport=fleet.transport) as gw:
        assert _ready(gw).status_code == 200
        gw.gateway.draining = True
        ready = _ready(gw)
        assert ready.status_code == 503 and ready.json()["draining"] is True


class FlakySource:
    """A pool source whose listing fails until `ok` (an API server down when the gateway starts)."""

    resync_s: float | None = None

    def __init__(self, url: str) -> None:
        self.ok = False
        self.url = url

    async def start(self) -> None:
        return None

    async def list(self) -> list[Endpoint]:
        if not self.ok:
            raise ConnectionError("apiserver unavailable")
        return [Endpoint("a", self.url)]

    async def stop(self) -> None:
        return None


def test_not_ready_until_every_pools_discovery_has_listed_once() -> None:
    fleet = FakeFleet(FakeWorker("a"), FakeWorker("b"))
    cfg = config(
        pool("static", "L4", "mixed", fleet.workers["a"]), pool("k8s", "L4", "mixed", fleet.workers["b"])
    )
    flaky = FlakySource(fleet.workers["b"].url)
    with GatewayThread(cfg, transport=fleet.transport, sources={"k8s": flaky}) as gw:
        ready = _ready(gw)
        assert ready.status_code == 503
        assert ready.json()["unsynced_pools"] == {"k8s": "ConnectionError: apiserver unavailable"}
        flaky.ok = True
        gw.call(gw.gateway.registry.resync("k8s"))
        ready = _ready(gw)
        assert ready.status_code == 200, ready.text
        assert ready.json()["discovery_synced"] is True
        flaky.ok = False  # a later failed re-list keeps the last good view: still ready
        gw.call(gw.gateway.registry.resync("k8s"))
        assert _ready(gw).status_code == 200
