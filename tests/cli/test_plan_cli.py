"""`mosaic plan` end to end: tables, the --json document, Mélange inputs, traces, what-if, nodes, and the
exit-2-with-one-line contract on bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from server.commands import plan as plan_command

PLACEMENT = Path(__file__).parent.parent / "placement" / "fixtures"
HERE = Path(__file__).parent / "fixtures"
PROFILES = [
    "--profile",
    str(PLACEMENT / "llama3-a100-tpot40.yaml"),
    "--profile",
    str(PLACEMENT / "llama3-a10g-tpot40.yaml"),
    "--profile",
    str(PLACEMENT / "llama3-l4-tpot40.json"),
]
BASE = [
    "plan",
    "--workload",
    str(PLACEMENT / "workload.yaml"),
    "--gpus",
    str(PLACEMENT / "gpus.yaml"),
    *PROFILES,
    "--slo-tpot-ms",
    "40",
]


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # keeps `plan` a sub-command, as under `mosaic`
        pass

    plan_command.register(app)
    return app


def run(app: typer.Typer, *args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def run_json(app: typer.Typer, *args: str) -> dict[str, Any]:
    result = run(app, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_table_output(app: typer.Typer) -> None:
    result = run(app, *BASE)
    assert result.exit_code == 0, result.output
    for text in (
        "Cheapest fleet",
        "proven optimal",
        "Single GPU type",
        "Savings against A100-80GB alone",
        "Routing hints",
    ):
        assert text in result.output


def test_json_document(app: typer.Typer) -> None:
    doc = run_json(app, *BASE)
    assert doc["schema"] == "mosaic.plan/v1" and doc["status"] == "optimal" and doc["gap"] == 0
    assert doc["single_type"]["best"] == {
        "gpu": "A100-80GB",
        "cost_per_hour": 18.35,
        "gpus": {"A100-80GB": 5},
    }
    assert doc["cost_per_hour"] == pytest.approx(sum(r["cost_per_hour"] for r in doc["instances"]))
    assert doc["savings"]["per_hour"] == pytest.approx(18.35 - doc["cost_per_hour"])
    assert len(doc["assignment"]) == 9 and all(
        sum(a["shares"].values()) == pytest.approx(1.0) for a in doc["assignment"]
    )
    for key in (
        "variant",
        "slice_factor",
        "engine",
        "wall_s",
        "bound_per_hour",
        "time_varying",
        "what_if",
        "placement",
        "notes",
        "dropped",
    ):
        assert key in doc


def test_melange_example_as_is(app: typer.Typer, shared_data: Path) -> None:
    example = str(shared_data / "placement" / "melange-release" / "example.json")
    doc = run_json(app, "plan", "--melange", example)
    # 3 A10G + 1 A100 = $6.70 (hand check in tests/placement/test_binpacking.py); A100 alone ⌈1.125⌉ = 2 → $7.34
    assert doc["gpus"] == {"A10G": 3, "A100-80GB": 1} and doc["cost_per_hour"] == 6.7
    assert doc["variant"] == "sliced" and doc["slice_factor"] == 1
    assert doc["savings"] == {
        "per_hour": pytest.approx(0.64),
        "fraction": pytest.approx(0.64 / 7.34, abs=1e-6),
    }
    cont = run_json(app, "plan", "--melange", example, "--variant", "continuous")
    assert cont["cost_per_hour"] == 4.68  # 1 A100 + 1 A10G (a third of bucket (1, 0) on the A10G)
    rows = run_json(app, "plan", "--melange", example, "--what-if", "rate_scale=1,2")["what_if"]
    assert [r["rate"] for r in rows] == [30.0, 60.0]
    assert rows[1]["cost_per_hour"] >= rows[0]["cost_per_hour"]


def test_what_if_table_over_slos(app: typer.Typer) -> None:
    extra = [
        "--profile",
        str(PLACEMENT / "llama3-a100-tpot120.yaml"),
        "--profile",
        str(PLACEMENT / "llama3-a10g-tpot120.yaml"),
    ]
    doc = run_json(app, *BASE, *extra, "--what-if", "tpot_ms=40,120", "--what-if", "rate=20,40")
    rows = {(r["tpot_ms"], r["rate"]): r for r in doc["what_if"]}
    assert set(rows) == {(40.0, 20.0), (40.0, 40.0), (120.0, 20.0), (120.0, 40.0)}
    assert rows[(120.0, 20.0)]["cost_per_hour"] < rows[(40.0, 20.0)]["cost_per_hour"]
    assert rows[(40.0, 20.0)]["cost_per_hour"] == doc["cost_per_hour"]  # same as the base plan
    table = run(app, *BASE, *extra, "--what-if", "tpot_ms=40,120")
    assert "What if" in table.output


def test_trace_input_time_varying_and_nodes(app: typer.Typer) -> None:
    args = [
        "plan",
        "--trace",
        str(HERE / "azure_small.csv"),
        "--gpus",
        "A10G,A100-80GB",
        *PROFILES[:4],
        "--slo-tpot-ms",
        "40",
    ]
    doc = run_json(app, *args, "--window-s", "600", "--nodes", str(PLACEMENT / "nodes.yaml"))
    tv = doc["time_varying"]
    assert len(tv["windows"]) == 2 and tv["windows"][0]["rate"] > tv["windows"][1]["rate"]  # busy, then quiet
    assert tv["dynamic"]["cost"] <= tv["static"]["cost"] + 1e-9
    placed = doc["placement"]
    assert placed["status"] in ("optimal", "feasible")
    used = sum(int(i.rsplit("×", 1)[1]) for n in placed["nodes"] for i in n["instances"])
    assert used == sum(r["count"] for r in doc["instances"])


def test_real_azure_trace(app: typer.Typer, shared_data: Path) -> None:
    trace = str(shared_data / "traces" / "azure_llm_2023_conv.csv")
    args = [
        "plan",
        "--trace",
        trace,
        "--gpus",
        "A10G,A100-80GB",
        *PROFILES[:4],
        "--slo-tpot-ms",
        "40",
        "--drop-unservable",
    ]
    doc = run_json(app, *args)
    assert doc["status"] == "optimal" and doc["cost_per_hour"] > 0
    # ~19k requests over one hour ≈ 5.4 req/s
    assert 4.0 < sum(a["rate"] for a in doc["assignment"]) + sum(d["rate"] for d in doc["dropped"]) < 7.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["plan", "--gpus", "A10G"], "give --gpus and at least one --profile", id="no profile"),
        pytest.param(
            [*BASE, "--trace", "x.csv"], "exactly one of --workload or --trace", id="workload and trace"
        ),
        pytest.param(["plan", "--melange", "nope.json"], "nope.json: cannot read", id="missing Mélange file"),
        pytest.param([*BASE, "--what-if", "colour=1"], "--what-if 'colour=1'", id="unknown what-if key"),
        pytest.param([*BASE, "--mode", "both"], "--mode must be", id="bad mode"),
        pytest.param([*BASE, "--engine", "gurobi"], "unknown engine", id="bad engine"),
        pytest.param(
            [*BASE[:-2], "--slo-tpot-ms", "10"], "no usable profile", id="SLO nothing was profiled at"
        ),
        pytest.param(
            ["plan", "--melange", "x.json", "--gpus", "A10G"],
            "--melange takes the whole problem",
            id="melange plus gpus",
        ),
        pytest.param(
            [
                "plan",
                "--workload",
                str(PLACEMENT / "workload.yaml"),
                "--gpus",
                "A10G",
                *PROFILES[2:4],
                "--slo-tpot-ms",
                "40",
            ],
            "--drop-unservable",
            id="unservable buckets named",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(app: typer.Typer, args: list[str], message: str) -> None:
    result = run(app, *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_registered_under_mosaic() -> None:
    from server.cli import COMMAND_MODULES

    assert "server.commands.plan" in COMMAND_MODULES
