"""Reading per-head profiles: Tangram .npz (real release via shared_data, and a tiny written one), JSON, CSV."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from placement.kv_profile import ProfileError, load_head_profile

FIX = Path(__file__).parent / "fixtures"


def test_json_samples_give_mean_and_population_std() -> None:
    p = load_head_profile(FIX / "samples.json")
    assert (p.layers, p.kv_heads, p.sink, p.window, p.name) == (2, 2, 4, 8, "tiny")
    assert p.mu[0, 0] == pytest.approx(0.2)  # mean(0.1, 0.3)
    assert p.sigma[0, 0] == pytest.approx(0.1)  # population std of (0.1, 0.3)
    assert p.budgets(2.0)[0, 0] == pytest.approx(0.4)  # 0.2 + 2 · 0.1
    assert p.budgets(2.0)[1, 1] == pytest.approx(1.0)  # 0.8 + 2 · 0.1 = 1.0 (clipped at 1)
    assert p.samples is not None and p.samples.shape == (2, 2, 2)


def test_csv_samples_match_the_json_form() -> None:
    a, b = load_head_profile(FIX / "samples.json"), load_head_profile(FIX / "samples.csv")
    assert np.allclose(a.mu, b.mu) and np.allclose(a.sigma, b.sigma)
    assert (b.sink, b.window) == (4, 8)


def test_csv_moments() -> None:
    p = load_head_profile(FIX / "moments.csv")
    assert p.samples is None
    assert p.budgets(2.0)[1, 1] == pytest.approx(0.5)  # 0.3 + 2 · 0.1
    assert (p.sink, p.window) == (32, 4096)  # Tangram's defaults when the file gives none


def test_a_slice_of_tangrams_per_head_csv_loads_through_column_aliases() -> None:
    p = load_head_profile(FIX / "per_head_slice.csv")
    assert (p.layers, p.kv_heads) == (1, 2)
    assert p.mu[0, 1] == pytest.approx(0.82311)
    assert p.sigma[0, 0] == pytest.approx(0.04435)


def test_tiny_npz_in_tangrams_schema(tmp_path: Path) -> None:
    raw = np.array([[[[0.1, 0.3]], [[0.3, 0.5]]]])  # [R=1, S=2, L=1, H=2]
    meta = np.frombuffer(json.dumps({"scorer": "snapkv"}).encode(), dtype=np.uint8)
    path = tmp_path / "m" / "profile.npz"
    path.parent.mkdir()
    np.savez(
        path,
        raw_ratio=raw,
        sample_meta=np.array([[100, 16, 116, 64], [90, 16, 106, 64]], dtype=np.int32),
        static_layer_ids=np.array([7]),
        meta=meta,
    )
    p = load_head_profile(path)
    assert (p.name, p.sink, p.window, p.layer_ids) == ("snapkv/m", 16, 64, (7,))
    assert np.allclose(p.mu, [[0.2, 0.4]])  # mean of samples (0.1, 0.3) and (0.3, 0.5)


def test_tangram_release_reads(shared_data: Path) -> None:
    path = shared_data / "kv_profiles" / "cluster_maps" / "ea" / "llama-3.1-8b-instruct" / "profile.npz"
    p = load_head_profile(path)
    assert (p.layers, p.kv_heads, p.sink, p.window) == (32, 8, 32, 4096)
    assert p.samples is not None and p.samples.shape == (28, 32, 8)
    assert p.name == "expected_attention/llama-3.1-8b-instruct"
    # the README's definition: raw_ratio = (kept − sink − window) / (total − sink)
    with np.load(path) as d:
        kept, meta = d["raw_kept"][0], d["sample_meta"]
    total = meta[:, 2][:, None, None]
    assert np.allclose((kept - 32 - 4096) / (total - 32), p.samples)
    assert 0.0 <= float(p.mu.mean()) <= 0.3


@pytest.mark.parametrize(
    ("name", "message"),
    [
        pytest.param("bad_missing.json", "missing field 'sigma'", id="a head without sigma names the field"),
        pytest.param("bad_grid.csv", "exactly once", id="an incomplete layer×head grid is refused"),
        pytest.param("bad_ratio.csv", "in [0, 1]", id="a ratio above 1 is refused"),
        pytest.param("nope.json", "does not exist", id="a missing file is named"),
    ],
)
def test_bad_profiles_raise_one_line_naming_the_file(name: str, message: str) -> None:
    with pytest.raises(ProfileError, match="profile file") as info:
        load_head_profile(FIX / name)
    assert message in str(info.value)
    assert name in str(info.value)
    assert "\n" not in str(info.value)


def test_a_directory_is_named_as_one(tmp_path: Path) -> None:
    """It said "does not exist" about a folder that plainly does."""
    with pytest.raises(ProfileError, match=f"^profile file {tmp_path} is a directory$"):
        load_head_profile(tmp_path)


def test_unknown_suffix(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("x")
    with pytest.raises(ProfileError, match="unknown format"):
        load_head_profile(f)
