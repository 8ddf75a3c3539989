"""Compression workers in the engine model and the KV fleet driver: page accounting, safety of B3, no preemption."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from placement.catalog import load_catalog
from placement.kv_profile import from_samples, load_head_profile
from placement.perf_model import PerfModel
from scheduler.kv.footprint import WorkerKvSpec, need
from scheduler.kv.ledger import KvLedger, LedgerSettings, SpecTable
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.reasons import Outcome
from simulator.engine import Engine, EngineConfig, run_offline
from simulator.kv_compression import CompressionEngine, CompressionModel, RaggedKvAccounting
from simulator.kv_fleet import Arrival, KvFleet, WorkerSpec, with_oracle
from simulator.kv_metrics import Slo, summarize
from simulator.requests import EngineRequest


def tiny_model(static: bool = True, chunk: int = 256, alpha: float = 2.0) -> CompressionModel:
    """2 layers × 4 heads, 6 samples: two heavy heads (~0.6), the rest light (~0.05); sink 8, window 64."""
    rng = np.random.default_rng(0)
    base = np.array([[0.6, 0.05, 0.1, 0.02], [0.03, 0.55, 0.04, 0.08]])
    samples = np.clip(base + rng.normal(0, 0.05, size=(6, 2, 4)), 0, 1)
    return CompressionModel.build(from_samples("tiny", samples, sink=8, window=64), 2, alpha, chunk, static)


def test_accounting_is_monotone_and_next_growth_agrees() -> None:
    kv = RaggedKvAccounting(1000, 16, tiny_model())
    req = EngineRequest("r", 3000, 100)
    prefill = [kv.blocks_for(req, t) for t in range(0, 3001, 37)]
    assert prefill == sorted(prefill)
    kv.enter_decode(req)
    for t in range(3000, 3100):
        nxt = kv.next_growth(req, t)
        assert kv.blocks_for(req, nxt + 1) > kv.blocks_for(req, nxt)
        assert all(kv.blocks_for(req, u + 1) == kv.blocks_for(req, u) for u in range(t, nxt))


def test_static_budget_caps_groups_and_dynamic_does_not() -> None:
    static, dynamic = tiny_model(True, alpha=1.0), tiny_model(False, alpha=1.0)
    budgets = static.groups.budgets
    exceeded = 0
    for i in range(200):
        req = EngineRequest(f"r{i}", 5000, 10)
        assert all(
            r <= b + 1e-12
            for r, b in zip(RaggedKvAccounting(10, 16, static).draw(req).ratios, budgets, strict=True)
        )
        exceeded += any(
            r > b + 1e-12
            for r, b in zip(RaggedKvAccounting(10, 16, dynamic).draw(req).ratios, budgets, strict=True)
        )
    assert exceeded > 0  # μ + σ is a quantile, not a maximum: uncapped draws outgrow it


def test_b3_footprint_bounds_what_a_static_budget_worker_holds() -> None:
    """The safety claim behind B3: need(P, O).peak ≥ the worker's actual peak, for every draw and shape."""
    model = tiny_model(True)
    spec = WorkerKvSpec(16, None, model.spec())
    kv = RaggedKvAccounting(10, 16, model)
    rng = random.Random(1)
    for i in range(300):
        prompt, out = rng.randint(1, 6000), rng.randint(1, 600)
        req = EngineRequest(f"q{i}", prompt, out)
        assert need(prompt, out, spec).peak >= kv.peak_units(req, out)


def test_compression_engine_runs_clean_and_holds_fewer_blocks_than_stock() -> None:
    cat = load_catalog()
    perf = PerfModel(cat.gpu("A100-80GB"), cat.model("llama-3-8b"))
    cfg = EngineConfig(max_model_len=8192, num_gpu_blocks=4000)
    model = tiny_model()
    reqs = [(0.0, EngineRequest(f"r{i}", 6000, 64, natural_output_tokens=64)) for i in range(4)]
    comp = CompressionEngine(
        perf, cfg, CompressionModel(model.profile, model.groups, model.prefill_chunk, True)
    )
    for t, r in reqs:
        comp.add_request(r, t)
    stock = Engine(perf, cfg)
    for t, r in reqs:
        stock.add_request(r, t)
    now = 0.0
    while comp.has_work() and not all(comp.ragged.draw(r).decoding for _, r in reqs):
        now = comp.step(now).end
    for _ in range(3):  # everyone decoding: compare occupancy (fractions of the same bytes)
        now = comp.step(now).end
    t = 0.0
    while stock.num_running < 4 or stock._partial is not None:
        t = stock.step(t).end
    assert comp.kv_usage < 0.5 * stock.kv_usage
    records = run_offline(CompressionEngine(perf, cfg, model), reqs)
    assert len(records) == 4 and all(r.output_tokens == 64 for r in records)


def fleet_case(pressure_blocks: int = 700) -> tuple[list[WorkerSpec], list[Arrival], CompressionModel]:
    model = tiny_model(True)
    cfg = EngineConfig(max_model_len=8192, num_gpu_blocks=pressure_blocks)
    specs = [WorkerSpec("c0", "A100-80GB", "llama-3-8b", cfg, model, seed=1)]
    rng = random.Random(3)
    arrivals = [
        Arrival(0.05 * i, f"a{i}", rng.randint(2000, 5000), 256, rng.randint(20, 256)) for i in range(40)
    ]
    return specs, arrivals, model


def test_fleet_b0_preempts_where_the_ledger_does_not() -> None:
    specs, arrivals, model = fleet_case()
    b0 = summarize(KvFleet(specs, None).run(arrivals), Slo())
    ledger = KvLedger(LedgerSettings(), SpecTable(by_pool={"c0": model.spec()}))
    fleet = KvFleet(specs, ledger)
    run = fleet.run(arrivals)
    b3 = summarize(run, Slo())
    assert b0.preemptions > 0 and b0.completed == 40
    assert b3.preemptions == 0 and b3.completed == 40
    assert b3.under_reservation_rate == 0.0
    assert ledger.reserved("c0") == 0 and not ledger.active()  # every reservation released ...
    assert (
        ledger.stats.released == {Outcome.COMPLETED.value: 40} and ledger.stats.double_releases == 0
    )  # ... once


def test_fleet_oracle_reserves_exactly_the_peak() -> None:
    specs, arrivals, model = fleet_case()
    fleet = with_oracle(KvFleet(specs, None), LedgerSettings(), SpecTable(by_pool={"c0": model.spec()}))
    m = summarize(fleet.run(arrivals), Slo())
    assert m.preemptions == 0
    assert m.reservation_efficiency == pytest.approx(1.0)


def test_real_profile_worker(shared_data: Path) -> None:
    p = load_head_profile(
        shared_data / "kv_profiles" / "cluster_maps" / "ea" / "llama-3.1-8b-instruct" / "profile.npz"
    )
    model = CompressionModel.build(p, 4, 2.0, 4096)
    kv = RaggedKvAccounting(8000, 16, model)
    req = EngineRequest("x", 20000, 100)
    full = kv.units_per_block * -(-20100 // 16)  # uncompressed head-pages
    # the peak holds kept tokens plus one raw 4096-token chunk; after prefill only the kept ones stay
    assert kv.peak_units(req, 100) < 0.6 * full
    kv.enter_decode(req)
    assert kv.blocks_for(req, 20100) < 0.4 * full
    assert need(20000, 100, WorkerKvSpec(16, None, model.spec())).peak >= kv.peak_units(req, 100)


def test_fleet_with_the_router_placing_requests_never_preempts() -> None:
    """`KvFleet(router=...)`: the gateway's router (ledger as Reserve plugin, kv-best-fit scored) picks each
    worker; a stock worker joins the compression one, both get work, nothing preempts, all is released."""
    specs, arrivals, model = fleet_case()
    specs = [*specs, WorkerSpec("s0", "A100-80GB", "llama-3-8b", specs[0].engine, None, seed=2)]
    ledger = KvLedger(LedgerSettings(), SpecTable(by_pool={"c0": model.spec()}))
    cfg = RoutingConfig.model_validate({"plugins": [{"type": "kv-best-fit"}]})
    run = KvFleet(specs, ledger, router=build_router(cfg, reserve=[ledger])).run(arrivals)
    m = summarize(run, Slo())
    assert m.preemptions == 0 and m.completed == 40
    assert {s.worker for s in run.requests.values()} == {"c0", "s0"}
    assert not ledger.active() and ledger.stats.released == {Outcome.COMPLETED.value: 40}
    assert ledger.stats.double_releases == 0
