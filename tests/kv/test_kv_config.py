"""`kv:` config: defaults, validation through the gateway config, and the ledger `build_ledger` makes."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from scheduler.kv.config import KvConfig, KvConfigError, build_ledger
from server.config import ConfigError, validate_config
from server.kv_setup import build_gateway_ledger
from tests.kv.kvkit import request, worker

FIX = Path(__file__).parent / "fixtures"


def test_defaults_build_a_worst_case_ledger_sharing_capacity_across_gateways() -> None:
    ledger = build_ledger(KvConfig(), gateway_replicas=2)
    assert ledger is not None
    s = ledger.settings
    assert (s.mode, s.watermark, s.share, s.lease_s) == ("worst_case", 0.02, 0.5, 900.0)
    assert s.per_engine  # data-parallel workers are booked per engine unless `data_parallel: pooled`
    pooled = build_ledger(KvConfig(data_parallel="pooled"))
    assert pooled is not None and not pooled.settings.per_engine
    assert ledger.capacity(worker(blocks=100)) == 49  # floor(100 · 0.98 · 0.5)


def test_disabled_means_no_ledger() -> None:
    assert build_ledger(KvConfig(enabled=False)) is None


def test_compression_pool_gets_the_sorted_layout_of_its_profile() -> None:
    cfg = KvConfig(
        compression=[{"pool": "comp", "profile": "moments.csv", "heads_per_group": 2, "prefill_chunk": 64}]
    )  # type: ignore[list-item]
    ledger = build_gateway_ledger(cfg, base_dir=FIX)
    assert ledger is not None
    spec = ledger.spec_for(worker(pool="comp"))
    assert spec.compression is not None
    assert spec.compression.group_sizes == (2, 2)
    assert spec.compression.group_budgets == pytest.approx((0.6, 0.14))  # μ + 2σ sorted in pairs
    assert spec.units_per_block == 4  # 2 layers × 2 heads: one block = 4 head-pages
    assert ledger.spec_for(worker(pool="other")).compression is None
    assert ledger.reserve(request(prompt=100, max_out=10), worker(pool="comp"), 0.0) is not None


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        pytest.param({"mode": "greedy"}, "kv.mode", id="unknown mode names the field"),
        pytest.param({"watermark": 1.5}, "kv.watermark", id="watermark above 1"),
        # one reason for every value ≤ 0 (a negative one read "should be ≥ 0", and then 0 was refused)
        pytest.param({"watermark": -0.1}, "must be > 0 (e.g. 0.01)", id="negative watermark"),
        pytest.param({"watermark": 0}, "must be > 0 (e.g. 0.01)", id="zero watermark"),
        pytest.param({"surprise": 1}, "kv.surprise", id="unknown key"),
        pytest.param({"data_parallel": "per_rank"}, "kv.data_parallel", id="unknown data-parallel booking"),
        pytest.param(
            {"compression": [{"profile": "p.npz"}]},
            "exactly one of pool or model",
            id="compression without a target",
        ),
    ],
)
def test_bad_kv_sections_fail_through_the_gateway_config(kv: dict[str, object], message: str) -> None:
    data = {
        "pools": [{"name": "p", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"static": ["http://x:1"]}}],
        "kv": kv,
    }
    with pytest.raises(ConfigError, match="kv") as info:
        validate_config(data)
    assert message in str(info.value)


def test_unreadable_profile_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    cfg = KvConfig(compression=[{"model": "m", "profile": "nope.npz"}])  # type: ignore[list-item]
    with pytest.raises(KvConfigError, match=r"kv\.compression\.0\.profile: .*does not exist"):
        build_gateway_ledger(cfg, base_dir=tmp_path)


def test_config_is_frozen_and_strict() -> None:
    with pytest.raises(ValidationError):
        KvConfig(lease_s=0)


def test_build_ledger_takes_parsed_profiles_and_names_the_missing_ones() -> None:
    cfg = KvConfig(compression=[{"model": "m", "profile": "moments.csv"}])  # type: ignore[list-item]
    with pytest.raises(KvConfigError, match=r"kv\.compression: 1 entries but 0 parsed profiles"):
        build_ledger(cfg)
