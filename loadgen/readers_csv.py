"""CSV trace readers: Azure LLM inference 2023/2024, BurstGPT, and two length-only samples.

| format | header (columns by name, any order, extra columns ignored) | time |
|---|---|---|
| `azure` | `TIMESTAMP,ContextTokens,GeneratedTokens` | datetime, fraction optional (`2023-11-16 18:17:03.9799600`, `2024-05-10 00:00:00.009930+00:00`) |
| `burstgpt` | `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type` (+ `Session ID`, `Elapsed time` in newer releases) | seconds |
| `burstgpt-lengths` | `request_tokens,response_tokens` | none |
| `sharegpt-lengths` | `num_prefill_tokens,num_decode_tokens` (Vidur's ShareGPT length files) | none |

Rows are read one at a time with `csv.reader`; the line named in an error is the physical line the row
ends on (quoted fields may span lines). Timestamps must not go backwards (a replay is a schedule): a row
earlier than the one before it is malformed.

Rows that are well formed but cannot be replayed are *dropped*, counted by reason, never sent:
- BurstGPT rows with `Response tokens` = 0 are failed requests in the source (the service answered
  nothing): their real cost is unknown and `max_tokens=0` is not a valid request, so they are dropped
  as `failed_in_source` and the count is in the report (BurstGPT's own analyses exclude them too).
- any row with 0 prompt tokens (`zero_input_tokens`) or 0 output tokens (`zero_output_tokens`).
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from loadgen.trace import (
    ReadStats,
    RowError,
    TraceError,
    TraceRequest,
    parse_count,
    parse_seconds,
    replayable,
)

# format name → (required columns, columns that may be missing)
CSV_FORMATS: dict[str, tuple[str, ...]] = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"),
    "burstgpt-lengths": ("request_tokens", "response_tokens"),
    "sharegpt-lengths": ("num_prefill_tokens", "num_decode_tokens"),
}


def _norm(name: str) -> str:
    return name.strip().lstrip("\ufeff").lower()


def detect_csv_format(header: list[str]) -> str | None:
    """The format whose required columns all appear in `header` (case-insensitive), else None."""
    names = {_norm(h) for h in header}
    for fmt, required in CSV_FORMATS.items():
        if all(_norm(c) in names for c in required):
            return fmt
    return None


def parse_datetime_s(text: str) -> float:
    """Seconds since the epoch of an ISO datetime; naive times are taken as UTC. Any number of fraction digits."""
    s = text.strip()
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise RowError(
            "bad_time", f"timestamp {text!r} is not a datetime like 2023-11-16 18:17:03.9799600"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    # fromisoformat keeps microseconds; Azure's 7th fraction digit (100 ns) is below any replay's precision.
    return dt.timestamp()


class _Timeline:
    """Turns absolute times into seconds since the first row, refusing time that goes backwards."""

    __slots__ = ("_last", "_origin")

    def __init__(self) -> None:
        self._origin: float | None = None
        self._last = 0.0

    def relative(self, t: float) -> float:
        if self._origin is None:
            self._origin = t
        rel = t - self._origin
        if rel < self._last:
            raise RowError(
                "time_backwards",
                f"timestamp goes backwards ({rel:.6f} s after the first row, previous {self._last:.6f} s)",
            )
        self._last = rel
        return rel


RowParser = Callable[[dict[str, str], int], TraceRequest | None]


def _azure(timeline: _Timeline, stats: ReadStats) -> RowParser:
    def parse(row: dict[str, str], line: int) -> TraceRequest | None:
        stamp = parse_datetime_s(row["timestamp"])
        inp = parse_count(row["contexttokens"], "ContextTokens")
        out = parse_count(row["generatedtokens"], "GeneratedTokens")
        t = timeline.relative(stamp)  # after the checks: a malformed row does not start the clock
        return TraceRequest(t, inp, out, (), line) if replayable(inp, out, stats) else None

    return parse


def _burstgpt(timeline: _Timeline, stats: ReadStats) -> RowParser:
    def parse(row: dict[str, str], line: int) -> TraceRequest | None:
        stamp = parse_seconds(row["timestamp"], "Timestamp")
        inp = parse_count(row["request tokens"], "Request tokens")
        out = parse_count(row["response tokens"], "Response tokens")
        t = timeline.relative(stamp)  # after the checks: a malformed row does not start the clock
        if out == 0:
            stats.dropped["failed_in_source"] += 1  # BurstGPT marks failed requests with 0 response tokens
            return None
        return TraceRequest(t, inp, out, (), line) if replayable(inp, out, stats) else None

    return parse


def _lengths_only(in_col: str, out_col: str, stats: ReadStats) -> RowParser:
    def parse(row: dict[str, str], line: int) -> TraceRequest | None:
        inp = parse_count(row[in_col], in_col)
        out = parse_count(row[out_col], out_col)
        return TraceRequest(None, inp, out, (), line) if replayable(inp, out, stats) else None

    return parse


def _parser_for(fmt: str, stats: ReadStats) -> RowParser:
    if fmt == "azure":
        return _azure(_Timeline(), stats)
    if fmt == "burstgpt":
        return _burstgpt(_Timeline(), stats)
    if fmt == "burstgpt-lengths":
        return _lengths_only("request_tokens", "response_tokens", stats)
    if fmt == "sharegpt-lengths":
        return _lengths_only("num_prefill_tokens", "num_decode_tokens", stats)
    raise ValueError(f"not a CSV format: {fmt}")


def read_csv_trace(
    path: Path, fh: TextIO, fmt: str, stats: ReadStats, skip_bad_rows: bool = False
) -> Iterator[TraceRequest]:
    """Requests of a CSV trace in file order. `fh` is positioned at the start of the file (header first)."""
    reader = csv.reader(fh)
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(path, None, "empty file (no header row)") from None
    except csv.Error as e:
        raise TraceError(path, reader.line_num, f"bad CSV header: {e}") from None
    names = [_norm(h) for h in header]
    missing = [c for c in CSV_FORMATS[fmt] if _norm(c) not in names]
    if missing:
        has = ", ".join(header)
        if len(has) > 200:  # not a CSV header at all (a JSONL trace read as CSV): its start says enough
            has = has[:200] + "…"
        article = "an" if fmt[:1] in "aeiou" else "a"
        raise TraceError(path, 1, f"not {article} {fmt} trace: header lacks {', '.join(missing)} (has {has})")
    parse = _parser_for(fmt, stats)
    width = len(names)
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as e:  # e.g. NUL byte, unterminated quote at EOF
            cells, bad = None, RowError("bad_csv", f"bad CSV: {e}")
        line = reader.line_num
        if cells is not None and not any(c.strip() for c in cells):
            continue  # blank line
        stats.rows += 1
        try:
            if cells is None:
                raise bad
            if len(cells) != width:
                raise RowError("field_count", f"expected {width} fields like the header, got {len(cells)}")
            req = parse(dict(zip(names, cells, strict=True)), line)
        except RowError as e:
            if not skip_bad_rows:
                raise TraceError(path, line, str(e)) from None
            stats.skipped[e.kind] += 1
            continue
        if req is not None:
            stats.yielded += 1
            yield req
