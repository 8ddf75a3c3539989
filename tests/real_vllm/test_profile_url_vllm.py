"""`mosaic profile --url` against a real vLLM (CPU build, tiny model, max_model_len 512): a bucket it serves
gets a measured rate, and a bucket whose prompts exceed its max_model_len (vLLM answers 400) is 0 from the
unloaded baseline at once, not after probing down to --min-rate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadgen import prompts
from placement.profiles import load_profile
from server.cli import build_app

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


def test_profile_url_measures_what_vllm_serves_and_zeroes_what_it_refuses(  # type: ignore[no-untyped-def]
    real_vllm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the test model's vocabulary is 2,048 ids; the profile's prompts draw from [1000, 30000), inside every
    # real model's (vLLM refuses an id outside its vocabulary: "Token id 29404 is out of vocabulary")
    monkeypatch.setattr(prompts, "TOKEN_ID_HIGH", 2000)
    out = tmp_path / "tiny.yaml"
    args = ["profile", "--url", real_vllm.url, "--served-model", real_vllm.model, "--gpu", "L4"]
    args += ["--model", "llama-3-8b", "--out", str(out), "--input-edges", "16,32,600,700"]
    args += ["--output-edges", "2,4", "--slo-tpot-ms", "5000", "--min-rate", "0.5", "--max-rate", "4"]
    args += [
        "--resolution",
        "0.5",
        "--probe-window-s",
        "1",
        "--probe-requests",
        "4",
        "--probe-e2e-factor",
        "0",
    ]
    started = time.monotonic()
    res = CliRunner().invoke(build_app(), args)
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert p.source == "url" and p.max_rate[0][0] > 0
    assert p.measured is not None and p.measured[0][0] is not None and p.measured[0][0].n > 0
    assert p.max_rate[1][0] == 0.0  # [32, 600): its longest prompts fill the 512 context, no room to decode
    assert p.max_rate[2][0] == 0.0  # [600, 700): over max_model_len, refused by vLLM
    said = " ".join(res.output.split())  # the console wraps long lines
    assert said.count("cannot (misses the SLO, or is refused, one request at a time)") == 2, said
    assert time.monotonic() - started < 300
