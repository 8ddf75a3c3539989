"""Throughput profile files (INTERFACES.md §5): round trips in YAML and JSON, errors that name the field,
SLO selection, and AIBrix's Mélange-format profiles imported from ../shared/data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from placement.profiles import (
    ProfileError,
    Role,
    Slo,
    ThroughputProfile,
    bucket_index,
    load_profile,
    profile_from_aibrix,
    profile_from_dict,
    save_profile,
)

FIXTURES = Path(__file__).parent / "fixtures"


def body(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema": "mosaic.profile/v1",
        "model": "llama-3-8b",
        "gpu": "A10G",
        "input_edges": [1, 512, 2048],
        "output_edges": [1, 128],
        "max_rate": [[3.5], [1.2]],
    }
    return base | overrides


def test_fixture_profiles_load() -> None:
    p = load_profile(FIXTURES / "llama3-a100-tpot40.yaml")
    assert (p.model, p.gpu, p.tp, p.role, p.slo.tpot_ms) == ("llama-3-8b", "A100-80GB", 1, Role.MIXED, 40)
    assert p.shape == (3, 3)
    assert p.flat_rates()[:3] == (12.0, 6.0, 2.0)
    assert load_profile(FIXTURES / "llama3-l4-tpot40.json").max_rate[2] == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_save_then_load_is_identity(tmp_path: Path, suffix: str) -> None:
    measured = [[{"rate": 3.5, "ttft_p90_ms": 80.0, "tpot_p90_ms": 38.0, "n": 200}], [None]]
    p = profile_from_dict(body(measured=measured, role="decode", tp=2, source="sim", slo={"tpot_ms": 40}))
    save_profile(p, tmp_path / f"p{suffix}")
    assert load_profile(tmp_path / f"p{suffix}") == p


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            {"schema": "mosaic.profile/v2"}, "field schema", id="wrong schema version → names schema"
        ),
        pytest.param(
            {"max_rate": [[3.5], [-1.0]]},
            "field max_rate[1][0]: must be a finite number ≥ 0",
            id="negative rate → names the cell",
        ),
        pytest.param(
            {"max_rate": [[3.5], ["fast"]]}, "field max_rate[1][0]", id="non-number rate → names the cell"
        ),
        pytest.param(
            {"max_rate": [[3.5]]},
            "max_rate has 1 rows, but input_edges define 2",
            id="missing profile row → shape error",
        ),
        pytest.param(
            {"max_rate": [[3.5], [1.2, 9.0]]}, "max_rate[1] has 2 cells", id="ragged row → shape error"
        ),
        pytest.param(
            {"input_edges": [1, 512, 100]},
            "field input_edges: edges must be ≥ 0 and strictly increasing",
            id="edges out of order",
        ),
        pytest.param({"tp": 0}, "field tp", id="tp 0 refused"),
        pytest.param({"role": "both"}, "field role", id="unknown role refused"),
        pytest.param({"colour": "red"}, "field colour", id="unknown key refused"),
        pytest.param({"slo": {"tpot_ms": -5}}, "field slo.tpot_ms", id="negative SLO refused"),
    ],
)
def test_validation_names_file_and_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ProfileError) as info:
        profile_from_dict(body(**overrides), "p.yaml")
    assert str(info.value).startswith("p.yaml: ")
    assert message in str(info.value)


def test_missing_schema_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="field schema: missing"):
        profile_from_dict({k: v for k, v in body().items() if k != "schema"}, "p.yaml")
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)


@pytest.mark.parametrize(
    ("value", "index"),
    [
        pytest.param(1, 0, id="first edge is inside bucket 0"),
        pytest.param(511, 0, id="one below an edge stays in the lower bucket"),
        pytest.param(512, 1, id="an edge starts the next bucket"),
        pytest.param(2047, 1, id="one below the last edge is the last bucket"),
        pytest.param(2048, None, id="the last edge is outside (half-open)"),
        pytest.param(0, None, id="below the first edge is outside"),
    ],
)
def test_bucket_index_half_open(value: int, index: int | None) -> None:
    assert bucket_index((1, 512, 2048), value) == index


def test_rate_for_looks_up_the_bucket() -> None:
    p = profile_from_dict(body())
    assert p.rate_for(100, 50) == 3.5
    assert p.rate_for(600, 50) == 1.2
    assert p.rate_for(600, 500) == 0.0  # output beyond the profiled lengths


@pytest.mark.parametrize(
    ("measured_at", "target", "ok"),
    [
        pytest.param(Slo(tpot_ms=40), Slo(tpot_ms=120), True, id="tighter profile is safe for a looser SLO"),
        pytest.param(
            Slo(tpot_ms=120), Slo(tpot_ms=40), False, id="looser profile is not safe for a tighter SLO"
        ),
        pytest.param(Slo(), Slo(tpot_ms=40), False, id="unconstrained profile says nothing about TPOT"),
        pytest.param(Slo(tpot_ms=40), Slo(), True, id="no target: anything goes"),
        pytest.param(
            Slo(tpot_ms=40), Slo(tpot_ms=40, ttft_ms=500), False, id="target TTFT the profile never checked"
        ),
    ],
)
def test_slo_within(measured_at: Slo, target: Slo, ok: bool) -> None:
    assert measured_at.within(target) is ok


def test_aibrix_profile_import(shared_data: Path) -> None:
    path = shared_data / "placement" / "aibrix" / "simulator-llama2-7b-a100.json"
    p = profile_from_aibrix(path, model="llama-2-7b", gpu="A100-80GB")
    assert isinstance(p, ThroughputProfile) and p.source == "aibrix"
    # indexes: outputs [4 … 512] (8), inputs [128 … 2048] (5); buckets (p_{k-1}, p_k] → edges p + 1
    assert p.input_edges == (1, 129, 257, 513, 1025, 2049)
    assert p.output_edges == (1, 5, 9, 17, 33, 65, 129, 257, 513)
    assert p.slo.e2e_ms == 5000.0  # "slos": {"percentile": 99, "e2e": 5.0}
    # AIBrix tputs[output][input]: tputs[0][0] = 62.48 (out 4, in 128); tputs[0][4] = 4.26 (out 4, in 2048)
    assert p.rate_for(128, 4) == pytest.approx(62.4770592037908)
    assert p.rate_for(2048, 4) == pytest.approx(4.25505318548248)
    assert p.rate_for(100, 512) == 0.0  # tputs[7] is all zeros: 512 output tokens miss the 5 s e2e SLO


def test_aibrix_import_refuses_other_files(tmp_path: Path) -> None:
    other = tmp_path / "x.json"
    other.write_text('{"gpu": "a", "tputs": [[1]]}')
    with pytest.raises(ProfileError, match="not an AIBrix profile"):
        profile_from_aibrix(other, model="m", gpu="A10G")
