"""`mosaic profile --sim` and its engine driver: deterministic for a seed, monotone in the SLO, the file schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadgen.profile_search import SearchConfig, SearchSlo
from loadgen.profiling import Bucket, ProbePlan, bucket_requests, buckets, profile_grid
from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from placement.profiles import load_profile
from server.cli import build_app
from server.commands.profile import _rate
from simulator.profile_driver import sim_measure_factory

CAT = load_catalog()
A100 = PerfModel(CAT.gpu("A100-80GB"), CAT.model("llama-3-8b"))
PLAN = ProbePlan(min_window_s=10, min_requests=100, e2e_factor=1.0)  # short probes: a test, not a profile
IN, OUT = [1, 512, 2048], [1, 128, 512]
CFG = SearchConfig(0.1, 500.0, 0.05)


def grid(tpot_ms: float, seed: int = 1, perf: PerfModel = A100) -> list[list[float]]:
    return profile_grid(
        IN, OUT, sim_measure_factory(perf, seed=seed, plan=PLAN), SearchSlo(tpot_ms=tpot_ms), CFG
    ).max_rate


def test_deterministic_for_a_seed() -> None:
    assert grid(40, seed=1) == grid(40, seed=1)
    assert grid(40, seed=1) != grid(40, seed=2)  # different test requests, (slightly) different answers


def test_monotone_in_the_slo() -> None:
    tight, mid, loose = grid(25), grid(40), grid(80)
    for i in range(2):
        for j in range(2):
            assert 0 < tight[i][j] <= mid[i][j] <= loose[i][j], (i, j)
    assert loose[0][0] > tight[0][0]  # and the SLO matters


def test_longer_requests_sustain_lower_rates() -> None:
    g = grid(40)
    assert g[0][0] > g[1][0] and g[0][0] > g[0][1]  # short-short is the easiest bucket


def test_a_bucket_the_gpu_cannot_hold_is_zero_without_probing() -> None:
    # Llama-2-7B on a T4: 16 GB · (0.9 − 0.04) − 13.48 GB weights leaves ~534 tokens of KV (max_model_len)
    t4 = PerfModel(CAT.gpu("T4"), CAT.model("llama-2-7b"))
    factory = sim_measure_factory(t4, plan=PLAN)
    assert factory(Bucket(0, 0, 1, 256, 1, 64)) is not None  # ≤ 255 + 63 = 318 tokens fit
    assert factory(Bucket(0, 1, 1, 256, 256, 1024)) is None  # up to 255 + 1023 tokens do not


def test_bucket_requests_stay_in_the_bucket_and_within_context() -> None:
    b = buckets([1024, 4096], [1024, 4000])[0]
    reqs = [r for _, r in zip(range(500), bucket_requests(b, 4096, seed=0), strict=False)]
    assert all(1024 <= r.input_tokens < 4096 and 1024 <= r.output_tokens < 4000 for r in reqs)
    assert all(r.input_tokens + r.output_tokens <= 4096 for r in reqs)  # Llama-2's context


def test_profile_cli_writes_the_planner_schema(tmp_path: Path) -> None:
    out = tmp_path / "llama-3-8b" / "A100-80GB.yaml"
    args = ["profile", "--sim", "--gpu", "A100", "--model", "llama-3-8b", "--out", str(out)]
    args += [
        "--input-edges",
        "1,512,2048",
        "--output-edges",
        "1,128,512",
        "--slo-tpot-ms",
        "40",
        "--seed",
        "1",
    ]
    args += [
        "--probe-window-s",
        "10",
        "--probe-requests",
        "100",
        "--probe-e2e-factor",
        "1",
        "--min-rate",
        "0.1",
    ]
    args += ["--max-rate", "500"]
    res = CliRunner().invoke(build_app(), args)
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert (p.model, p.gpu, p.tp, p.source) == ("llama-3-8b", "A100-80GB", 1, "sim")
    assert p.slo.tpot_ms == 40 and p.input_edges == (1, 512, 2048) and p.output_edges == (1, 128, 512)
    assert [list(r) for r in p.max_rate] == [
        [_rate(x) for x in row] for row in grid(40)
    ]  # same as the API, to 6 significant figures rounded down
    assert p.measured is not None
    for i in range(2):
        for j in range(2):
            m = p.measured[i][j]
            assert (
                m is not None
                and m.rate == p.max_rate[i][j]
                and m.tpot_p90_ms is not None
                and m.tpot_p90_ms <= 40
            )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--gpu", "H100", "--model", "llama-3-8b"], "exactly one of --sim or --url", id="neither --sim nor --url"),
        pytest.param(["--sim", "--url", "http://x", "--gpu", "H100", "--model", "llama-3-8b"], "exactly one", id="both"),
        pytest.param(["--sim", "--gpu", "V100", "--model", "llama-3-8b"], "V100", id="unknown GPU names it"),
        pytest.param(["--sim", "--gpu", "H100", "--model", "llama-3-8b", "--input-edges", "1,1"], "strictly increasing", id="bad edges"),
        pytest.param(["--sim", "--gpu", "H100", "--model", "llama-3-8b", "--slo-tpot-ms", "0"], "give an SLO", id="no SLO at all"),
        pytest.param(["--url", "localhost:8000", "--gpu", "H100", "--model", "llama-3-8b"], "http://", id="URL without scheme"),
        pytest.param(["--sim", "--gpu", "H100", "--model", "llama-3-8b", "--resolution", "1e-9"],
                     "--resolution 1e-09 makes over 100,000 rates from --min-rate 0.01 to --max-rate 2000: "
                     "give --resolution ≥ 0.000123",
                     id="a rate grid too fine to hold (was a MemoryError)"),
        pytest.param(["--sim", "--gpu", "H100", "--model", "llama-3-8b", "--resolution", "1e-320"],
                     "give --resolution ≥ 0.000123", id="a resolution whose grid size overflows (was OverflowError)"),
        pytest.param(["--sim", "--gpu", "H100", "--model", "llama-3-8b", "--min-rate", "1e-300", "--max-rate", "1e300"],
                     "are too far apart for a rate grid", id="rates whose ratio overflows"),
    ],
)  # fmt: skip
def test_bad_profile_input_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    res = CliRunner().invoke(build_app(), ["profile", *args, "--out", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1, (
        res.output
    )


@pytest.mark.parametrize(
    ("rate", "written"),
    [
        pytest.param(0.00001, 0.00001, id="a passing 1e-5 req/s is not written as 0 ('cannot')"),
        pytest.param(0.000155, 0.000155, id="0.000155 is not written as 0.0002, above what was measured"),
        pytest.param(20.58, 20.58, id="a float just under its decimal stays"),
        pytest.param(123.456789, 123.456, id="6 significant figures, rounded down"),
        pytest.param(0.0, 0.0, id="0 stays 0"),
    ],
)
def test_rates_are_written_to_6_significant_figures_never_up(rate: float, written: float) -> None:
    assert _rate(rate) == written


def test_a_tp_past_what_a_profile_file_holds_exits_2_before_profiling(tmp_path: Path) -> None:
    args = ["profile", "--sim", "--gpu", "L4", "--model", "llama-3-8b", "--out", str(tmp_path / "x.yaml")]
    res = CliRunner().invoke(build_app(), [*args, "--slo-tpot-ms", "100", "--tp", "100000000"])
    assert res.exit_code == 2 and "--tp must be in 1..10,000,000, got 100000000" in res.output
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize(
    ("flag", "edges", "bucket"),
    [
        pytest.param("--input-edges", "1,20000", "[1, 20000)", id="an input bucket across the context"),
        pytest.param("--output-edges", "1,64,9000", "[64, 9000)", id="an output bucket across the context"),
    ],
)
def test_a_bucket_across_the_models_context_exits_2(
    tmp_path: Path, flag: str, edges: str, bucket: str
) -> None:
    """A bucket partly past the context was profiled with the lengths that fit, and `mosaic plan` then counted
    a 14,050-token request of the Azure trace as served by Llama-3-8B (8,192 tokens; helper walkthrough)."""
    args = ["profile", "--sim", "--gpu", "H100", "--model", "llama-3-8b", "--out", str(tmp_path / "x.yaml")]
    res = CliRunner().invoke(build_app(), [*args, "--slo-tpot-ms", "100", flag, edges])
    assert res.exit_code == 2
    assert f"{flag}: the bucket {bucket} crosses llama-3-8b's context of 8,192 tokens" in res.output
    assert not (tmp_path / "x.yaml").exists()


def test_a_bucket_passing_at_max_rate_is_reported_as_a_floor_and_the_slo_reads_as_targets(
    tmp_path: Path,
) -> None:
    """An H100 serves far more than 0.5 req/s of short requests: the search stops at --max-rate, which was
    printed as the bucket's rate with nothing to say the limit was hit (helper walkthrough); the table's title
    printed the SLO as a Python dict."""
    args = ["profile", "--sim", "--gpu", "H100", "--model", "llama-3-8b", "--out", str(tmp_path / "x.yaml")]
    edges = ["--input-edges", "1,256", "--output-edges", "1,64", "--min-rate", "0.1", "--max-rate", "0.5"]
    res = CliRunner().invoke(build_app(), [*args, *edges, "--resolution", "0.5", "--slo-tpot-ms", "100"])
    assert res.exit_code == 0, res.output
    # the grid's top under 0.5 at resolution 0.5 from 0.1: 0.1 · 1.5³ = 0.3375
    assert "in [1,256) × out [1,64): ≥ 0.34 req/s (passed at the rate grid's top;" in res.output
    assert "1 bucket(s) passed at the top of the rate grid (--max-rate 0.5 req/s)" in " ".join(
        res.output.split()
    )
    assert "max req/s within TPOT p90 ≤ 100 ms" in " ".join(res.output.split())
    assert "{'tpot_ms'" not in res.output


def test_a_tp_that_does_not_divide_the_heads_exits_2_as_the_worker_does(tmp_path: Path) -> None:
    """`mosaic worker --tp 3` refuses Llama-3-8B's 32 heads as vLLM does; `mosaic profile` wrote a profile of
    such an instance, which `mosaic plan` would then buy (helper walkthrough, 2026-12-06)."""
    args = ["profile", "--sim", "--gpu", "H100", "--model", "llama-3-8b", "--out", str(tmp_path / "x.yaml")]
    res = CliRunner().invoke(build_app(), [*args, "--slo-tpot-ms", "100", "--tp", "3"])
    assert res.exit_code == 2
    assert (
        "--tp 3: Total number of attention heads (32) must be divisible by tensor parallel size (3)."
        in res.output
    )
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize(
    ("shipped", "args"),
    [
        ("llama-2-7b/T4.yaml", ["--gpu", "T4", "--model", "llama-2-7b", "--slo-tpot-ms", "40"]),
        (
            "llama-3-8b/pd/A100-80GB-prefill.yaml",
            ["--role", "prefill", "--gpu", "A100-80GB", "--model", "llama-3-8b", "--slo-ttft-ms", "500"],
        ),
    ],
)
def test_shipped_profiles_are_what_the_documented_command_writes(
    shipped: str, args: list[str], tmp_path: Path
) -> None:
    """docs/loadgen.md's loops regenerate `placement/profiles/` byte for byte (two fast ones checked here): a
    change to the engine or the search that moves a profile fails this until the shipped files are rewritten
    with those loops (all 44 take ~15 min)."""
    from typer.testing import CliRunner

    from server.cli import build_app

    out = tmp_path / "p.yaml"
    result = CliRunner().invoke(build_app(), ["profile", "--sim", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    repo = Path(__file__).resolve().parents[2]
    assert out.read_text() == (repo / "placement" / "profiles" / shipped).read_text()
