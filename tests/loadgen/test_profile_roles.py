"""`mosaic profile --role prefill|decode`: one phase of P/D serving per profile, as the planner reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadgen.profile_search import SearchConfig, SearchSlo
from loadgen.profiling import ProbePlan, profile_grid
from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from placement.profiles import Role, load_profile
from server.cli import build_app
from simulator.profile_driver import role_request, sim_measure_factory

CAT = load_catalog()
A100 = PerfModel(CAT.gpu("A100-80GB"), CAT.model("llama-3-8b"))
PLAN = ProbePlan(min_window_s=10, min_requests=100, e2e_factor=1.0)  # short probes: a test, not a profile
IN, OUT = [1, 512, 2048], [1, 128, 512]
CFG = SearchConfig(0.1, 500.0, 0.05)


def grid(role: Role, slo: SearchSlo) -> list[list[float]]:
    factory = sim_measure_factory(A100, seed=1, plan=PLAN, role=role)
    return profile_grid(IN, OUT, factory, slo, CFG).max_rate


def test_role_requests_are_what_a_pd_worker_sees() -> None:
    assert role_request(A100, Role.MIXED, "a", 1000, 200, 25.0).max_tokens == 200
    pre = role_request(A100, Role.PREFILL, "a", 1000, 200, 25.0)
    assert (pre.max_tokens, pre.kv_transfer) == (1, None)  # the prefill worker emits one token
    dec = role_request(A100, Role.DECODE, "a", 1000, 200, 25.0)
    assert dec.max_tokens == 200 and dec.kv_transfer is not None and dec.kv_transfer.remote_prefilled
    # Llama-3-8B KV: 2 (K, V) · 32 layers · 8 KV heads · 128 dims · 2 bytes = 131072 B/token;
    # 1000 tokens over 25 GB/s = 131_072_000 / 25e9 = 5.24288 ms
    assert dec.kv_transfer.transfer_delay_s == pytest.approx(0.00524288)


def test_prefill_only_sustains_at_least_the_mixed_rate_at_the_same_ttft() -> None:
    # The same prompts at the same TTFT limit: a mixed instance also decodes every output, which only
    # delays prefills, so prefill-only can never sustain less.
    slo = SearchSlo(ttft_ms=500)
    pre, mixed = grid(Role.PREFILL, slo), grid(Role.MIXED, slo)
    for i in range(2):
        for j in range(2):
            assert pre[i][j] >= mixed[i][j] > 0, (i, j, pre, mixed)
    assert pre[0][1] > 1.5 * mixed[0][1]  # short prompts, long outputs: decode dominates the mixed GPU


def test_decode_only_sustains_at_least_the_mixed_rate_at_the_same_tpot() -> None:
    # Remote-prefilled requests skip the prompt's compute, whose chunks stretch a mixed GPU's decode steps.
    slo = SearchSlo(tpot_ms=40)
    dec, mixed = grid(Role.DECODE, slo), grid(Role.MIXED, slo)
    for i in range(2):
        for j in range(2):
            assert dec[i][j] >= mixed[i][j] > 0, (i, j, dec, mixed)
    assert dec[1][0] > 2 * mixed[1][0]  # long prompts, short outputs: prefill dominates the mixed GPU


FAST = [
    "--input-edges",
    "1,512",
    "--output-edges",
    "1,128",
    "--probe-window-s",
    "10",
    "--probe-requests",
    "100",
]


def test_profile_cli_writes_the_role_and_only_the_slo_that_judged_it(tmp_path: Path) -> None:
    out = tmp_path / "pre.yaml"
    args = [
        "profile",
        "--sim",
        "--role",
        "prefill",
        "--gpu",
        "A100",
        "--model",
        "llama-3-8b",
        "--out",
        str(out),
    ]
    res = CliRunner().invoke(build_app(), [*args, "--slo-ttft-ms", "300", *FAST])
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert p.role is Role.PREFILL and (p.slo.ttft_ms, p.slo.tpot_ms) == (300, None)  # 1 token: no TPOT
    assert p.measured is not None and p.measured[0][0] is not None
    assert p.max_rate[0][0] > 0 and (p.measured[0][0].ttft_p90_ms or 0) <= 300
    out = tmp_path / "dec.yaml"
    args = [
        "profile",
        "--sim",
        "--role",
        "decode",
        "--gpu",
        "A100",
        "--model",
        "llama-3-8b",
        "--out",
        str(out),
    ]
    res = CliRunner().invoke(build_app(), [*args, "--slo-tpot-ms", "40", *FAST])
    assert res.exit_code == 0, res.output
    d = load_profile(out)
    assert d.role is Role.DECODE and d.slo.tpot_ms == 40 and d.max_rate[0][0] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--sim", "--role", "verifier"], "--role must be mixed, prefill or decode", id="unknown role"),
        pytest.param(["--sim", "--role", "prefill"], "give --slo-ttft-ms", id="prefill without a TTFT limit"),
        pytest.param(["--sim", "--role", "decode", "--slo-tpot-ms", "0", "--slo-ttft-ms", "500"], "give --slo-tpot-ms", id="decode without a TPOT limit"),
        pytest.param(["--url", "http://127.0.0.1:9", "--role", "decode"], "--sim only", id="a live server cannot be one phase"),
        pytest.param(["--sim", "--role", "decode", "--kv-link-gbps", "0"], "--kv-link-gbps", id="zero link speed"),
    ],
)  # fmt: skip
def test_bad_role_input_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    base = ["profile", "--gpu", "H100", "--model", "llama-3-8b", "--out", str(tmp_path / "p.yaml")]
    res = CliRunner().invoke(build_app(), [*base, *args])
    assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1, (
        res.output
    )
