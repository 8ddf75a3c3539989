"""WorkerCapacity from the perf model, and the FleetView / WorkerView helpers."""

from __future__ import annotations

import pytest

from placement.catalog import CatalogError, load_catalog
from placement.perf_model import PerfModel
from scheduler.fleet import EngineView, FleetView, Role, capacity_for, configured_engines
from tests.scheduler.routing.builders import worker


def test_capacity_comes_from_the_perf_model_for_that_gpu():
    cat = load_catalog()
    perf = PerfModel(cat.gpu("H100-SXM"), cat.model("llama-3-8b"), 1)
    c = capacity_for("H100", "llama-3-8b", catalog=cat)
    assert c.prefill_tokens_per_s == pytest.approx(perf.prefill_tokens_per_s())
    assert c.kv_blocks == perf.kv_capacity_blocks(0.9, 16)
    # batch = min(64, 256, 25148·16 // 1024 = 392) = 64
    assert c.decode_tokens_per_s == pytest.approx(perf.decode_tokens_per_s(64, 1024))
    assert c.cost_per_hour == 4.25 and c.max_model_len == 8192 and c.max_num_seqs == 256


def test_representative_batch_is_clamped_to_what_the_kv_cache_holds():
    cat = load_catalog()
    perf = PerfModel(cat.gpu("L4"), cat.model("llama-3-8b"), 1)
    c = capacity_for("L4", "llama-3-8b", catalog=cat)
    # L4 holds 2183 blocks · 16 = 34928 tokens → 34928 // 1024 = 34 sequences, not 64
    assert c.kv_blocks == 2183
    assert c.decode_tokens_per_s == pytest.approx(perf.decode_tokens_per_s(34, 1024))


def test_engine_knobs_and_tp_flow_into_capacity():
    c = capacity_for(
        "A100", "llama-3-70b", tp=4, max_num_seqs=8, num_gpu_blocks=1000, block_size=32, cost_per_hour=9.0
    )
    assert (c.kv_blocks, c.block_size, c.max_num_seqs, c.cost_per_hour) == (1000, 32, 8, 9.0)
    assert capacity_for("A100", "llama-3-70b", tp=4).cost_per_hour == pytest.approx(3.67 * 4)


def test_a_data_parallel_worker_is_its_engines_summed_and_one_sequence_is_one_engines():
    one = capacity_for("L4", "llama-3-8b", max_num_seqs=48)
    dp = capacity_for("L4", "llama-3-8b", max_num_seqs=48, dp=3)
    assert dp.prefill_tokens_per_s == pytest.approx(3 * one.prefill_tokens_per_s)
    assert dp.decode_tokens_per_s == pytest.approx(3 * one.decode_tokens_per_s)  # batch sized per engine
    assert (dp.kv_blocks, dp.max_num_seqs, dp.engines) == (3 * 2183, 144, 3)
    assert dp.cost_per_hour == pytest.approx(3 * one.cost_per_hour)
    assert (dp.engine_kv_blocks, dp.engine_prefill_tokens_per_s) == (
        2183,
        pytest.approx(one.prefill_tokens_per_s),
    )
    assert (
        capacity_for("L4", "llama-3-8b", dp=3, cost_per_hour=5.0).cost_per_hour == 5.0
    )  # the whole server's
    assert configured_engines(dp) == (EngineView(0, 2183), EngineView(1, 2183), EngineView(2, 2183))
    assert configured_engines(one) == ()
    with pytest.raises(ValueError, match="dp must be ≥ 1, got 0"):
        capacity_for("L4", "llama-3-8b", dp=0)


def test_an_h100_has_several_times_an_l4s_capacity():
    h, l4 = capacity_for("H100", "llama-3-8b"), capacity_for("L4", "llama-3-8b")
    ratio = l4.service_time_s(512, 256) / h.service_time_s(512, 256)
    assert 8 < ratio < 15  # ~11.4 with the calibrated perf model


def test_unknown_gpu_is_a_catalog_error():
    with pytest.raises(CatalogError, match="unknown GPU"):
        capacity_for("B999", "llama-3-8b")


@pytest.mark.parametrize(
    ("kw", "demand"),
    [
        pytest.param({"inflight": 3}, 3, id="never scraped → gateway in-flight"),
        pytest.param({"inflight": 3, "running": 5, "waiting": 2}, 7, id="scrape sees other gateways → 5 + 2"),
        pytest.param(
            {"inflight": 9, "running": 5, "waiting": 2}, 9, id="stale scrape below in-flight → in-flight"
        ),
    ],
)
def test_demand_is_the_larger_of_inflight_and_scraped(kw, demand):
    assert worker(**kw).demand == demand


def test_blocks_use_reported_cache_config_when_scraped():
    w = worker(num_gpu_blocks=100, block_size=32)
    assert w.kv_blocks_total == 100 and w.blocks_for(33) == 2  # ceil(33 / 32)
    assert worker().blocks_for(33) == 3  # ceil(33 / 16)


def test_fleet_view_helpers():
    fleet = FleetView((worker("a"), worker("b", model="m2", role="prefill")))
    assert [w.id for w in fleet.for_model("m2")] == ["b"]
    assert fleet.get("b") is fleet.workers[1] and fleet.get("zz") is None
    assert fleet.models() == ("llama-3-8b", "m2")
    assert fleet.has_role("m2", Role.PREFILL) and not fleet.has_role("llama-3-8b", Role.PREFILL)
