"""`mosaic plan --mode pd` with the shipped Llama-3-8B prefill/decode profiles (made by `mosaic profile --role`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from placement.profiles import Role, Slo, load_profile
from server.cli import build_app

PROFILES = Path(__file__).parents[2] / "placement" / "profiles" / "llama-3-8b"
PD = PROFILES / "pd"
PAIR = {
    "H100-SXM-prefill.yaml": ("H100-SXM", Role.PREFILL),
    "A100-80GB-prefill.yaml": ("A100-80GB", Role.PREFILL),
    "H100-SXM-decode.yaml": ("H100-SXM", Role.DECODE),
    "A100-80GB-decode.yaml": ("A100-80GB", Role.DECODE),
}
TRACE = "synthetic:rate=20,duration=600,input=lognormal:700:1.0,output=lognormal:180:0.9,seed=1"
BASE = ["plan", "--trace", TRACE, "--gpus", "H100-SXM,A100-80GB", "--slo-tpot-ms", "40", "--drop-unservable"]


def pd_args() -> list[str]:
    return [a for name in PAIR for a in ("--profile", str(PD / name))]


def test_shipped_pd_profiles_carry_their_role_and_the_slo_that_judged_them() -> None:
    for name, (gpu, role) in PAIR.items():
        p = load_profile(PD / name)
        assert (p.model, p.gpu, p.role, p.source) == ("llama-3-8b", gpu, role, "sim"), name
        assert p.slo == (Slo(ttft_ms=500) if role is Role.PREFILL else Slo(tpot_ms=40)), name
        assert p.input_edges == load_profile(PROFILES / f"{gpu}.yaml").input_edges  # same grid as mixed


def test_plan_in_pd_mode_sizes_prefill_and_decode_pools() -> None:
    res = CliRunner().invoke(
        build_app(), [*BASE, "--mode", "pd", "--slo-ttft-ms", "500", *pd_args(), "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["status"] == "optimal" and math.isfinite(doc["cost_per_hour"]) and doc["cost_per_hour"] > 0
    used = {r["role"]: r["count"] for r in doc["instances"] if r["count"] > 0}
    assert set(used) == {"prefill", "decode"}, doc["instances"]  # no mixed profile given: P/D only
    assert doc["cost_per_hour"] == pytest.approx(sum(r["cost_per_hour"] for r in doc["instances"]))
    for a in doc["assignment"]:  # every bucket is prefilled once and decoded once
        pre = sum(v for k, v in a["shares"].items() if k.endswith("/prefill"))
        dec = sum(v for k, v in a["shares"].items() if k.endswith("/decode"))
        assert abs(pre - 1) < 1e-6 and abs(dec - 1) < 1e-6, a
    # the best single type (P/D on H100s alone) can never be cheaper than the optimal mix
    best = doc["single_type"]["best"]
    assert best is not None and best["cost_per_hour"] >= doc["cost_per_hour"]


def test_pd_mode_with_only_mixed_profiles_names_the_problem() -> None:
    mixed = ["--profile", str(PROFILES / "H100-SXM.yaml"), "--profile", str(PROFILES / "A100-80GB.yaml")]
    res = CliRunner().invoke(build_app(), [*BASE, "--mode", "pd", *mixed])
    assert res.exit_code == 2 and "no usable profile" in res.output, res.output
