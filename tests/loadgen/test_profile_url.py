"""`mosaic profile --url` against a simulated worker over HTTP (plumbing: the worker runs 500× real time)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from loadgen.profile_search import SearchConfig
from placement.profiles import load_profile
from server.cli import build_app


def test_profile_url_writes_a_url_profile(worker_url: str, tmp_path: Path) -> None:
    out = tmp_path / "h100.json"
    args = ["profile", "--url", worker_url, "--gpu", "H100", "--model", "llama-3-8b", "--out", str(out)]
    args += ["--input-edges", "1,64", "--output-edges", "2,8", "--slo-tpot-ms", "40", "--min-rate", "5"]
    args += [
        "--max-rate",
        "40",
        "--probe-window-s",
        "0.5",
        "--probe-requests",
        "10",
        "--probe-e2e-factor",
        "0",
    ]
    res = CliRunner().invoke(build_app(), args)
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert (p.source, p.gpu, p.input_edges, p.output_edges) == ("url", "H100-SXM", (1, 64), (2, 8))
    # at 500× real time every probe meets 40 ms, so the search ends at the grid's top: 5 · 1.05^k ≤ 40
    assert p.max_rate[0][0] == round(SearchConfig(5, 40).grid()[-1], 4)
    m = p.measured[0][0] if p.measured else None
    assert m is not None and m.n > 0 and m.tpot_p90_ms is not None and m.tpot_p90_ms < 40
