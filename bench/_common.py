"""Shared by the benchmarks: where results go and how a run is summarised in BENCHMARKS.md."""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
SHARED_DATA = ROOT.parent / "shared" / "data"
HEADER = "| date | bench | command | result |\n|---|---|---|---|\n"


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "bench": name,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def append_line(name: str, command: str, result: str) -> None:
    if not BENCHMARKS_MD.exists() or not BENCHMARKS_MD.read_text().strip():
        BENCHMARKS_MD.write_text("# Benchmarks\n\nOne line per run; JSON in `bench/results/`.\n\n" + HEADER)
    with BENCHMARKS_MD.open("a") as fh:
        fh.write(f"| {dt.date.today().isoformat()} | {name} | `{command}` | {result} |\n")
