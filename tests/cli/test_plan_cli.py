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

TRACE_A10G = ["plan", *PROFILES, "--gpus", "A10G", "--trace", str(HERE / "azure_small.csv")]


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


def test_a_rate_no_fleet_could_serve_is_one_what_if_row_error(app: typer.Typer) -> None:
    """rate=1e300 made SCIP print a C error and report a time-out; now the row says the rate is off."""
    rows = run_json(app, *BASE, "--what-if", "rate=20,1e300")["what_if"]
    assert [r["status"] for r in rows] == ["optimal", "error"]
    assert "instances even all on the fastest GPU type" in rows[1]["error"]


def test_melange_file_with_an_absurd_rate_exits_2(app: typer.Typer, tmp_path: Path) -> None:
    """total_request_rate 1e300 raised a TypeError inside CP-SAT (its integer domain overflowed)."""
    doc = {
        "gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2, 1], [5, 2]]}},
        "workload_distribution": [[0.2, 0.1], [0.5, 0.2]],
        "total_request_rate": 1e300,
    }
    path = tmp_path / "big.json"
    path.write_text(json.dumps(doc))
    result = run(app, "plan", "--melange", str(path))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: the demand needs at least 4e+299 instances")


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


def test_nodes_placement_takes_the_time_limit(app: typer.Typer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `--time-limit` never reached the placement, which always had 5 s, and its error said to raise
    the limit."""
    seen: list[float] = []
    place = plan_command.place_instances

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["time_limit_s"])
        return place(*args, **kwargs)

    monkeypatch.setattr(plan_command, "place_instances", spy)
    doc = run_json(app, *BASE, "--nodes", str(PLACEMENT / "nodes.yaml"), "--time-limit", "7.5")
    assert seen == [7.5] and doc["placement"]["status"] == "optimal"


@pytest.mark.parametrize("node_gpu", ["A100", "A100-80GB", "a100"])
def test_a_melange_plan_is_placed_on_nodes_of_its_gpus_any_spelling(
    app: typer.Typer, tmp_path: Path, node_gpu: str
) -> None:
    """Mélange's own inputs name the GPU "A100"; a node's GPU goes through the catalog (A100 → A100-80GB),
    so no spelling of it matched the plan's "A100" ("not enough free GPUs — A100: need 5 GPUs, 0 free")."""
    doc = {
        "gpu_info": {"A10G": {"cost": 1.01, "tputs": [[5, 1], [10, 5]]}, "A100": {"cost": 1.0, "tputs": [[20, 2], [50, 20]]}},
        "workload_distribution": [[0.25, 0.5], [0.25, 0.25]],
        "total_request_rate": 16,
        "slice_factor": 1,
    }  # fmt: skip
    melange = tmp_path / "m.json"
    melange.write_text(json.dumps(doc))
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(
        f"nodes:\n  - {{name: n1, gpu: A10G, gpus: 8}}\n  - {{name: n2, gpu: {node_gpu}, gpus: 8}}\n"
    )
    plan = run_json(app, "plan", "--melange", str(melange), "--nodes", str(nodes))
    assert plan["gpus"] == {"A100": 5} and plan["placement"]["status"] == "optimal"
    (node,) = [n for n in plan["placement"]["nodes"] if n["instances"]]
    assert node["name"] == "n2"


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
            [
                "plan",
                *PROFILES,
                "--gpus",
                "A10G",
                "--trace",
                str(HERE / "azure_small.csv"),
                "--slo-tpot-ms",
                "10",
            ],
            "no usable profile: llama-3-8b/A100-80GB: no profile at or under TPOT 10 ms",
            id="trace with an SLO nothing was profiled at",
        ),
        pytest.param(
            [*TRACE_A10G, "--slo-tpot-ms", "40", "--window-s", "0.001"],
            "into 1,183,016 windows, more than 1,000: use windows of at least 2 s",
            id="a window so short the plan has a million windows (it ran for hours)",
        ),
        pytest.param(
            [*BASE[:3], "--gpus", "A10G,L4,A10G", *BASE[5:]],
            "--gpus: GPU A10G is given twice",
            id="--gpus list naming a type twice (merged silently)",
        ),
        pytest.param(
            [*BASE[:3], "--gpus", "A10G,B200", *BASE[5:]],
            "--gpus: GPU B200 is not in the catalog; valid GPUs: T4, A10G, L4",
            id="--gpus list naming an unknown GPU lists the valid ones (it said: give cost_per_hour)",
        ),
        pytest.param(
            [*BASE[:3], "--gpus", "A100,A100-80GB", *BASE[5:]],
            "--gpus: GPU A100-80GB is given twice (also as A100), both A100-80GB",
            id="--gpus list naming a type by its alias and its name",
        ),
        pytest.param(
            [*BASE, "--engine", "scip", "--time-limit", "1e300"],
            "time limit must be > 0 s and ≤ 86400 s",
            id="time limit past a day (SCIP's millisecond limit overflowed)",
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


def test_a_trace_of_unknown_format_names_the_flag_plan_takes(app: typer.Typer, tmp_path: Path) -> None:
    """The trace readers end an unknown header with "use --format" (replay's and simulate's flag); plan's
    flag is --trace-format, and `mosaic plan --format` is an unknown option."""
    trace = tmp_path / "t.csv"
    trace.write_text("a,b,c\n1,2,3\n")
    result = run(app, "plan", *PROFILES, "--gpus", "A10G", "--trace", str(trace), "--slo-tpot-ms", "40")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "unrecognised header" in lines[0], result.output
    assert lines[0].endswith("use --trace-format"), lines[0]


def test_a_trace_model_no_profile_covers_lists_the_ones_they_do(app: typer.Typer) -> None:
    result = run(app, *TRACE_A10G, "--slo-tpot-ms", "40", "--model", "gpt-9")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines == ["error: no profile for model 'gpt-9'; the profiles cover llama-3-8b"], lines


def test_registered_under_mosaic() -> None:
    from server.cli import COMMAND_MODULES

    assert "server.commands.plan" in COMMAND_MODULES


LLAMA = Path(__file__).parent.parent.parent / "placement" / "profiles" / "llama-3-8b"
SYNTHETIC = [
    "plan",
    "--trace",
    "synthetic:rate=20,duration=600,input=lognormal:700:1.0,output=lognormal:180:0.9,seed=1",
    "--gpus",
    "A10G,L40S,A100-80GB,H100-SXM",
    *(a for g in ("A10G", "L40S", "A100-80GB", "H100-SXM") for a in ("--profile", str(LLAMA / f"{g}.yaml"))),
    "--slo-tpot-ms",
    "40",
    "--drop-unservable",
]


def test_a_window_longer_than_the_trace_keeps_the_traces_rate(app: typer.Typer) -> None:
    # 10 min at 20 req/s binned in 1 h windows: the one (partial) window covers 600 s, not 3600 (was 3.32 req/s
    # and 1× A100); the plan equals the one without --window-s.
    whole = run_json(app, *SYNTHETIC)
    windowed = run_json(app, *SYNTHETIC, "--window-s", "3600")
    for doc in (whole, windowed):
        assert doc["cost_per_hour"] == 12.17 and doc["gpus"] == {"A100-80GB": 1, "H100-SXM": 2}
        served = sum(a["rate"] for a in doc["assignment"]) + sum(d["rate"] for d in doc["dropped"])
        assert served == pytest.approx(20.0, rel=0.01)


def test_dropped_rows_say_why_they_were_dropped(app: typer.Typer) -> None:
    result = run(app, *SYNTHETIC)
    assert result.exit_code == 0, result.output
    dropped = [line for line in result.output.splitlines() if line.startswith("dropped")]
    assert dropped == ["dropped: llama-3-8b (0.206667 req/s) — outside the profiled lengths"]


def _melange_file(tmp_path: Path, tputs_a100: list[list[float]]) -> str:
    data = {
        "gpu_info": {
            "A10G": {"cost": 1.01, "tputs": [[2, 1], [5, 0]]},
            "A100-80GB": {"cost": 3.67, "tputs": tputs_a100},
        },
        "workload_distribution": [[0.2, 0.1], [0.5, 0.2]],
        "total_request_rate": 30.0,
        "slice_factor": 1,
    }
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_melange_honours_drop_unservable(app: typer.Typer, tmp_path: Path) -> None:
    # bucket (1, 1) (0.2 · 30 = 6 req/s) has throughput 0 on both GPUs. Dropped, the rest fits one A100:
    # 6/20 + 3/20 + 15/40 = 0.825 → 1 × $3.67.
    path = _melange_file(tmp_path, [[20, 20], [40, 0]])
    refused = run(app, "plan", "--melange", path)
    assert refused.exit_code == 2 and "pass --drop-unservable" in refused.output
    doc = run_json(app, "plan", "--melange", path, "--drop-unservable")
    assert doc["gpus"] == {"A100-80GB": 1} and doc["cost_per_hour"] == 3.67
    assert doc["dropped"] == [
        {
            "model": "melange",
            "bucket": "in#1 out#1",
            "rate": 6.0,
            "reason": "no GPU type serves it within the SLO",
        }
    ]


def test_melange_dropping_everything_is_an_error(app: typer.Typer, tmp_path: Path) -> None:
    data = {
        "gpu_info": {"A10G": {"cost": 1.01, "tputs": [[0]]}},
        "workload_distribution": [[1.0]],
        "total_request_rate": 30.0,
    }
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    result = run(app, "plan", "--melange", str(path), "--drop-unservable")
    assert result.exit_code == 2
    assert result.output.strip() == "error: all 30 req/s fall outside the profiles/SLO; nothing left to plan"


MELANGE_EXAMPLE = ["plan", "--melange", str(PLACEMENT / "workload.yaml")]  # never read: refused first


@pytest.mark.parametrize(
    ("args", "message"),
    [
        *(
            pytest.param(
                [*BASE, flag, value],
                f"{flag} applies to --trace only",
                id=f"{flag} with --workload → refused",
            )
            for flag, value in (
                ("--rate", "5"),
                ("--window-s", "600"),
                ("--model", "llama-3-8b"),
                ("--trace-format", "azure"),
            )
        ),
        pytest.param(
            [*MELANGE_EXAMPLE, "--rate", "5"], "--rate applies to --trace only", id="--rate with --melange"
        ),
        pytest.param(
            [*MELANGE_EXAMPLE, "--window-s", "60"],
            "--window-s applies to --trace only",
            id="--window-s with --melange",
        ),
        pytest.param(
            [*MELANGE_EXAMPLE, "--slo-tpot-ms", "40"],
            "--slo-tpot-ms does not apply to --melange",
            id="--slo-tpot-ms with --melange",
        ),
        pytest.param(
            [*MELANGE_EXAMPLE, "--slo-ttft-ms", "400"],
            "--slo-ttft-ms does not apply to --melange",
            id="--slo-ttft-ms with --melange",
        ),
        pytest.param(
            [*MELANGE_EXAMPLE, "--mode", "pd"],
            "--mode does not apply to --melange",
            id="--mode with --melange",
        ),
        pytest.param(
            [*BASE, "--same-domain", "require"], "--same-domain applies with --nodes only", id="no nodes"
        ),
        pytest.param(
            [*BASE[:3], "--gpus", "/nonexistent.yaml", *BASE[5:]],
            "--gpus /nonexistent.yaml: no such file",
            id="--gpus path that does not exist → no such file",
        ),
        pytest.param(
            [*BASE[:3], "--gpus", "gpus.yaml", *BASE[5:]],
            "--gpus gpus.yaml: no such file",
            id="--gpus file name that does not exist → no such file",
        ),
    ],
)
def test_flags_that_do_not_apply_are_refused(app: typer.Typer, args: list[str], message: str) -> None:
    result = run(app, *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


WINDOWED = """schema: mosaic.workload/v1
model: llama-3-8b
input_edges: [1, 512, 2048, 8193]
output_edges: [1, 128, 512, 2049]
windows:
  - {{duration_s: {duration}, rate: 20, histogram: [[40, 20, 5], [15, 10, 3], [4, 2, 1]]}}
  - {{duration_s: 3600, rate: 10, histogram: [[40, 20, 5], [15, 10, 3], [4, 2, 1]]}}
"""


@pytest.mark.parametrize(
    ("name", "text", "flag", "message"),
    [
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A10G: {max: .inf}\n",
            "--gpus",
            "GPU A10G: max must be a whole number ≥ 0, got inf",
            id="--gpus max .inf",
        ),
        pytest.param(
            "m.json",
            '{"gpu_info": {"A10G": {"cost": 1, "tputs": [[2]], "max_count": Infinity}},'
            ' "workload_distribution": [[1]], "total_request_rate": 1}',
            "--melange",
            "gpu_info.A10G.max_count must be a whole number ≥ 0, got inf",
            id="--melange max_count Infinity",
        ),
        pytest.param(
            "nodes.yaml",
            "nodes:\n  - {name: n, gpu: A100-80GB, gpus: .inf}\n",
            "--nodes",
            "nodes[0].gpus must be a whole number ≥ 1, got inf",
            id="--nodes gpus .inf",
        ),
        pytest.param(
            "nodes.yaml",
            "max_group_gpus: abc\nnodes:\n  - {name: n, gpu: A100-80GB, gpus: 8}\n",
            "--nodes",
            "max_group_gpus must be a whole number ≥ 1, got 'abc'",
            id="--nodes max_group_gpus abc",
        ),
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A10G: {cost_per_hour: .inf}\n",
            "--gpus",
            "GPU A10G: cost_per_hour must be a finite number ≥ 0, got inf",
            id="--gpus cost .inf (said ≥ 0, with the GPU named twice)",
        ),
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A10G: {cost_per_hour: yes}\n",
            "--gpus",
            "GPU A10G: cost_per_hour must be a finite number ≥ 0, got True",
            id="--gpus cost yes (read as $1/h)",
        ),
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A10G: {cost_per_hour: '2'}\n",
            "--gpus",
            "GPU A10G: cost_per_hour must be a finite number ≥ 0, got '2'",
            id="--gpus cost a string",
        ),
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A10G: {min: 3, max: 2}\n",
            "--gpus",
            "GPU A10G: need 0 ≤ min_gpus ≤ max_gpus, got 3, 2",
            id="--gpus max under min (the GPU was named twice)",
        ),
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A100: {}\n  a100-80gb: {}\n",
            "--gpus",
            "GPU a100-80gb is given twice (also as A100), both A100-80GB",
            id="--gpus one type under two names (merged silently)",
        ),
        pytest.param(
            "nodes.yaml",
            "nodes:\n  - {name: n1, gpu: H900, gpus: 8}\n",
            "--nodes",
            "nodes[0] (n1): GPU 'H900' is neither in the catalog nor offered (A100-80GB, A10G, L4)",
            id="--nodes unknown GPU (accepted, its nodes never used)",
        ),
        pytest.param(
            "nodes.yaml",
            "nodes:\n  - {name: n1, gpu: A10G, gpus: 4, used: 5}\n",
            "--nodes",
            "nodes[0] (n1): used (5) must be ≤ gpus (4)",
            id="--nodes used over gpus (named neither file nor node)",
        ),
        pytest.param(
            "nodes.yaml",
            "nodes:\n  - {name: n1, gpu: A10G, gpus: 4}\n  - {name: n1, gpu: L4, gpus: 4}\n",
            "--nodes",
            "nodes[1] (n1): node names must be unique; n1 is given twice",
            id="--nodes duplicate name (named neither file nor node)",
        ),
        # a key given twice in a JSON object: json kept the last without a word (YAML refuses it)
        pytest.param(
            "gpus.json",
            '{"gpus": {"A10G": {"cost_per_hour": 1.01}, "A10G": {"cost_per_hour": 0.01}}}',
            "--gpus",
            "not valid JSON: key 'A10G' is given twice in one mapping",
            id="--gpus JSON key given twice (the $0.01 price won)",
        ),
        pytest.param(
            "m.json",
            '{"gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2]]}, "A10G": {"cost": 0.01, "tputs": [[2]]}},'
            ' "workload_distribution": [[1]], "total_request_rate": 1}',
            "--melange",
            "not valid JSON: key 'A10G' is given twice in one mapping",
            id="--melange JSON key given twice",
        ),
        pytest.param(
            "p.json",
            json.dumps(json.loads((PLACEMENT / "llama3-l4-tpot40.json").read_text())).replace(
                '"gpu": "L4"', '"gpu": "L4", "gpu": "A100-80GB"'
            ),
            "--profile",
            "not valid JSON: key 'gpu' is given twice in one mapping",
            id="--profile JSON key given twice",
        ),
        pytest.param(
            "nodes.json",
            '{"nodes": [{"name": "a", "gpu": "A100-80GB", "gpus": 8, "gpus": 1}]}',
            "--nodes",
            "not valid JSON: key 'gpus' is given twice in one mapping",
            id="--nodes JSON key given twice",
        ),
        # integers past float range: OverflowError tracebacks
        pytest.param(
            "m.json",
            '{"gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2]]}}, "workload_distribution": [[1]],'
            ' "total_request_rate": 1' + "0" * 400 + "}",
            "--melange",
            "total_request_rate must be a finite number ≥ 0, got an integer of 401 digits",
            id="--melange total_request_rate 10**400",
        ),
        pytest.param(
            "m.json",
            '{"gpu_info": {"A10G": {"cost": 1.01, "tputs": [[1' + "0" * 400 + "]]}},"
            ' "workload_distribution": [[1]], "total_request_rate": 1}',
            "--melange",
            "gpu_info.A10G.tputs: cells must be finite and ≥ 0",
            id="--melange tputs cell 10**400",
        ),
        # finite but past what the solvers handle: a plan below the floor, or SCIP's "objective is infinite"
        # printed before a misleading "no solution within the time limit"
        pytest.param(
            "m.json",
            '{"gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2]], "min_count": 100000000000000000000000}},'
            ' "workload_distribution": [[1]], "total_request_rate": 1}',
            "--melange",
            "gpu_info.A10G.min_count must be ≤ 10,000,000 (the planner's limit), got 1e+23",
            id="--melange min_count 1e23 (planned below it)",
        ),
        pytest.param(
            "m.json",
            '{"gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2]], "max_count": 100000000000000000000000}},'
            ' "workload_distribution": [[1]], "total_request_rate": 1}',
            "--melange",
            "gpu_info.A10G.max_count must be ≤ 10,000,000 (the planner's limit), got 1e+23",
            id="--melange max_count 1e23",
        ),
        pytest.param(
            "m.json",
            '{"gpu_info": {"A10G": {"cost": 1e56, "tputs": [[2]]}}, "workload_distribution": [[1]],'
            ' "total_request_rate": 1}',
            "--melange",
            "gpu_info.A10G.cost must be ≤ 1,000,000 (the planner's limit), got 1e+56",
            id="--melange cost 1e56",
        ),
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A100-80GB: {}\n  A10G: {min: 100000000000000000000000}\n",
            "--gpus",
            "GPU A10G: min must be ≤ 10,000,000 (the planner's limit), got 1e+23",
            id="--gpus min 1e23",
        ),
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A100-80GB: {max: 20000000}\n  A10G: {}\n",
            "--gpus",
            "GPU A100-80GB: max must be ≤ 10,000,000 (the planner's limit), got 20000000",
            id="--gpus max 2e7",
        ),
        pytest.param(
            "gpus.yaml",
            "gpus:\n  A100-80GB: {}\n  A10G: {cost_per_hour: 1.0e+56}\n",
            "--gpus",
            "GPU A10G: cost_per_hour must be ≤ 1,000,000 (the planner's limit), got 1e+56",
            id="--gpus cost_per_hour 1e56 (SCIP: objective value is infinite)",
        ),
        pytest.param(
            "p.yaml",
            (PLACEMENT / "llama3-a100-tpot40.yaml")
            .read_text()
            .replace("tp: 1", "tp: 100000000000000000000000000000"),
            "--profile",
            "field tp: Input should be less than or equal to 10000000",
            id="--profile tp 1e29 (SCIP: objective value is infinite)",
        ),
        pytest.param(
            "nodes.yaml",
            "nodes:\n  - {name: a, gpu: A100-80GB, gpus: 100000000000000000000}\n",
            "--nodes",
            "nodes[0].gpus must be ≤ 10,000,000 (the planner's limit), got 1e+20",
            id="--nodes gpus 1e20 (a CP-SAT traceback)",
        ),
        # a window of infinite length made --json print Infinity/NaN (not JSON)
        pytest.param(
            "w.yaml",
            WINDOWED.format(duration=".inf"),
            "--workload",
            "field models[0].windows[0].duration_s: Input should be a finite number",
            id="--workload window duration_s .inf",
        ),
        pytest.param(
            "w.yaml",
            WINDOWED.format(duration="1.0e+308"),
            "--workload",
            "field models[0].windows[0].duration_s: Input should be less than or equal to 1000000000",
            id="--workload window duration_s 1e308 (two of them sum to inf)",
        ),
    ],
)
def test_bad_counts_in_files_exit_2_with_one_line(
    app: typer.Typer, tmp_path: Path, name: str, text: str, flag: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    if flag == "--melange":
        args = ["plan", "--melange", str(path)]
    elif flag == "--gpus":
        args = [*BASE[:3], "--gpus", str(path), *BASE[5:]]
    elif flag == "--workload":
        args = ["plan", "--workload", str(path), *BASE[3:]]
    elif flag == "--profile":
        args = [*BASE, "--profile", str(path)]
    else:
        args = [*BASE, "--nodes", str(path)]
    result = run(app, *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines == [f"error: {path}: {message}"]


@pytest.mark.parametrize(
    ("rate", "needs"),
    [
        pytest.param("1e-9", "1.99e-10", id="before: no fleet serves the demand even without caps"),
        pytest.param("1e-300", "1.19e-300", id="before: a $0.00/h plan, exit 0"),
    ],
)
def test_a_demand_below_the_load_tolerance_is_refused(
    app: typer.Typer, tmp_path: Path, rate: str, needs: str
) -> None:
    """The load check forgives 1e-9 of an instance as float noise, so a whole demand that small was planned
    as nothing, or found infeasible with a message contradicting itself."""
    path = tmp_path / "workload.yaml"
    path.write_text((PLACEMENT / "workload.yaml").read_text().replace("rate: 20 ", f"rate: {rate} "))
    result = run(app, "plan", "--workload", str(path), *BASE[3:])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: the demand is too small to plan: its busiest window needs {needs} of an instance, below the"
        " planner's resolution (1e-09); check the rates"
    ]


def test_node_inventory_gpu_names_take_aliases_and_case(app: typer.Typer, tmp_path: Path) -> None:
    nodes = (
        (PLACEMENT / "nodes.yaml").read_text().replace("gpu: A10G", "gpu: a10g").replace("A100-80GB", "a100")
    )
    path = tmp_path / "nodes.yaml"
    path.write_text(nodes)
    doc = run_json(app, *BASE, "--nodes", str(path))
    assert doc["placement"]["status"] in ("optimal", "feasible")


def test_a_gpu_profiled_under_its_alias_is_one_option(app: typer.Typer, tmp_path: Path) -> None:
    """`gpu: a100` and `gpu: A100-80GB` are one GPU: two options of one key made the header say 7 GPUs while
    instances[] summed to 8 and --nodes placed 8. With the alias the plan is the one without it."""
    alias = tmp_path / "a100-alias.yaml"
    alias.write_text(
        (PLACEMENT / "llama3-a100-tpot40.yaml").read_text().replace("gpu: A100-80GB", "gpu: a100")
    )
    doc = run_json(app, *BASE, "--profile", str(alias), "--nodes", str(PLACEMENT / "nodes.yaml"))
    assert [(r["key"], r["count"]) for r in doc["instances"]] == [
        ("llama-3-8b/A100-80GB", 4),
        ("llama-3-8b/A10G", 2),
        ("llama-3-8b/L4", 1),
    ]
    assert doc["gpus"] == {"A100-80GB": 4, "A10G": 2, "L4": 1} and doc["cost_per_hour"] == 17.4
    placed = [i for n in doc["placement"]["nodes"] for i in n["instances"]]
    assert sorted(placed) == ["llama-3-8b/A100-80GB ×4", "llama-3-8b/A10G ×2", "llama-3-8b/L4 ×1"]
    # without an SLO to choose by, two profiles of one GPU are ambiguous, whatever they call it
    result = run(app, *BASE[:-2], "--profile", str(alias))
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: 2 profiles for llama-3-8b/A100-80GB (SLOs ['TPOT 40 ms', 'TPOT 40 ms']): give the SLO to choose"
    ]


def test_a_trace_is_binned_on_the_grid_of_the_profiles_the_plan_uses(app: typer.Typer) -> None:
    """A profile of a GPU not offered (the repo's L4 profile, on another bucket grid) listed first gave the
    trace its grid, and the plan then refused it ("workload of llama-3-8b uses bucket edges …"); in the
    other order it planned. Not offered, it is noted and not used, whatever the order."""
    l4 = str(Path(__file__).resolve().parents[2] / "placement" / "profiles" / "llama-3-8b" / "L4.yaml")
    a100 = str(PLACEMENT / "llama3-a100-tpot40.yaml")
    trace = "synthetic:rate=5,duration=600,input=lognormal:700:1.0,output=lognormal:180:0.9,seed=1"
    args = ["plan", "--trace", trace, "--drop-unservable", "--gpus", "A100-80GB"]
    first = run_json(app, *args, "--profile", l4, "--profile", a100)
    second = run_json(app, *args, "--profile", a100, "--profile", l4)
    assert first["cost_per_hour"] == second["cost_per_hour"] and first["gpus"] == second["gpus"]
    assert "L4: profiled but not offered; its profiles are not used" in first["notes"]


def test_a_model_given_twice_under_two_spellings_is_refused(app: typer.Typer, tmp_path: Path) -> None:
    """llama-3-8b and Llama-3-8B are one model: the fleet was sized for both rows' demand while the routing
    hints (`assignment`) covered one of them."""
    row = "input_edges: [1, 512, 2048, 8193], output_edges: [1, 128, 512, 2049], rate: 5, histogram: [[1,1,1],[1,1,1],[1,1,1]]"
    path = tmp_path / "w.yaml"
    path.write_text(
        f"schema: mosaic.workload/v1\nmodels:\n - {{model: llama-3-8b, {row}}}\n - {{model: Llama-3-8B, {row}}}\n"
    )
    result = run(app, "plan", "--workload", str(path), *BASE[3:])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: model Llama-3-8B appears twice in the workload (also as llama-3-8b)"
    ]


def test_two_different_profiles_of_one_gpu_at_one_slo_are_refused(app: typer.Typer, tmp_path: Path) -> None:
    """Both fit the target and neither is looser: the plan took whichever came first on the command line
    ($18.35/h one way, $11.01/h the other, no word). Identical copies (above) stay one option."""
    faster = tmp_path / "a100-faster.yaml"
    faster.write_text(
        (PLACEMENT / "llama3-a100-tpot40.yaml").read_text().replace("[12.0, 6.0, 2.0]", "[120.0, 60.0, 20.0]")
    )
    result = run(app, *BASE, "--profile", str(faster))
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: 2 different profiles for llama-3-8b/A100-80GB at one SLO (TPOT 40 ms): give one of them"
    ]


def test_json_output_never_holds_infinity(app: typer.Typer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-finite number reaching the document is an error line, not `Infinity` (which is not JSON)."""
    monkeypatch.setattr(plan_command, "run_plan", lambda opts: {"hours": float("inf")})
    result = run(app, *BASE, "--json")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the plan holds a value JSON cannot carry")
