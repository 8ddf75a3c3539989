"""`mosaic kv-layout` on bad profile files and absurd group sizes: exit 2 with one `error:` line, never a
traceback nor click's "Aborted!" (exit 130), and `tp_partition` with H_p past a rank's heads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer

from placement.kv_profile import ProfileError, from_moments, load_head_profile
from placement.kv_tp import tp_partition
from tests.kv import test_kv_layout_cli as kv_cli

app, run = kv_cli.app, kv_cli.run  # the `mosaic kv-layout` app (a module fixture) and its runner

OK_RAW = np.full((1, 2, 2, 2), 0.3)  # [R, S, L, H]: one base ratio, 2 samples, 2 layers × 2 heads


def _npz(path: Path, **arrays: Any) -> None:
    with path.open("wb") as fh:
        np.savez(fh, **arrays)


def _write(tmp: Path, name: str) -> Path:
    """The bad file `name` under tmp (each one a reviewer's repro)."""
    path = tmp / name
    if name == "empty.npz":
        path.write_bytes(b"")
    elif name == "not-a-zip.npz":
        path.write_bytes(b"PK\x03\x04 this is not a zip archive")
    elif name == "text.npz":  # a text file renamed
        path.write_text("hello world, this is text")
    elif name == "no-base-ratio.npz":
        _npz(path, raw_ratio=np.zeros((0, 2, 2, 2)))
    elif name == "nan-meta.npz":
        _npz(path, raw_ratio=OK_RAW, sample_meta=np.array([[1.0, np.nan, 3.0, 4.0]]))
    elif name == "scalar-ids.npz":
        _npz(path, raw_ratio=OK_RAW, static_layer_ids=np.array(5))
    elif name == "text-ratios.npz":
        _npz(path, raw_ratio=np.full((1, 2, 2, 2), "x"))
    elif name == "no-heads.json":
        path.write_text('{"heads": []}')
    elif name == "inf-layer.json":
        path.write_text('{"heads": [{"layer": 1e400, "head": 0, "mu": 0.1, "sigma": 0.0}]}')
    elif name == "half-layer.json":
        path.write_text('{"heads": [{"layer": 0.5, "head": 0, "mu": 0.1, "sigma": 0.0}]}')
    elif name == "inf-sink.json":
        path.write_text('{"sink": 1e400, "heads": [{"layer": 0, "head": 0, "mu": 0.1, "sigma": 0.0}]}')
    elif name == "twice.json":
        path.write_text('{"heads": [{"layer": 0, "head": 0, "mu": 0.1, "mu": 0.9, "sigma": 0.0}]}')
    else:
        raise AssertionError(name)
    return path


BAD = [
    pytest.param("empty.npz", " is not a readable .npz: No data left in file", id="empty npz (exit 130)"),
    pytest.param("not-a-zip.npz", " is not a readable .npz: File is not a zip file", id="corrupt zip"),
    pytest.param(
        "text.npz", " is not a readable .npz: not an .npz archive (no zip header)", id="text (numpy: pickle)"
    ),
    pytest.param(
        "no-base-ratio.npz",
        ": 'raw_ratio' must be [R, S, L, H] with none of them 0, got shape (0, 2, 2, 2)",
        id="raw_ratio without a base ratio (IndexError)",
    ),
    pytest.param(
        "nan-meta.npz", ": sample_meta sink must be a whole number ≥ 0, got nan", id="NaN in sample_meta"
    ),
    pytest.param(
        "scalar-ids.npz",
        ": 'static_layer_ids' must be a list, got shape ()",
        id="0-d static_layer_ids (TypeError)",
    ),
    pytest.param("text-ratios.npz", ": 'raw_ratio' must hold numbers, got <U1", id="text raw_ratio"),
    pytest.param("no-heads.json", ": no heads", id="empty heads list (ValueError)"),
    pytest.param(
        "inf-layer.json",
        ": heads[0] has a non-numeric field (an index must be a whole number, got inf)",
        id="layer 1e400 (OverflowError)",
    ),
    pytest.param(
        "half-layer.json",
        ": heads[0] has a non-numeric field (an index must be a whole number, got 0.5)",
        id="layer 0.5 (truncated to 0)",
    ),
    pytest.param("inf-sink.json", ": 'sink' must be an integer, got inf", id="sink 1e400 (OverflowError)"),
    pytest.param(
        "twice.json",
        " is not valid JSON: key 'mu' is given twice in one mapping",
        id="a key given twice",
    ),
]


@pytest.mark.parametrize(("name", "message"), BAD)
def test_bad_profile_file_is_a_profile_error(tmp_path: Path, name: str, message: str) -> None:
    path = _write(tmp_path, name)
    with pytest.raises(ProfileError) as err:
        load_head_profile(path)
    assert str(err.value) == f"profile file {path}{message}"


@pytest.mark.parametrize(("name", "message"), BAD)
def test_bad_profile_file_exits_2_with_one_line(
    app: typer.Typer, tmp_path: Path, name: str, message: str
) -> None:
    path = _write(tmp_path, name)
    result = run(app, "--profile", str(path), "--heads-per-group", "2")
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.output.strip().splitlines() == [f"error: profile file {path}{message}"]


def test_npz_with_good_layer_ids_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "ok.npz"
    _npz(path, raw_ratio=OK_RAW, sample_meta=np.array([[100, 4, 50, 16]]), static_layer_ids=np.array([3, 7]))
    prof = load_head_profile(path)
    assert (prof.layers, prof.kv_heads, prof.sink, prof.window, prof.layer_ids) == (2, 2, 4, 16, (3, 7))


def test_a_group_larger_than_a_rank_partitions_as_a_rank_sized_group() -> None:
    """H_p = 10¹⁶ overflowed CP-SAT's domains (a traceback from `--tp 2`); past a rank's heads every H_p
    groups the same: one group per rank."""
    rng = np.random.default_rng(7)
    budgets = from_moments("r", rng.uniform(0, 0.5, (3, 4)), rng.uniform(0, 0.1, (3, 4))).budgets()
    rank_sized = tp_partition(budgets, 2, 6, time_limit_s=5.0)  # 3 layers × 4 heads / 2 ranks = 6 per rank
    huge = tp_partition(budgets, 2, 10**16, time_limit_s=5.0)
    assert huge.status == rank_sized.status == "OPTIMAL"
    assert huge.heads_per_group == 10**16
    assert huge.rank_cost == pytest.approx(rank_sized.rank_cost)
    assert huge.max_cost == pytest.approx(rank_sized.max_cost)
    assert all(len(groups) == 1 for groups in huge.rank_groups)


def test_huge_heads_per_group_with_tp_on_the_cli(app: typer.Typer, tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    path.write_text("layer,head,mu,sigma\n0,0,0.1,0.01\n0,1,0.2,0.01\n")
    result = run(app, "--profile", str(path), "--heads-per-group", "10000000000000000", "--tp", "2", "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    assert '"max_cost": 0.22' in result.output  # rank of head (0, 1): one head, budget 0.2 + 2 · 0.01
