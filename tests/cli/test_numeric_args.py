"""Numeric options that NaN, infinity, zero or a negative slipped through (and `profile --out` paths that failed
only after the run): each is refused up front with exit 2 and one `error: ` line naming the option.

Every case is a real `mosaic` process. Importing the CLI costs ~1.7 s of CPU, so one helper process imports it
once and forks a child per case; the child runs `server.cli.main` with the case's argv on its own stdout and
stderr, and an exception the CLI lets escape ends it as the interpreter would (traceback, exit 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).parent.parent
PLACEMENT = TESTS / "placement" / "fixtures"
TRACE = str(Path(__file__).parent / "fixtures" / "azure_small.csv")
HEADS = str(TESTS / "kv" / "fixtures" / "samples.csv")

# Forks a child per case from one process that has already imported every command.
RUNNER = r"""
import importlib, json, os, sys, tempfile, time, traceback
import server.cli
for name in server.cli.COMMAND_MODULES:
    importlib.import_module(name)
results = []
for args in json.load(sys.stdin):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = ["mosaic", *args]
        try:
            server.cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    elapsed = time.perf_counter() - t0
    out.seek(0)
    err.seek(0)
    results.append({"rc": os.waitstatus_to_exitcode(status), "stdout": out.read().decode(),
                    "stderr": err.read().decode(), "elapsed_s": elapsed})
json.dump(results, sys.__stdout__)
"""

PLAN = [
    "plan",
    "--workload",
    str(PLACEMENT / "workload.yaml"),
    "--gpus",
    str(PLACEMENT / "gpus.yaml"),
    "--profile",
    str(PLACEMENT / "llama3-a100-tpot40.yaml"),
    "--profile",
    str(PLACEMENT / "llama3-a10g-tpot40.yaml"),
]
PLAN_40 = [*PLAN, "--slo-tpot-ms", "40"]
PLAN_TRACE = [
    "plan",
    "--trace",
    TRACE,
    "--gpus",
    "A10G,A100-80GB",
    "--profile",
    str(PLACEMENT / "llama3-a100-tpot40.yaml"),
    "--profile",
    str(PLACEMENT / "llama3-a10g-tpot40.yaml"),
    "--slo-tpot-ms",
    "40",
]
# A 1×1 grid with short probes: were a case not refused up front, it would profile and print a bucket line.
PROFILE = ["profile", "--sim", "--gpu", "H100", "--model", "llama-3-8b", "--input-edges", "1,256"]
PROFILE += ["--output-edges", "1,64", "--probe-window-s", "1", "--probe-requests", "20"]
KV = ["kv-layout", "--profile", HEADS, "--heads-per-group", "4"]
REPLAY = ["replay", "synthetic:rate=50,n=3,input=32,output=4", "--url", "http://127.0.0.1:9", "--quiet"]
WORKER = ["worker", "--gpu", "A100", "--model", "llama-3-8b", "--port", "0"]

# (id, argv, the option the error line names); DIR and FILE/p.json stand for paths made in the fixture
CASES: list[tuple[str, list[str], str]] = [
    ("plan slo-tpot 0", [*PLAN, "--slo-tpot-ms", "0"], "--slo-tpot-ms"),
    ("plan slo-tpot negative", [*PLAN, "--slo-tpot-ms", "-5"], "--slo-tpot-ms"),
    ("plan slo-tpot nan", [*PLAN, "--slo-tpot-ms", "nan"], "--slo-tpot-ms"),
    ("plan slo-ttft nan", [*PLAN_40, "--slo-ttft-ms", "nan"], "--slo-ttft-ms"),
    ("plan what-if tpot nan", [*PLAN_40, "--what-if", "tpot_ms=nan"], "--what-if tpot_ms"),
    ("plan what-if rate inf", [*PLAN_40, "--what-if", "rate=10,inf"], "--what-if rate"),
    ("plan time-limit nan", [*PLAN_40, "--time-limit", "nan"], "--time-limit"),
    ("plan slice-factor 0", [*PLAN_40, "--slice-factor", "0"], "--slice-factor"),
    ("plan slice-factor negative", [*PLAN_40, "--slice-factor", "-3"], "--slice-factor"),
    ("plan window nan", [*PLAN_TRACE, "--window-s", "nan"], "--window-s"),
    ("plan rate nan", [*PLAN_TRACE, "--rate", "nan"], "--rate"),
    ("profile slo-tpot negative", [*PROFILE, "--slo-tpot-ms", "-1"], "--slo-tpot-ms"),
    ("profile slo-tpot nan", [*PROFILE, "--slo-tpot-ms", "nan"], "--slo-tpot-ms"),
    ("profile slo-ttft negative", [*PROFILE, "--slo-ttft-ms", "-5"], "--slo-ttft-ms"),
    ("profile slo-ttft nan", [*PROFILE, "--slo-ttft-ms", "nan"], "--slo-ttft-ms"),
    ("profile max-rate nan", [*PROFILE, "--max-rate", "nan"], "--max-rate"),
    ("profile max-rate inf", [*PROFILE, "--max-rate", "inf"], "--max-rate"),
    ("profile queue-factor nan", [*PROFILE, "--queue-factor", "nan"], "--queue-factor"),
    ("profile probe-e2e-factor nan", [*PROFILE, "--probe-e2e-factor", "nan"], "--probe-e2e-factor"),
    ("profile probe-requests negative", [*PROFILE, "--probe-requests", "-5"], "--probe-requests"),
    ("profile out is a directory", [*PROFILE, "--out", "DIR"], "--out"),
    ("profile out under /proc", [*PROFILE, "--out", "/proc/p.json"], "--out"),
    ("profile out under a file", [*PROFILE, "--out", "FILE/p.json"], "--out"),
    ("profile out neither yaml nor json", [*PROFILE, "--out", "DIR/p.txt"], "--out"),
    ("kv-layout alpha nan", [*KV, "--alpha", "nan"], "--alpha"),
    ("kv-layout alpha inf json", [*KV, "--alpha", "inf", "--json"], "--alpha"),
    ("kv-layout time-limit nan", [*KV, "--tp", "2", "--time-limit", "nan"], "--time-limit"),
    ("replay burstiness nan", [*REPLAY, "--burstiness", "nan"], "--burstiness"),
    ("replay start nan", [*REPLAY, "--start", "nan"], "--start"),
    ("replay duration nan", [*REPLAY, "--duration", "nan"], "--duration"),
    ("serve time-scale inf", ["serve", "--port", "0", "--time-scale", "inf"], "--time-scale"),
    ("serve time-scale nan", ["serve", "--port", "0", "--time-scale", "nan"], "--time-scale"),
    # CLI review (2026-12-05): a traceback, a hang, a worker that started broken, a one-rate profile
    ("plan slice-factor past int64", [*PLAN_40, "--slice-factor", "9223372036854775807"], "--slice-factor"),
    ("plan slice-factor 1e20", [*PLAN_40, "--slice-factor", "99999999999999999999"], "--slice-factor"),
    ("profile resolution leaving one rate", [*PROFILE, "--resolution", "1e6"], "--resolution"),
    ("kv-layout time-limit 1e300", [*KV, "--tp", "2", "--time-limit", "1e300"], "--time-limit"),
    ("serve time-scale 1e-300", ["serve", "--port", "0", "--time-scale", "1e-300"], "--time-scale"),
    ("replay rate-scale 1e-300", [*REPLAY, "--rate-scale", "1e-300"], "rate scale"),
    ("replay rate 1e-300", [*REPLAY, "--rate", "1e-300"], "rate scale or rate"),
    ("worker kv-link-gbps nan", [*WORKER, "--role", "decode", "--kv-link-gbps", "nan"], "kv_link_gbps"),
    ("worker stall-s nan", [*WORKER, "--stall-s", "nan"], "stall_s"),
    ("worker stall-s inf", [*WORKER, "--stall-s", "inf"], "stall_s"),
    ("worker time-scale 1e-300", [*WORKER, "--time-scale", "1e-300"], "time_scale"),
    ("worker tp not dividing the heads", [*WORKER, "--tp", "3"], "tensor parallel size (3)"),
    ("worker tp huge", [*WORKER, "--tp", "99999999999"], "tensor parallel size"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("numeric")
    (tmp / "dir").mkdir()
    (tmp / "file").write_text("")
    subs = {
        "DIR": str(tmp / "dir"),
        "FILE/p.json": str(tmp / "file" / "p.json"),
        "DIR/p.txt": str(tmp / "p.txt"),
    }
    argvs, outs = [], []
    for case_id, args, _ in CASES:
        argv = [subs.get(a, a) for a in args]
        out = tmp / f"{case_id.replace(' ', '_')}.json"
        if argv[0] == "profile" and "--out" not in argv:
            argv += ["--out", str(out)]
        argvs.append(argv)
        outs.append(out)
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    runs = json.loads(proc.stdout)
    for run, out in zip(runs, outs, strict=True):
        run["wrote_out"] = out.exists()
    return {case_id: run for (case_id, _, _), run in zip(CASES, runs, strict=True)}


@pytest.mark.parametrize(("case_id", "option"), [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_number_exits_2_with_one_line(
    results: dict[str, dict[str, Any]], case_id: str, option: str
) -> None:
    run = results[case_id]
    lines = run["stderr"].strip().splitlines()
    assert run["rc"] == 2, run["stderr"][-2000:]
    assert "Traceback" not in run["stderr"]
    # one line: for profile this is also the proof it failed before profiling (each bucket prints a line)
    assert len(lines) == 1 and lines[0].startswith("error: ") and option in lines[0], lines
    assert run["stdout"] == ""  # no table of NaNs, no JSON with Infinity
    assert not run["wrote_out"]  # a refused profile did not run
    assert run["elapsed_s"] < 10
