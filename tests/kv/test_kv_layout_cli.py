"""`mosaic kv-layout`: text and --json output on small fixtures and Tangram's release, exit 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from server.commands import kv_layout

FIX = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # keeps `kv-layout` a sub-command, as under `mosaic`
        pass

    kv_layout.register(app)
    return app


def run(app: typer.Typer, *args: str) -> Any:
    return CliRunner().invoke(app, ["kv-layout", *args])


def test_json_on_a_hand_checkable_profile(app: typer.Typer) -> None:
    # moments.csv budgets μ + 2σ: (0,0) 0.14, (0,1) 0.6, (1,0) 0.0, (1,1) 0.5
    result = run(app, "--profile", str(FIX / "moments.csv"), "--heads-per-group", "2", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["report"]["ideal"] == pytest.approx(1.24)  # 0.14 + 0.6 + 0 + 0.5
    assert doc["report"]["monolithic_cost"] == pytest.approx(2.4)  # 4 · 0.6
    assert doc["report"]["adjacent_cost"] == pytest.approx(2.2)  # 2 · 0.6 + 2 · 0.5
    assert doc["report"]["sorted_cost"] == pytest.approx(1.48)  # {0.6, 0.5} + {0.14, 0} = 1.2 + 0.28
    assert doc["groups"] == [
        {"budget": 0.6, "members": [[0, 1], [1, 1]]},
        {"budget": 0.14, "members": [[0, 0], [1, 0]]},
    ]
    assert doc["tp"] is None


def test_tp_partition_and_permutation(app: typer.Typer) -> None:
    result = run(app, "--profile", str(FIX / "moments.csv"), "--heads-per-group", "1", "--tp", "2", "--json")
    assert result.exit_code == 0, result.output
    tp = json.loads(result.output)["tp"]
    # one head per rank per layer, groups of one. Layer 0 = (0.14, 0.6), layer 1 = (0.0, 0.5):
    # {0.6, 0.5} | {0.14, 0.0} → max 1.1;  {0.6, 0.0} | {0.14, 0.5} → max(0.6, 0.64) = 0.64 (optimal)
    assert tp["max_cost"] == pytest.approx(0.64)
    assert sorted(tp["rank_cost"]) == pytest.approx([0.6, 0.64])
    assert all(sorted(p) == [0, 1] for p in tp["permutation"])
    # rank r holds, in each layer, the heads the permutation puts in its contiguous slice
    for r, groups in enumerate(tp["rank_groups"]):
        held = sorted(tuple(h) for g in groups for h in g)
        assert held == sorted((layer, perm[r]) for layer, perm in enumerate(tp["permutation"]))
    assert tp["max_cost"] >= tp["lower_bound"] - 1e-9


def test_text_output_names_the_layouts(app: typer.Typer) -> None:
    result = run(app, "--profile", str(FIX / "samples.json"), "--heads-per-group", "2")
    assert result.exit_code == 0, result.output
    for word in ("monolithic", "adjacent", "sorted", "reclaim"):
        assert word in result.output


def test_tangram_release(app: typer.Typer, shared_data: Path) -> None:
    path = shared_data / "kv_profiles" / "cluster_maps" / "ea" / "qwen3-30b-a3b-instruct-2507" / "profile.npz"
    result = run(
        app, "--profile", str(path), "--heads-per-group", "2", "--tp", "2", "--time-limit", "2", "--json"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert (doc["layers"], doc["kv_heads"], len(doc["groups"])) == (48, 2, 48)
    assert doc["report"]["sorted_cost"] <= doc["report"]["adjacent_cost"]
    assert doc["tp"]["max_cost"] <= doc["tp"]["contiguous_max_cost"] + 1e-9


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--profile", "missing.npz", "--heads-per-group", "4"],
            "does not exist",
            id="missing profile file",
        ),
        pytest.param(
            ["--profile", str(FIX / "bad_ratio.csv"), "--heads-per-group", "4"],
            "in [0, 1]",
            id="ratio above 1",
        ),
        pytest.param(
            ["--profile", str(FIX / "moments.csv"), "--heads-per-group", "0"],
            "≥ 1",
            id="zero heads per group",
        ),
        pytest.param(
            ["--profile", str(FIX / "moments.csv"), "--heads-per-group", "2", "--tp", "3"],
            "divide",
            id="tp not dividing heads",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(app: typer.Typer, args: list[str], message: str) -> None:
    result = run(app, *args)
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0]
