"""`mosaic simulate` bad input: an empty trace, engine knobs vLLM would refuse, policy parameters that are not
finite and > 0 (or static counts outside a pool's bounds) — exit 2 with one `error:` line, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.cli import build_app

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "docs" / "examples" / "fleet-pd.yaml"  # prefill-h100 1..8, decode-a100 1..16
SYNTH = "synthetic:rate=50,n=3,input=32,output=4"


def simulate(*args: str) -> tuple[int, str, list[str]]:
    result = CliRunner().invoke(build_app(), ["simulate", *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "Traceback" not in result.output
    return result.exit_code, result.output, lines


def test_an_empty_trace_is_refused_up_front(tmp_path: Path) -> None:
    trace = tmp_path / "empty.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    code, _, lines = simulate("--trace", str(trace), "--fleet", str(FLEET), "--policy", "fixed")
    assert code == 2
    assert lines == [f"error: the trace has no requests: {trace} is empty"]


def test_a_trace_whose_every_row_is_left_out_says_so_not_empty(tmp_path: Path) -> None:
    trace = tmp_path / "zeros.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,100,0\n2023-11-16 18:15:47.6805900,0,10\n"
    )
    code, _, lines = simulate("--trace", str(trace), "--fleet", str(FLEET), "--policy", "fixed")
    assert code == 2
    assert lines == [
        f"error: the trace has no requests: {trace} has 2 row(s), all left out "
        "(zero_input_tokens 1, zero_output_tokens 1)"
    ]


def test_a_step_budget_below_max_num_seqs_names_the_field(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET.read_text() + "engine: {max_num_batched_tokens: 8}\n")
    code, _, lines = simulate("--trace", SYNTH, "--fleet", str(fleet))
    assert code == 2
    assert lines == [
        f"error: {fleet}: engine: max_num_batched_tokens (8) must be ≥ max_num_seqs (256); "
        "lower max_num_seqs or raise max_num_batched_tokens"
    ]


def test_any_value_error_building_the_simulator_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("block_size must be ≥ 1, got 0")

    monkeypatch.setattr("server.commands.simulate.ClusterSimulator", refuse)
    code, _, lines = simulate("--trace", SYNTH, "--fleet", str(FLEET))
    assert code == 2
    assert lines == [f"error: cannot simulate fleet {FLEET}: block_size must be ≥ 1, got 0"]


BAD = "bad parameter: "


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        pytest.param(
            "static:decode-a100=-3",
            "policy 'static:decode-a100=-3': " + BAD + "the count of pool 'decode-a100' must be an integer "
            "≥ 0 (static:POOL=N), got '-3'",
            id="a negative static count",
        ),
        pytest.param(
            "static:decode-a100=2.5",
            "policy 'static:decode-a100=2.5': " + BAD + "the count of pool 'decode-a100' must be an integer "
            "≥ 0 (static:POOL=N), got '2.5'",
            id="a fractional static count",
        ),
        pytest.param(
            "static:decode-a100=17",
            "policy 'static:decode-a100=17': " + BAD + "the count of pool 'decode-a100' (17) is outside its "
            "min_replicas..max_replicas (1..16)",
            id="a static count above max_replicas",
        ),
        pytest.param(
            "static:prefill-h100=0",
            "policy 'static:prefill-h100=0': " + BAD + "the count of pool 'prefill-h100' (0) is outside its "
            "min_replicas..max_replicas (1..8)",
            id="a static count below min_replicas",
        ),
        pytest.param(
            "dynamo:-5",
            "policy 'dynamo:-5': " + BAD + "the re-planning interval in seconds (dynamo:I) must be a finite "
            "number > 0, got -5",
            id="a negative dynamo interval",
        ),
        pytest.param(
            "dynamo:0",
            "policy 'dynamo:0': " + BAD + "the re-planning interval in seconds (dynamo:I) must be a finite "
            "number > 0, got 0",
            id="a zero dynamo interval",
        ),
        pytest.param(
            "dynamo:nan",
            "policy 'dynamo:nan': " + BAD + "the re-planning interval in seconds (dynamo:I) must be a finite "
            "number > 0, got nan",
            id="a NaN dynamo interval",
        ),
        pytest.param(
            "hpa-waiting:inf",
            "policy 'hpa-waiting:inf': " + BAD + "the waiting requests per replica (hpa-waiting:T) must be a "
            "finite number > 0, got inf",
            id="an infinite hpa-waiting target",
        ),
        pytest.param(
            "hpa-util:nan",
            "policy 'hpa-util:nan': " + BAD + "the GPU-utilisation target (hpa-util:T) must be a finite "
            "number in (0, 1], got nan",
            id="a NaN hpa-util target",
        ),
        pytest.param(
            "hpa-util:70",
            "policy 'hpa-util:70': " + BAD + "the GPU-utilisation target (hpa-util:T) must be a finite "
            "number in (0, 1], got 70",
            id="a percentage for a fraction",
        ),
        pytest.param(
            "mosaic:3", "policy 'mosaic:3': " + BAD + "mosaic takes no parameter", id="mosaic takes none"
        ),
    ],
)
def test_bad_policy_parameters_exit_2(policy: str, message: str) -> None:
    code, _, lines = simulate("--trace", SYNTH, "--fleet", str(FLEET), "--policy", policy)
    assert code == 2
    assert lines == [f"error: {message}"]


@pytest.mark.parametrize(
    "policy", ["static:decode-a100=16,prefill-h100=1", "dynamo:30", "hpa-util:1", "hpa-waiting:0.5"]
)
def test_good_policy_parameters_run(policy: str) -> None:
    code, output, _ = simulate("--trace", SYNTH, "--fleet", str(FLEET), "--policy", policy, "--json")
    assert code == 0, output


POOLS = "pools:\n  - {name: decode-a100, gpu: A100-80GB, role: mixed, %s}\n"


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        pytest.param(
            "replicas: 1000000000, max_replicas: 1000000000",
            "pools.0.replicas: Input should be less than or equal to 1000",
            id="a billion replicas (the simulator hung building them)",
        ),
        pytest.param(
            "replicas: 20, max_replicas: 16",
            "pools.0: pool decode-a100: replicas (20) must be ≤ max_replicas (16)",
            id="replicas over max_replicas",
        ),
        pytest.param(
            "replicas: yes", "pools.0.replicas: Input should be a valid integer", id="a boolean read as 1"
        ),
        pytest.param(
            "replicas: '3'", "pools.0.replicas: Input should be a valid integer", id="a quoted count"
        ),
        pytest.param(
            "cost_per_hour: yes",
            "pools.0.cost_per_hour: Input should be a valid number",
            id="a boolean price",
        ),
    ],
)
def test_bad_pool_counts_in_the_fleet_file_exit_2(tmp_path: Path, pool: str, message: str) -> None:
    fleet, lines = refused_fleet(tmp_path, POOLS % pool)
    assert lines == [f"error: {fleet}: {message}"]


def refused_fleet(tmp_path: Path, text: str) -> tuple[Path, list[str]]:
    """`mosaic simulate` over a fleet file of `text`: exit 2; the file and the output's lines."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(text)
    code, _, lines = simulate("--trace", SYNTH, "--fleet", str(fleet), "--policy", "fixed")
    assert code == 2
    return fleet, lines


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        pytest.param(
            "  - {name: p, gpu: H100, role: prefill, replicas: 1}\n",
            "{fleet}: (top level): model 'llama-3-8b' has only prefill pools (p): a prefill instance does not "
            "finish a request; add a decode or mixed pool",
            id="prefill pools only: every request failed wrong_role",
        ),
        pytest.param(
            "  - {name: d, gpu: L4, role: mixed, replicas: 1, tp: 3}\n",
            "pool d: tp 3: Total number of attention heads (32) must be divisible by tensor parallel size (3).",
            id="a tp vLLM refuses: it was simulated and billed as 3 GPUs",
        ),
    ],
)
def test_fleets_vllm_could_not_run_exit_2(tmp_path: Path, pools: str, message: str) -> None:
    fleet, lines = refused_fleet(tmp_path, "model: llama-3-8b\npools:\n" + pools)
    assert lines == ["error: " + message.format(fleet=fleet)]


def test_exponents_without_a_dot_are_numbers_in_the_fleet_file(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML) reads 1.2e1 as a string; strict fields would refuse it, so the loader reads 1.2 floats."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("cold_start_s: 1.2e1\nkv_link_gbps: 2.5e1\n" + POOLS % "replicas: 1")
    code, output, _ = simulate("--trace", SYNTH, "--fleet", str(fleet), "--policy", "fixed", "--json")
    assert code == 0, output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--rate-scale", "1e-300"], "is past what the simulator can reach", id="finite but unreachable"),
        pytest.param(["--rate-scale", "1e-320"], "puts a request at infinity", id="scale overflowing to inf"),
        pytest.param(["--rate", "1e-320"], "is past what the simulator can reach", id="rate so low the gap is inf"),
        pytest.param(["--rate", "2", "--rate-scale", "2"], "give one", id="rate and scale together, as replay"),
    ],
)  # fmt: skip
def test_arrivals_the_simulator_cannot_reach_are_refused(args: list[str], message: str) -> None:
    """These hung: scrape and decision events kept rescheduling themselves while an arrival at ~1e299 s (or
    inf) was still pending, and t + interval == t."""
    code, _, lines = simulate("--trace", SYNTH, "--fleet", str(FLEET), *args)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_the_report_counts_the_rows_the_reader_dropped(tmp_path: Path) -> None:
    """Two of four Azure rows have a zero length: the report said 2 requests, 2 completed, and nothing of
    the other two; it now carries the reader's counts, as replay's report does."""
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,100,10\n2023-11-16 18:15:46.7805900,100,0\n"
        "2023-11-16 18:15:46.8805900,0,10\n2023-11-16 18:15:46.9805900,120,12\n"
    )
    out = tmp_path / "r.json"
    code, _, _ = simulate(
        "--trace", str(trace), "--fleet", str(FLEET), "--policy", "fixed", "--out", str(out)
    )
    report = json.loads(out.read_text())
    assert code == 0 and report["trace_requests"] == 2
    assert report["trace"]["dropped"] == 2
    assert report["trace"]["dropped_by_reason"] == {"zero_input_tokens": 1, "zero_output_tokens": 1}


@pytest.mark.parametrize("field", ["decision_interval_s", "scrape_interval_s"])
def test_an_interval_too_small_to_move_the_clock_is_refused(tmp_path: Path, field: str) -> None:
    """`t + 1e-20 == t`: the event fired at the same instant forever (the run spun without output)."""
    fleet = tmp_path / "fleet.yaml"
    text = "\n".join(
        f"{field}: 1.0e-20" if line.startswith(f"{field}:") else line
        for line in FLEET.read_text().splitlines()
    )
    assert f"{field}: 1.0e-20" in text
    fleet.write_text(text + "\n")
    code, _, lines = simulate("--trace", SYNTH, "--fleet", str(fleet))
    assert code == 2 and len(lines) == 1 and field in lines[0] and "0.001" in lines[0], lines


@pytest.mark.parametrize("field", ["kv_link_gbps", "kv_link_cross_domain_gbps"])
def test_a_kv_link_too_slow_to_ever_deliver_is_refused(tmp_path: Path, field: str) -> None:
    """1e-300 GB/s: a prompt's KV took ~1e300 s to cross while scrapes and decisions ticked on (the run never
    ended, without a word). At least 1 MB/s."""
    pools = "  - {name: p, gpu: H100, role: prefill, replicas: 1}\n  - {name: d, gpu: A100-80GB, role: decode, replicas: 1}\n"
    fleet, lines = refused_fleet(tmp_path, f"{field}: 1.0e-300\npools:\n{pools}")
    assert lines == [f"error: {fleet}: {field}: Input should be greater than or equal to 0.001"]


def test_a_pool_named_like_the_time_key_is_refused(tmp_path: Path) -> None:
    """A pool named `t` overwrote each replicas sample's time with its count, and was left out of the plot."""
    fleet, lines = refused_fleet(tmp_path, "pools:\n  - {name: t, gpu: L4, replicas: 1}\n")
    assert lines == [
        f"error: {fleet}: pools.0.name: pool name 't' is reserved: it is the time key of the report's replicas series"
    ]


def test_a_plot_folder_that_cannot_be_written_fails_before_the_run(tmp_path: Path) -> None:
    """Checked by writing into it: before, /proc passed the check (as root) and the run failed at its end
    with the report already written."""
    out = tmp_path / "r.json"
    code, _, lines = simulate(
        "--trace", SYNTH, "--fleet", str(FLEET), "--out", str(out), "--plot", "/proc/plots"
    )
    assert code == 2 and lines == [
        "error: --plot /proc/plots: cannot write into it (No such file or directory)"
    ]
    assert not out.exists()
