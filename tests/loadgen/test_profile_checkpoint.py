"""`mosaic profile` checkpoints every bucket, and `--resume` continues an interrupted run from it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadgen.profile_checkpoint import SCHEMA, Checkpoint, CheckpointError, checkpoint_path
from loadgen.profile_search import Measurement, SearchResult, SearchSlo
from loadgen.profiling import Bucket, BucketMeasure, profile_grid
from server.cli import build_app

SETTINGS = {"gpu": "H100-SXM", "model": "llama-3-8b", "input_edges": [1, 256, 1024], "slo_ttft_ms": None}
# H100 at p90 TPOT ≤ 40 ms on four buckets: a fraction of a second on the engine model
ARGS = [
    "--sim",
    "--gpu",
    "H100",
    "--model",
    "llama-3-8b",
    "--input-edges",
    "1,256,1024",
    "--output-edges",
    "1,64,256",
]


def bucket(i: int, j: int) -> Bucket:
    return Bucket(i, j, 1, 256, 1, 64)


def test_a_checkpoint_reads_back_what_was_recorded(tmp_path: Path) -> None:
    path = checkpoint_path(tmp_path / "h100.yaml")
    assert path.name == "h100.yaml.partial.json"
    ck = Checkpoint.fresh(path, SETTINGS)
    measured = SearchResult(12.5, Measurement(12.5, 310, 81.2, 33.9, True, 0), capped=True)
    ck.record(bucket(0, 0), measured)
    ck.record(bucket(0, 1), None)  # cannot be served
    ck.record(bucket(1, 0), SearchResult(0.0, None, unloaded_miss=True))
    back = Checkpoint.load(path, dict(SETTINGS, input_edges=(1, 256, 1024)))  # tuples compare as lists
    assert back.done == {(0, 0): measured, (0, 1): None, (1, 0): SearchResult(0.0, None, unloaded_miss=True)}
    assert json.loads(path.read_text())["schema"] == SCHEMA
    assert not path.with_name(path.name + ".tmp").exists()  # written beside it, then renamed over it
    ck.remove()
    assert not path.exists()


def test_a_checkpoint_of_other_settings_is_refused_naming_what_differs(tmp_path: Path) -> None:
    path = tmp_path / "p.partial.json"
    Checkpoint.fresh(path, SETTINGS).record(bucket(0, 0), None)
    with pytest.raises(CheckpointError) as err:
        Checkpoint.load(path, dict(SETTINGS, gpu="L4", slo_ttft_ms=500.0))
    assert "gpu 'H100-SXM' → 'L4'; slo_ttft_ms None → 500.0" in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "no checkpoint at"),
        ("{not json", "not a readable checkpoint"),
        ('{"schema": "mosaic.profile/v1"}', "not a profile checkpoint"),
        (
            json.dumps({"schema": SCHEMA, "settings": SETTINGS, "buckets": [{"i": 0}]}),
            "bucket record 0 is malformed (j: Field required)",
        ),
        # values a damaged or hand-edited file holds: refused before any probe (a sweep found each of these
        # crashing the run with a traceback, at load or only once the rest of the grid had been probed)
        (
            json.dumps(
                {
                    "schema": SCHEMA,
                    "settings": SETTINGS,
                    "buckets": [{"i": float("inf"), "j": 0, "fits": False}],
                }
            ),
            "bucket record 0 is malformed (i: Input should be a valid integer)",
        ),
        (
            json.dumps(
                {
                    "schema": SCHEMA,
                    "settings": SETTINGS,
                    "buckets": [{"i": 0, "j": 0, "fits": True, "max_rate": float("nan")}],
                }
            ),
            "bucket record 0 is malformed (max_rate: Input should be a finite number)",
        ),
        (
            json.dumps(
                {
                    "schema": SCHEMA,
                    "settings": SETTINGS,
                    "buckets": [
                        {"i": 0, "j": 0, "fits": False},
                        {
                            "i": 0,
                            "j": 1,
                            "fits": True,
                            "max_rate": 2.0,
                            "measurement": {"rate": 2.0, "n": "abc", "ttft_p90_ms": 1.0, "tpot_p90_ms": None},
                        },
                    ],
                }
            ),
            "bucket record 1 is malformed (measurement.n: Input should be a valid integer)",
        ),
        (
            json.dumps({"schema": SCHEMA, "settings": SETTINGS, "buckets": {"i": 0}}),
            "the checkpoint has no bucket list",
        ),
    ],
)
def test_an_unusable_checkpoint_is_refused(tmp_path: Path, text: str | None, message: str) -> None:
    path = tmp_path / "p.partial.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        Checkpoint.load(path, SETTINGS)


def test_buckets_done_are_not_measured_again() -> None:
    seen: list[tuple[int, int]] = []

    def factory(b: Bucket) -> BucketMeasure:
        seen.append((b.i, b.j))
        return BucketMeasure(lambda rate: Measurement(rate, 100, 10.0, 10.0 if rate <= 4.0 else 99.0))

    kept = SearchResult(7.0, Measurement(7.0, 50, 1.0, 2.0))
    reported: list[tuple[int, int]] = []
    grid = profile_grid(
        [1, 10, 20],
        [1, 10, 20],
        factory,
        SearchSlo(tpot_ms=40.0),
        on_bucket=lambda b, _: reported.append((b.i, b.j)),
        done={(0, 1): kept, (1, 0): None},
    )
    assert seen == reported == [(0, 0), (1, 1)]
    assert grid.max_rate[0][1] == 7.0 and grid.measured[0][1] == kept.measurement
    assert grid.max_rate[1][0] == 0.0 and grid.measured[1][0] is None
    assert 4.0 / 1.05 < grid.max_rate[0][0] <= 4.0 and grid.max_rate[0][0] == grid.max_rate[1][1]


def _profile(tmp_path: Path, out: str, *extra: str) -> tuple[int, str]:
    res = CliRunner().invoke(build_app(), ["profile", *ARGS, "--out", str(tmp_path / out), *extra])
    return res.exit_code, res.output


def test_ctrl_c_keeps_the_buckets_done_and_resume_writes_what_one_run_writes(tmp_path: Path) -> None:
    """A run stopped by SIGINT after its first bucket exits 130, says what it kept and where; `--resume`
    measures only the rest, and the profile is byte for byte what an uninterrupted run writes."""
    assert _profile(tmp_path, "whole.yaml")[0] == 0
    out = tmp_path / "p.yaml"
    cmd = [sys.executable, "-c", "from server.cli import main; main()", "profile", *ARGS, "--out", str(out)]
    env = dict(os.environ, COLUMNS="200")
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env) as proc:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert "in [1,256) × out [1,64): " in first, first
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
    assert proc.returncode == 130, err
    ck = checkpoint_path(out)
    kept = len(json.loads(ck.read_text())["buckets"])
    assert 1 <= kept < 4  # the signal lands while a later bucket is measured
    assert err.strip().splitlines()[-1] == (
        f"interrupted; {kept} of 4 buckets are kept in {ck}: rerun the same command with --resume to continue"
    )
    assert not out.exists()

    code, text = _profile(tmp_path, "p.yaml", "--seed", "1")  # other settings: refused, nothing overwritten
    assert code == 2 and "an unfinished run's checkpoint is at" in text
    code, text = _profile(tmp_path, "p.yaml", "--seed", "1", "--resume")
    assert code == 2 and text.startswith("error: --resume: ") and "(seed 0 → 1)" in text
    code, text = _profile(tmp_path, "p.yaml", "--resume")
    assert code == 0, text
    assert f"resuming: {kept} of 4 buckets from {ck}" in text
    assert text.count(" probes)") == 4 - kept  # only the rest were measured
    assert out.read_bytes() == (tmp_path / "whole.yaml").read_bytes()
    assert not ck.exists()  # removed once the profile is written
    code, text = _profile(tmp_path, "p.yaml", "--resume")
    assert code == 2 and "--resume: no checkpoint at" in text
