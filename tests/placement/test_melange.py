"""Mélange's input JSON read as is, and Mélange's own inputs (../shared/data/placement) solved to the
optima worked out by hand below."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from placement.binpacking import Status, Variant
from placement.melange import MelangeFormatError, load_melange, melange_from_dict, melange_output
from placement.solver import solve_mix

EXAMPLE: dict[str, Any] = {
    "gpu_info": {
        "A10G": {"cost": 1.01, "tputs": [[2, 1], [5, 2]]},
        "A100-80GB": {"cost": 3.67, "tputs": [[20, 20], [40, 20]]},
    },
    "workload_distribution": [[0.2, 0.1], [0.5, 0.2]],
    "total_request_rate": 30.0,
    "slice_factor": 1,
}


def test_example_in_memory_matches_melange_output_format() -> None:
    mi = melange_from_dict(EXAMPLE)
    assert mi.slice_factor == 1 and mi.shape == (2, 2) and mi.total_rate == 30.0
    sol = solve_mix(mi.problem, variant=Variant.SLICED, slice_factor=mi.slice_factor)
    # Hand check in test_binpacking.py: {A10G: 3, A100-80GB: 1}, 3 · 1.01 + 3.67 = $6.70
    assert melange_output(sol) == pytest.approx({"A10G": 3.0, "A100-80GB": 1.0, "cost": 6.70})


@pytest.mark.parametrize(
    ("name", "gpus", "cost"),
    [
        # example.json: the worked example (test_binpacking.py) → 3 A10G + 1 A100 = $6.70 (SOURCES.md agrees)
        pytest.param(
            "example.json", {"A10G": 3, "A100-80GB": 1}, 6.70, id="example.json → 3 A10G + 1 A100, $6.70"
        ),
        # example_f8b586e: λ = 1, rates .25/.125/.375/.25; A10G loads .05 + .125 + .0375 + .05 = .2625 → 1 A10G
        pytest.param("example_f8b586e.json", {"A10G": 1}, 1.01, id="example_f8b586e.json → 1 A10G, $1.01"),
        # example_c83e4ae: only A100; loads .25/20 + .125/2 + .375/50 + .25/20 = .095 → 1 A100
        pytest.param(
            "example_c83e4ae.json", {"A100-80GB": 1}, 3.67, id="example_c83e4ae.json → 1 A100, $3.67"
        ),
        # main_py_ad10bce: λ = 16, rates 4/8/4/4; A10G loads .8 + 8 + .4 + .8 = 10 → 10 A10G ($10.10); moving the
        # 8-load bucket to A100 costs 8/2 = 4 A100 ($14.68): Mélange's README of that era prints {A10G: 10, cost 10.1}
        pytest.param(
            "main_py_ad10bce.json", {"A10G": 10}, 10.10, id="main_py_ad10bce.json → 10 A10G, $10.10 (README)"
        ),
        # main_py_d461c5e: rates 4/2/6/4; A10G loads .8 + 2 + .6 + .8 = 4.2 → 5 A10G ($5.05); one A100 can only take
        # 0.52 of load (b00, b10, b11) leaving 2.0 → 2 A10G: 3.67 + 2.02 = $5.69 > $5.05
        pytest.param("main_py_d461c5e.json", {"A10G": 5}, 5.05, id="main_py_d461c5e.json → 5 A10G, $5.05"),
    ],
)
def test_melange_release_inputs(shared_data: Path, name: str, gpus: dict[str, int], cost: float) -> None:
    mi = load_melange(shared_data / "placement" / "melange-release" / name)
    sol = solve_mix(mi.problem, variant=Variant.SLICED, slice_factor=mi.slice_factor)
    assert sol.status is Status.OPTIMAL
    assert sol.gpus == gpus
    assert sol.cost_per_hour == pytest.approx(cost)
    continuous = solve_mix(mi.problem, variant=Variant.CONTINUOUS)
    assert continuous.cost_per_hour <= sol.cost_per_hour + 1e-9  # never dearer


def test_unnormalised_distribution_is_used_as_written_and_noted(shared_data: Path) -> None:
    mi = load_melange(shared_data / "placement" / "melange-release" / "main_py_ad10bce.json")
    assert mi.notes and "sums to 1.25" in mi.notes[0]
    assert sum(d.total for d in mi.problem.windows[0]) == pytest.approx(16 * 1.25)


def test_aibrix_constraint_keys_are_accepted() -> None:
    data = json.loads(json.dumps(EXAMPLE))
    data["gpu_info"]["A100-80GB"]["max_count"] = 0
    sol = solve_mix(melange_from_dict(data).problem, variant=Variant.SLICED, slice_factor=1)
    assert sol.gpus == {"A10G": 12}  # 3 + 3 + 3 + 3


def _with(**changes: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(EXAMPLE))
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(_with(total_request_rate=0), "0 req/s", id="zero rate → nothing to place"),
        pytest.param(_with(total_request_rate="fast"), "total_request_rate", id="non-numeric rate"),
        pytest.param(_with(gpu_info=None), "missing key 'gpu_info'", id="missing gpu_info"),
        pytest.param(_with(slice_factor=0), "slice_factor", id="slice factor 0"),
        pytest.param(
            _with(workload_distribution=[[0.5, 0.5]]),
            "shape 2×2 differs from workload_distribution's 1×2",
            id="tputs shape differs",
        ),
        pytest.param(
            _with(gpu_info={"A10G": {"cost": 1.01, "tputs": [[2, 1], [5]]}}),
            "rows have different lengths",
            id="missing profile cell",
        ),
        pytest.param(_with(gpu_info={"A10G": {"cost": 1.01}}), "needs 'cost' and 'tputs'", id="no tputs"),
        pytest.param(_with(extra=1), "unknown key", id="unknown top-level key"),
    ],
)
def test_malformed_inputs(data: dict[str, Any], message: str) -> None:
    with pytest.raises(MelangeFormatError, match=message):
        melange_from_dict(data, "in.json")


def test_zero_throughput_means_cannot_serve(tmp_path: Path) -> None:
    # Mélange divides by zero here; we report the bucket instead.
    data = _with(gpu_info={"A10G": {"cost": 1.01, "tputs": [[2, 1], [5, 0]]}})
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match="1 bucket"):
        solve_mix(load_melange(path).problem)
