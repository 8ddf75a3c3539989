"""The replay's JSON report (`--out`), schema `mosaic.loadgen.report/v1`.

```
{
  "schema": "mosaic.loadgen.report/v1",
  "created_at": ISO time the report was written, "started_at": ISO wall time of t = 0,
  "definitions": {metric: definition, ...}          # loadgen.metrics.DEFINITIONS (vLLM's)
  "config": {"trace", "format", "url", "endpoint", "model", "rate_scale", "rate", "arrival",
             "burstiness", "start_s", "duration_s", "max_requests", "concurrency", "timeout_s", "seed",
             "lora_modules": [name, ...] | null, "lora_assignment": "random" | "round-robin" | null,
             "slo": {"ttft_ms", "tpot_ms", "e2el_ms"}, "lag_threshold_ms"},
      # model: the base model; with lora_modules each request names one of them instead (loadgen.lora)
  "trace": {"rows", "requests", "skipped_bad_rows", "skipped_by_reason", "dropped", "dropped_by_reason"},
      # rows: data rows read; requests: requests the reader produced from them, before the --start/--duration
      # window and the cap picked what to send (summary.sent)
  "summary": {"sent", "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
              "request_throughput", "output_throughput", "total_token_throughput",   # per second
              "goodput", "slo_attainment",                                           # null without an SLO
              "ttft_ms" | "tpot_ms" | "itl_ms" | "e2el_ms" | "send_lag_ms":
                  {"count", "mean", "std", "median", "p90", "p95", "p99", "max"},
              "lag_threshold_ms", "lag_exceeded", "errors": {type: count}, "output_length_mismatches",
              "concurrency_wait_ms": {same stats} | null,
              "requests_by_model": {model: {"sent", "completed"}}},   # the models the bodies named
  "requests": [{"index", "trace_line", "scheduled_s", "sent_s", "end_s", "input_tokens",
                "expected_output_tokens", "output_tokens", "success", "error_type", "error",
                "ttft_ms", "tpot_ms", "e2el_ms", "chunks", "model"}, ...]            # times: s since t = 0
}
```
Additions keep the version; a renamed or removed field bumps it to v2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadgen.client import RequestRecord
from loadgen.metrics import DEFINITIONS, Metrics, Stats

SCHEMA = "mosaic.loadgen.report/v1"


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """What was asked of the replay, as the report records it."""

    trace: str
    format: str
    url: str
    endpoint: str
    model: str
    rate_scale: float = 1.0
    rate: float | None = None
    arrival: str | None = "poisson"  # None: the trace's own arrival times (no --rate)
    burstiness: float | None = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    concurrency: int | None = None
    timeout_s: float | None = None
    seed: int = 0
    lora_modules: tuple[str, ...] | None = None  # None: every request names `model`
    lora_assignment: str | None = None  # with lora_modules: random | round-robin
    extra: dict[str, Any] = field(default_factory=dict)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def request_row(r: RequestRecord) -> dict[str, Any]:
    return {
        "index": r.index,
        "trace_line": r.trace_line,
        "scheduled_s": r.scheduled_s,
        "sent_s": r.sent_s,
        "end_s": r.end_s,
        "input_tokens": r.input_tokens,
        "expected_output_tokens": r.expected_output_tokens,
        "output_tokens": r.output_tokens if r.success else 0,
        "success": r.success,
        "error_type": r.error_type,
        "error": r.error,
        "ttft_ms": _ms(r.ttft_s),
        "tpot_ms": _ms(r.tpot_s),
        "e2el_ms": _ms(r.e2el_s),
        "chunks": len(r.chunk_s),
        "model": r.model,
    }


def concurrency_wait(records: list[RequestRecord]) -> Stats:
    """Time requests waited for a free slot (`--concurrency`), apart from send lag."""
    return Stats.of_seconds([max(0.0, r.slot_s - r.scheduled_s) for r in records])


def requests_by_model(records: list[RequestRecord]) -> dict[str, dict[str, int]]:
    """Requests sent and completed per model named (with --lora-modules: how the adapters were drawn)."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        row = out.setdefault(r.model, {"sent": 0, "completed": 0})
        row["sent"] += 1
        row["completed"] += r.success
    return dict(sorted(out.items()))


def build_report(
    config: ReplayConfig,
    metrics: Metrics,
    records: list[RequestRecord],
    trace_stats: dict[str, object],
    started_at: str,
) -> dict[str, Any]:
    cfg = {k: getattr(config, k) for k in config.__dataclass_fields__ if k != "extra"}
    if config.lora_modules is not None:
        cfg["lora_modules"] = list(config.lora_modules)
    cfg.update(config.extra)
    cfg["slo"] = {
        "ttft_ms": metrics.slo.ttft_ms,
        "tpot_ms": metrics.slo.tpot_ms,
        "e2el_ms": metrics.slo.e2el_ms,
    }
    cfg["lag_threshold_ms"] = metrics.lag_threshold_ms
    summary = metrics.as_dict()
    summary["concurrency_wait_ms"] = concurrency_wait(records).as_dict() if config.concurrency else None
    summary["requests_by_model"] = requests_by_model(records)
    return {
        "schema": SCHEMA,
        "created_at": datetime.now(UTC).isoformat(),
        "started_at": started_at,
        "definitions": DEFINITIONS,
        "config": cfg,
        "trace": trace_stats,
        "summary": summary,
        "requests": [request_row(r) for r in records],
    }


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a report


def load_report(path: Path) -> dict[str, Any]:
    """Read a report back; raises ValueError when it is not a v1 report."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} report")
    return data
