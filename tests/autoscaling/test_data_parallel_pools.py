"""A data-parallel pool (`dp`) to the autoscaler: an instance is `dp` engines, so its decode and prefill
capacity and its price are `dp` times one engine's, each engine sized with its own sequences and KV."""

from __future__ import annotations

from typing import Any

import pytest

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from scheduler.autoscaler.capacity import instance_capacity
from scheduler.fleet import Role, capacity_for
from server.autoscaler_setup import pool_spec
from server.config import validate_config
from server.registry import PoolInfo

CONTEXT = 1024  # autoscaler.context_tokens' default


def _spec(dp: int) -> Any:
    raw = {"name": "d", "model": "llama-3-8b", "gpu": "L4", "role": "decode", "dp": dp,
           "max_num_seqs": 48, "endpoints": {"static": ["http://d:8000"]}}  # fmt: skip
    cfg = validate_config({"pools": [raw], "slo": {"tpot_ms": 150}}, "test")
    catalog = load_catalog()
    info = PoolInfo("d", "llama-3-8b", "L4", Role.DECODE, capacity_for("L4", "llama-3-8b", catalog=catalog,
                    max_num_seqs=48, dp=dp))  # fmt: skip
    return pool_spec(cfg, cfg.pools[0], info, catalog)


def test_a_dp_instance_is_dp_engines_of_capacity_and_price() -> None:
    one, two = _spec(1), _spec(2)
    catalog = load_catalog()
    engine = instance_capacity(
        PerfModel(catalog.gpu("L4"), catalog.model("llama-3-8b"), 1),
        tpot_s=0.15,
        context=CONTEXT,
        max_num_seqs=48,
        kv_tokens=2183 * 16,  # one engine's blocks, not the server's 4,366
    )
    assert engine.decode_tps > 0
    assert one.decode_tps_capacity == pytest.approx(engine.decode_tps)
    assert two.decode_tps_capacity == pytest.approx(2 * engine.decode_tps)
    assert two.prefill_tps_capacity == pytest.approx(2 * one.prefill_tps_capacity)
    assert [r for _, r in two.decode_tps_by_context] == pytest.approx(
        [2 * r for _, r in one.decode_tps_by_context]
    )
    assert two.cost_per_hour == pytest.approx(2 * one.cost_per_hour)
