"""Bad files and output paths: every command exits 2 with one `error:` line, before doing any work — a file
that is not UTF-8, YAML with a syntax error, an output path that cannot be written, a fleet with an unknown
routing policy or a NaN knob, an unknown --log-level, a vLLM command that does not exist."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.cli import build_app

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "docs" / "examples" / "fleet-pd.yaml"
SYNTH = "synthetic:rate=50,n=3,input=32,output=4"
PLACEMENT = ROOT / "tests" / "placement" / "fixtures"
PLAN = [
    "--workload", str(PLACEMENT / "workload.yaml"),
    "--gpus", str(PLACEMENT / "gpus.yaml"),
    "--profile", str(PLACEMENT / "llama3-a100-tpot40.yaml"),
]  # fmt: skip


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00bad\n")
    (tmp_path / "binary.csv").write_bytes(b"\xff\xfe\x00bad\n")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00bad\n")
    (tmp_path / "broken.yaml").write_text("a: [\n")
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("x")
    fleet = FLEET.read_text()
    (tmp_path / "unknown-routing.yaml").write_text(
        fleet.replace("routing: {policy: mosaic}", "routing: {policy: foo}")
    )
    (tmp_path / "missing-profile.yaml").write_text(
        "pools: [{name: a, model: llama-3-8b, gpu: L4, endpoints: {static: ['http://127.0.0.1:9']}}]\n"
        "kv: {compression: [{model: llama-3-8b, profile: nope.npz}]}\n"
    )
    (tmp_path / "nan-ratio.yaml").write_text(fleet.replace("pd_ratio: 1.5", "pd_ratio: .nan"))
    (tmp_path / "inf-interval.yaml").write_text(
        fleet.replace("decision_interval_s: 15", "decision_interval_s: .inf")
    )
    return tmp_path


CASES = [
    (["serve", "--config", "{d}/binary.yaml"], "cannot read config file {d}/binary.yaml: not UTF-8 text"),
    (  # found only once the gateway is built, and still prefixed with the config file, as load errors are
        ["serve", "--config", "{d}/missing-profile.yaml", "--host", "127.0.0.1", "--port", "0"],
        "{d}/missing-profile.yaml: kv.compression.0.profile: profile file {d}/nope.npz does not exist",
    ),
    (["simulate", "--trace", SYNTH, "--fleet", "{d}/binary.yaml"], "cannot read fleet file {d}/binary.yaml: not UTF-8"),
    (["simulate", "--trace", "{d}/binary.csv", "--fleet", str(FLEET)], "{d}/binary.csv: not UTF-8 text"),
    (["replay", "{d}/binary.csv", "--url", "http://127.0.0.1:9"], "{d}/binary.csv: not UTF-8 text"),
    (["replay", "{d}/binary.csv", "--url", "http://127.0.0.1:9", "--format", "azure", "--quiet"], "not UTF-8 text"),
    (["plan", *PLAN[:2], "--gpus", "{d}/binary.yaml", *PLAN[4:]], "{d}/binary.yaml: cannot read: not UTF-8"),
    (["kv-layout", "--profile", "{d}/binary.json", "--heads-per-group", "2"], "{d}/binary.json: not UTF-8"),
    (["worker", "--gpu", "H100", "--model", "llama-3-8b", "--catalog", "{d}/binary.yaml"], "not UTF-8"),
    (["simulate", "--trace", SYNTH, "--fleet", "{d}/broken.yaml"], "{d}/broken.yaml is not valid YAML at line 2"),
    (["worker", "--gpu", "H100", "--model", "llama-3-8b", "--catalog", "{d}/broken.yaml"], "not valid YAML at line 2"),
    (["plan", "--workload", "{d}/broken.yaml", *PLAN[2:]], "{d}/broken.yaml: not valid YAML at line 2"),
    (["simulate", "--trace", SYNTH, "--fleet", str(FLEET), "--out", "{d}/a-dir"], "--out {d}/a-dir: is a directory"),
    (["simulate", "--trace", SYNTH, "--fleet", str(FLEET), "--out", "{d}/a-file/r.json"], "is not a directory"),
    (["simulate", "--trace", SYNTH, "--fleet", str(FLEET), "--plot", "{d}/a-file"], "exists and is not a directory"),
    (["replay", SYNTH, "--url", "http://127.0.0.1:9", "--out", "{d}/a-dir"], "--out {d}/a-dir: is a directory"),
    (["replay", SYNTH, "--url", "http://127.0.0.1:9", "--plot", "{d}/a-file"], "exists and is not a directory"),
    (["simulate", "--trace", SYNTH, "--fleet", "{d}/unknown-routing.yaml"], "routing.policy: Input should be"),
    (["simulate", "--trace", SYNTH, "--fleet", "{d}/nan-ratio.yaml"], "pd_ratio must be a finite number, got nan"),
    (["simulate", "--trace", SYNTH, "--fleet", "{d}/inf-interval.yaml"], "decision_interval_s: Input should be a finite"),
    (["simulate", "--trace", SYNTH, "--fleet", str(FLEET), "--rate-scale", "nan"], "--rate-scale must be a finite number > 0, got nan"),
    (["worker", "--gpu", "H100", "--model", "llama-3-8b", "--log-level", "foo"], "--log-level must be one of"),
    (["serve", "--log-level", "foo"], "--log-level must be one of critical, error, warning, info, debug, trace"),
    (["autoscale", "--config", "{d}/none.yaml", "--log-level", "loud"], "--log-level must be one of"),
    (
        ["worker", "--model", "llama-3-8b", "--engine", "vllm", "--vllm-command", "{d}/no-such-vllm"],
        "cannot run '{d}/no-such-vllm'",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), CASES, ids=[f"{c[0][0]}:{i}" for i, c in enumerate(CASES)])
def test_bad_file_or_path_exits_2_with_one_line(files: Path, args: list[str], message: str) -> None:
    argv = [a.replace("{d}", str(files)) for a in args]
    result = CliRunner().invoke(build_app(), argv)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message.replace("{d}", str(files)) in lines[0]
    assert not list((files / "a-dir").iterdir())  # nothing was written into the directory given as --out
