"""`mosaic replay` end to end: a simulated worker on 127.0.0.1 (in a background loop), the real CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loadgen.report import SCHEMA
from server.cli import build_app

FIX = Path(__file__).parent / "fixtures"
SPEC = "synthetic:rate=100,n=20,input=uniform:8:200,output=uniform:2:12"


def mosaic(*args: str) -> object:
    return CliRunner().invoke(build_app(), ["replay", *args])


def test_replay_writes_report_plots_and_json_summary(worker_url: str, tmp_path: Path) -> None:
    out, plots = tmp_path / "report.json", tmp_path / "plots"
    res = mosaic(SPEC, "--url", worker_url, "--out", str(out), "--plot", str(plots), "--json", "--quiet",
                 "--slo-ttft-ms", "10000", "--slo-tpot-ms", "1000", "--seed", "3")  # fmt: skip
    assert res.exit_code == 0, res.output  # type: ignore[attr-defined]
    summary = json.loads(res.stdout)  # type: ignore[attr-defined]
    assert summary["completed"] == 20 and summary["failed"] == 0 and summary["slo_attainment"] == 1.0
    report = json.loads(out.read_text())
    assert report["schema"] == SCHEMA and report["summary"] == summary
    assert report["config"]["slo"] == {"ttft_ms": 10000.0, "tpot_ms": 1000.0, "e2el_ms": None}
    assert sorted(p.name for p in plots.iterdir()) == ["latency_cdf.png", "timeline.png"]
    assert "Successful requests" in res.stderr and "TPOT" in res.stderr  # type: ignore[attr-defined]


def test_lag_over_the_threshold_is_announced(worker_url: str) -> None:
    res = mosaic(SPEC, "--url", worker_url, "--quiet", "--lag-threshold-ms", "0.000001")
    assert res.exit_code == 0 and "WARNING: load generator lag" in res.stderr  # type: ignore[attr-defined]


def test_trace_file_with_window_and_cap(worker_url: str) -> None:
    res = mosaic(str(FIX / "burstgpt.csv"), "--url", worker_url, "--rate-scale", "500", "--max-requests", "2",
                 "--json", "--quiet")  # fmt: skip
    assert res.exit_code == 0, res.output  # type: ignore[attr-defined]
    # the first two kept rows: 472 + 417 prompt tokens, 18 + 1123 output tokens (the failed row is dropped)
    s = json.loads(res.stdout)  # type: ignore[attr-defined]
    assert (s["completed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 889, 1141)


def test_rows_left_out_are_said_on_the_console(worker_url: str) -> None:
    """5 of azure_bad_tokens.csv's 7 rows are skipped with --skip-bad-rows: only report.json had said so, and
    a run on a fraction of its trace looked whole."""
    res = mosaic(
        str(FIX / "azure_bad_tokens.csv"), "--url", worker_url, "--skip-bad-rows", "--rate-scale", "100"
    )
    assert res.exit_code == 0, res.output  # type: ignore[attr-defined]
    line = next(ln for ln in res.stderr.splitlines() if "trace rows left out" in ln)  # type: ignore[attr-defined]
    assert line.startswith("trace rows left out: skipped 5 (") and line.endswith(" of 7"), line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param([str(FIX / "missing.csv")], "missing.csv: no such file", id="missing trace file"),
        pytest.param([str(FIX / "azure_bad_tokens.csv"), "--rate-scale", "1000"], "azure_bad_tokens.csv:3:", id="malformed row names file and line"),
        pytest.param([str(FIX / "burstgpt_lengths.csv")], "give --rate", id="length-only trace without --rate"),
        pytest.param(["synthetic:rate=1"], "n=COUNT or duration", id="bad synthetic spec"),
        pytest.param(
            [SPEC, "--endpoint", "pooling"],
            "--endpoint must be one of completions, chat, embeddings, rerank",
            id="unknown endpoint",
        ),
        pytest.param(
            [SPEC, "--endpoint", "rerank", "--rerank-documents", "0"],
            "--rerank-documents must be at least 1, got 0",
            id="no documents",
        ),
        pytest.param([SPEC, "--rate", "5", "--rate-scale", "2"], "give one", id="--rate with --rate-scale"),
        pytest.param([str(FIX / "azure_header_only.csv")], "no requests to send", id="a trace without requests"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(worker_url: str, args: list[str], message: str) -> None:
    res = mosaic(*args, "--url", worker_url, "--quiet")
    assert res.exit_code == 2, res.output  # type: ignore[attr-defined]
    lines = res.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and message in lines[0], res.output  # type: ignore[attr-defined]


def test_unreachable_server_exits_2_and_keeps_the_earlier_report(tmp_path: Path, closed_url: str) -> None:
    """--out held an earlier run's report: it was replaced by an empty one before the exit 2. The replay
    stops once its first 8 requests all failed to connect (it used to play the whole schedule first)."""
    earlier = tmp_path / "report.json"
    earlier.write_text('{"earlier": true}')
    res = mosaic(SPEC, "--url", closed_url, "--quiet", "--timeout", "5", "--out", str(earlier))
    assert res.exit_code == 2  # type: ignore[attr-defined]
    lines = res.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: cannot connect to {closed_url}: the first 8 requests all failed")
    assert lines[0].endswith("; the rest were not sent")
    assert earlier.read_text() == '{"earlier": true}'


def test_a_trace_too_short_to_give_up_on_still_exits_2(closed_url: str) -> None:
    res = mosaic("synthetic:rate=100,n=3,input=8,output=2", "--url", closed_url, "--quiet")
    assert res.exit_code == 2  # type: ignore[attr-defined]
    assert res.stderr.strip().splitlines() == [  # type: ignore[attr-defined]
        f"error: cannot connect to {closed_url}: every request failed to connect (All connection attempts failed)"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--url", "http://127.0.0.1:99999"], "--url port must be 1-65535, got 99999", id="port out of range"),
        pytest.param(["--url", "http://127.0.0.1:abc"], "is not a valid URL: Invalid port", id="port not a number"),
        pytest.param(["--url", "http://"], "--url must be http(s)://HOST", id="no host"),
        pytest.param(["--url", "http://127.0.0.1:9", "--api-key", "clé"], "--api-key (or MOSAIC_API_KEY) must be printable ASCII", id="non-ASCII key"),
        pytest.param(["--url", "http://127.0.0.1:9", "--burstiness", "0.2"], "--burstiness shapes --rate", id="--burstiness without --rate"),
    ],
)  # fmt: skip
def test_bad_target_exits_2_with_one_line_before_sending(args: list[str], message: str) -> None:
    """Each used to raise out of the first request (OverflowError, InvalidURL, UnicodeEncodeError: exit 1),
    or, with no host, to fail every request and exit 0."""
    res = mosaic(SPEC, *args, "--quiet")
    assert res.exit_code == 2, res.output  # type: ignore[attr-defined]
    lines = res.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and message in lines[0], res.output  # type: ignore[attr-defined]


def test_ctrl_c_stops_the_replay_and_keeps_what_was_measured(tmp_path: Path) -> None:
    """SIGINT killed the replay (exit 130, no summary, no report: an interrupted hour lost). Now the first one
    stops it: nothing more is sent, the requests in flight are cancelled, and the report of what finished is
    written with `interrupted: true`; the exit code is still 130."""
    import asyncio
    import signal
    import subprocess
    import sys
    import threading
    import time

    from simulator.worker_app import WorkerConfig
    from simulator.worker_server import start_worker_server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    # real time on an L4: 2-token requests finish in ~0.1 s, 2,000-token ones would take minutes
    cfg = WorkerConfig(gpu="L4", model="llama-3-8b", time_scale=1.0)
    worker = asyncio.run_coroutine_threadsafe(start_worker_server(cfg), loop).result(30)
    out = tmp_path / "report.json"
    spec = "synthetic:rate=20,n=400,arrival=constant,input=8,output=2000,seed=1"
    cmd = [str(Path(sys.executable).with_name("mosaic")), "replay", spec, "--url", worker.url, "--quiet"]
    try:
        proc = subprocess.Popen(
            [*cmd, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 30
        while worker.runtime.engine.num_running < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.runtime.engine.num_running >= 5
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        assert "interrupted:" in stderr and "Traceback" not in stderr
        report = json.loads(out.read_text())
        summary = report["summary"]
        assert summary["interrupted"] is True and summary["sent"] < 400
        assert summary["errors"].get("cancelled", 0) == summary["failed"] > 0
        assert {r["error_type"] for r in report["requests"]} <= {None, "cancelled"}
        deadline = time.monotonic() + 10  # the worker sees the streams closed and aborts them
        while worker.runtime.engine.num_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.runtime.engine.num_running == 0
    finally:
        asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_ctrl_c_before_the_first_send_exits_130(tmp_path: Path, closed_url: str) -> None:
    """Before: exit 2 ("bad input") for a run stopped by Ctrl-C while waiting for its first send time."""
    import signal
    import subprocess
    import sys
    import time

    trace = tmp_path / "gap.jsonl"  # with --start 1, the first request is due 59 s in
    trace.write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1]}\n'
        '{"timestamp": 60000, "input_length": 100, "output_length": 10, "hash_ids": [2]}\n'
    )
    mosaic = str(Path(sys.executable).with_name("mosaic"))
    cmd = [mosaic, "replay", str(trace), "--url", closed_url, "--model", "m", "--start", "1", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(5)  # started and waiting (the CLI imports and installs its handler in ~1 s here)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert (proc.returncode, stderr.strip()) == (130, "interrupted before any request was sent")


def test_a_model_the_server_does_not_serve_exits_2_after_the_first_requests(worker_url: str) -> None:
    """vLLM answers 404 to every request for a model it does not serve: the replay played its whole
    schedule and exited 0 with nothing measured."""
    res = mosaic(SPEC, "--url", worker_url, "--model", "nope", "--quiet")
    assert res.exit_code == 2, res.output  # type: ignore[attr-defined]
    assert res.stderr.strip().splitlines() == [  # type: ignore[attr-defined]
        f"error: {worker_url} refused the first 8 requests (http_404): The model `nope` does not exist.;"
        " the rest were not sent"
    ]
