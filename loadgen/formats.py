"""One entry point for every trace: `open_trace(source, format=None)` → a streaming `Trace`.

Detection reads only the start of the file: a CSV header names its format by its columns; a first
character `[` means a ShareGPT array; a first JSON line with `hash_ids`/`input_length` means Mooncake, one
with `conversations` means ShareGPT JSONL. `synthetic:...` is not a file but a spec (`loadgen.synthetic`).
`format=` forces a reader (the CLI's `--format`).
"""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from loadgen import synthetic
from loadgen.readers_csv import CSV_FORMATS, detect_csv_format, read_csv_trace
from loadgen.readers_json import read_mooncake, read_sharegpt
from loadgen.trace import ReadStats, TraceError, TraceRequest

FORMATS: tuple[str, ...] = (*CSV_FORMATS, "mooncake", "sharegpt", "synthetic")
TIMED_FORMATS = frozenset({"azure", "burstgpt", "mooncake", "synthetic"})


def detect_format(path: Path) -> str:
    """The format of a trace file from its first line; raises TraceError when it is not one we read."""
    with _open(path) as fh, _utf8(path):
        first = fh.readline()
        while first and not first.strip():
            first = fh.readline()
    text = first.strip().lstrip("\ufeff")
    if not text:
        raise TraceError(path, None, "empty file")
    if text.startswith("["):
        return "sharegpt"
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            if "hash_ids" in obj or "input_length" in obj:
                return "mooncake"
            if "conversations" in obj or "conversation" in obj:
                return "sharegpt-jsonl"
        raise TraceError(
            path, 1, "a JSON line that is neither Mooncake (hash_ids) nor ShareGPT (conversations)"
        )
    header = next(csv.reader([text]))
    fmt = detect_csv_format(header)
    if fmt is None:
        known = "; ".join(f"{k}: {', '.join(v)}" for k, v in CSV_FORMATS.items())
        raise TraceError(
            path, 1, f"unrecognised header {text[:120]!r} (known CSV headers — {known}); use --format"
        )
    return fmt


@contextlib.contextmanager
def _utf8(path: Path) -> Iterator[None]:
    """A file that is not UTF-8 is a TraceError (one line), not a UnicodeDecodeError from the reader."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise TraceError(path, None, f"not UTF-8 text (byte {e.start} of a read)") from None


def _open(path: Path) -> TextIO:
    try:
        return path.open(encoding="utf-8", newline="")
    except FileNotFoundError:
        raise TraceError(path, None, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, None, "is a directory, not a trace file") from None
    except OSError as e:
        raise TraceError(path, None, f"cannot open: {e.strerror}") from None


@dataclass(slots=True)
class Trace:
    """A trace source: iterate it (once) to stream requests; `stats` fills in as you go."""

    source: str
    format: str
    skip_bad_rows: bool = False
    seed: int = 0
    stats: ReadStats = field(default_factory=ReadStats)

    @property
    def timed(self) -> bool:
        """Whether requests carry arrival times (else the replay needs a fixed rate)."""
        return self.format in TIMED_FORMATS

    def __iter__(self) -> Iterator[TraceRequest]:
        if self.format == "synthetic":
            for req in synthetic.generate(synthetic.parse_spec(self.source), self.seed):
                self.stats.rows += 1
                self.stats.yielded += 1
                yield req
            return
        path = Path(self.source)
        # The file stays open only while the generator runs; closing the generator closes it.
        with contextlib.closing(_open(path)) as fh, _utf8(path):
            if self.format in CSV_FORMATS:
                yield from read_csv_trace(path, fh, self.format, self.stats, self.skip_bad_rows)
            elif self.format == "mooncake":
                yield from read_mooncake(path, fh, self.stats, self.skip_bad_rows)
            else:
                jsonl = _first_char(fh) == "{"
                yield from read_sharegpt(path, fh, self.stats, self.skip_bad_rows, jsonl=jsonl)


def _first_char(fh: TextIO) -> str:
    """First non-blank character of the file; the handle is rewound."""
    ch = ""
    while True:
        c = fh.read(1)
        if not c or (not c.isspace() and c != "\ufeff"):
            ch = c
            break
    fh.seek(0)
    return ch


def open_trace(
    source: str | Path, format: str | None = None, skip_bad_rows: bool = False, seed: int = 0
) -> Trace:
    """A `Trace` for a file or a `synthetic:` spec. Validates eagerly (format, spec) but reads lazily."""
    text = str(source)
    if text.startswith(synthetic.PREFIX):
        if format not in (None, "synthetic"):
            raise TraceError(text, None, f"a synthetic spec cannot be read as {format}")
        try:
            synthetic.parse_spec(text)
        except synthetic.SpecError as e:
            raise TraceError("synthetic", None, str(e)) from None
        return Trace(text, "synthetic", skip_bad_rows, seed)
    path = Path(text)
    if format is None:
        fmt = detect_format(path)
        fmt = "sharegpt" if fmt == "sharegpt-jsonl" else fmt
    elif format not in FORMATS or format == "synthetic":
        raise TraceError(path, None, f"unknown format {format!r} (one of {', '.join(FORMATS[:-1])})")
    else:
        fmt = format
        with _open(path):
            pass  # fail now, not mid-replay, when the file is missing
    return Trace(text, fmt, skip_bad_rows, seed)
