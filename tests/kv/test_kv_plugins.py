"""The `kv-best-fit` scorer: formula, ledger-backed and scraped fallbacks, and use through the router config."""

from __future__ import annotations

import random

import pytest

from scheduler.fleet import FleetView
from scheduler.kv.ledger import KvLedger, LedgerSettings
from scheduler.kv.plugins import KvBestFitScorer, best_fit_score
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Cycle, Decision
from tests.kv.kvkit import request, worker


@pytest.mark.parametrize(
    ("free", "need", "capacity", "score"),
    [
        pytest.param(10, 10, 100, 1.0, id="fills the worker exactly → 1"),
        pytest.param(100, 10, 100, 0.1, id="empty worker: 1 − 90/100 = 0.1"),
        pytest.param(50, 10, 100, 0.6, id="half full: 1 − 40/100 = 0.6"),
        pytest.param(5, 10, 100, 0.0, id="does not fit → 0"),
        pytest.param(0, 0, 0, 0.0, id="no capacity → 0"),
    ],
)
def test_best_fit_formula(free: float, need: float, capacity: float, score: float) -> None:
    assert best_fit_score(free, need, capacity) == pytest.approx(score)


def test_scorer_reads_the_ledger_among_reserve_plugins() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    a, b = worker("a", blocks=100), worker("b", blocks=100)
    assert ledger.reserve(request("busy", 16 * 80, 0), a, 0.0) is not None  # a: 20 free
    cycle = Cycle(request("r", 160, 0), FleetView((a, b)), 0.0, random.Random(0), reserve_plugins=[ledger])
    # need 10: a → 1 − (20 − 10)/100 = 0.9; b → 1 − (100 − 10)/100 = 0.1
    assert KvBestFitScorer().score(cycle, [a, b]) == pytest.approx([0.9, 0.1])


def test_scorer_falls_back_to_scraped_usage() -> None:
    a = worker("a", blocks=100, kv_usage=0.8)
    cycle = Cycle(request("r", 160, 0), FleetView((a,)), 0.0, random.Random(0))
    assert KvBestFitScorer().score(cycle, [a]) == pytest.approx([0.9])  # free 20, need 10


def test_router_config_enables_kv_best_fit_and_packs_the_busier_worker() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    cfg = RoutingConfig(plugins=[{"type": "kv-best-fit"}], weights={"kv-best-fit": 100.0})  # type: ignore[list-item]
    router = build_router(cfg, reserve=[ledger])
    a, b = worker("a", blocks=100), worker("b", blocks=100)
    assert ledger.reserve(request("busy", 16 * 80, 0), a, 0.0) is not None
    d = router.route(request("r", 160, 0), FleetView((a, b)), 0.0, random.Random(0))
    assert (
        isinstance(d, Decision) and d.decode.id == "a"
    )  # best fit keeps b's 100 free blocks for a big request
