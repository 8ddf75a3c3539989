"""One entry point for every trace: `open_trace(source, format=None)` → a streaming `Trace`.

Detection reads only the start of the file (at most `HEAD_BYTES`): a CSV header names its format by its
columns; a first character `[` means a ShareGPT array; a first JSON line with `hash_ids`/`input_length`
means Mooncake, one with `conversations` means ShareGPT JSONL. `synthetic:...` is not a file but a spec
(`loadgen.synthetic`). `format=` forces a reader (the CLI's `--format`). Text is UTF-8, with or without a
byte-order mark.

A source that is not a regular file (a pipe: `<(zcat trace.csv.gz)`, `/dev/stdin`, a FIFO) cannot be read
twice, so it is opened once: the bytes detection read are replayed in front of the rest of the stream.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import io
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

from loadgen import synthetic
from loadgen.readers_csv import CSV_FORMATS, detect_csv_format, read_csv_trace
from loadgen.readers_json import read_mooncake, read_sharegpt
from loadgen.trace import ReadStats, TraceError, TraceRequest

FORMATS: tuple[str, ...] = (*CSV_FORMATS, "mooncake", "sharegpt", "synthetic")
TIMED_FORMATS = frozenset({"azure", "burstgpt", "mooncake", "synthetic"})
# Detection reads at most this much: a minified ShareGPT array is one line of hundreds of MB.
HEAD_BYTES = 64 << 10
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # the line ends `newline=""` reading splits on
# A first JSON line cut at HEAD_BYTES cannot be parsed: its first key that names a format decides.
_FORMAT_KEY = re.compile(r'"(hash_ids|input_length|conversations?)"\s*:')
_ENCODING = "utf-8-sig"  # UTF-8; a leading byte-order mark (Windows tools write one) is dropped


def detect_format(path: Path) -> str:
    """The format of a trace file from its first line; raises TraceError when it is not one we read."""
    with contextlib.closing(_open_binary(path)) as raw:
        head = _read_head(raw, path)
    return _detect(path, *_first_line(head, path))


def _detect(path: Path, text: str, cut: bool) -> str:
    """The format named by the first non-blank line `text` (`cut`: only its first HEAD_BYTES were read)."""
    if not text:
        raise TraceError(path, None, "empty file")
    if text.startswith("["):
        return "sharegpt"
    if text.startswith("{"):
        fmt = _json_line_format(text, cut)
        if fmt is None:
            raise TraceError(
                path, 1, "a JSON line that is neither Mooncake (hash_ids) nor ShareGPT (conversations)"
            )
        return fmt
    header = next(csv.reader([text]))
    fmt = detect_csv_format(header)
    if fmt is None:
        known = "; ".join(f"{k}: {', '.join(v)}" for k, v in CSV_FORMATS.items())
        raise TraceError(
            path, 1, f"unrecognised header {text[:120]!r} (known CSV headers — {known}); use --format"
        )
    return fmt


def _json_line_format(text: str, cut: bool) -> str | None:
    if cut:  # a long ShareGPT conversation (or a huge hash_ids list): its keys say which
        match = _FORMAT_KEY.search(text)
        keys = {match.group(1)} if match else set()
    else:
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deeply to decode
            obj = None
        keys = set(obj) if isinstance(obj, dict) else set()
    if keys & {"hash_ids", "input_length"}:
        return "mooncake"
    if keys & {"conversations", "conversation"}:
        return "sharegpt-jsonl"
    return None


def _read_head(raw: BinaryIO, path: Path) -> bytes:
    """The start of the input: up to the end of its first non-blank line, or HEAD_BYTES. A pipe returns
    what its writer has written so far, so this reads on until one of those (or the end) is reached."""
    head = bytearray()
    try:
        while len(head) < HEAD_BYTES:
            chunk = raw.read(HEAD_BYTES - len(head))
            if not chunk:
                break
            head += chunk
            if b"\n" in head.removeprefix(codecs.BOM_UTF8).lstrip():
                break
    except OSError as e:
        raise TraceError(path, None, f"cannot read: {e.strerror or e}") from None
    return bytes(head)


def _first_line(head: bytes, path: Path) -> tuple[str, bool]:
    """The first non-blank line of `head`, stripped, and whether HEAD_BYTES cut it short."""
    with _utf8(path):
        # not final: the read may end inside a multi-byte character, which is not an error
        text = codecs.getincrementaldecoder(_ENCODING)().decode(head, final=False)
    pieces = _LINE_BREAK.split(text)
    for k, piece in enumerate(pieces):
        if piece.strip():
            return piece.strip(), k == len(pieces) - 1 and len(head) >= HEAD_BYTES
    return "", False


@contextlib.contextmanager
def _utf8(path: Path) -> Iterator[None]:
    """A file that is not UTF-8 is a TraceError (one line), not a UnicodeDecodeError from the reader."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise TraceError(path, None, f"not UTF-8 text (byte {e.start} of a read)") from None


def _open_binary(path: Path) -> BinaryIO:
    try:
        return path.open("rb", buffering=0)
    except FileNotFoundError:
        raise TraceError(path, None, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, None, "is a directory, not a trace file") from None
    except OSError as e:
        raise TraceError(path, None, f"cannot open: {e.strerror}") from None


def _text(raw: BinaryIO) -> TextIO:
    return io.TextIOWrapper(io.BufferedReader(raw), encoding=_ENCODING, newline="")


class _Replayed(io.RawIOBase):
    """`head` (bytes already read from `rest`), then the rest of the stream: a pipe read once, seen whole."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        super().__init__()
        self._head = memoryview(head)
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest.readinto(buffer)

    def close(self) -> None:
        try:
            self._rest.close()
        finally:
            super().close()


@dataclass(slots=True)
class Trace:
    """A trace source: iterate it (once) to stream requests; `stats` fills in as you go."""

    source: str
    format: str
    skip_bad_rows: bool = False
    seed: int = 0
    stats: ReadStats = field(default_factory=ReadStats)
    jsonl: bool = False  # sharegpt: one conversation per line rather than one JSON array
    # A pipe's handle, opened (and its start read) by `open_trace`: it cannot be opened again.
    _stream: TextIO | None = field(default=None, repr=False, compare=False)
    _piped: bool = field(default=False, repr=False, compare=False)

    @property
    def timed(self) -> bool:
        """Whether requests carry arrival times (else the replay needs a fixed rate)."""
        return self.format in TIMED_FORMATS

    def close(self) -> None:
        """Release a pipe opened but never read (a regular file is open only while it is iterated)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __iter__(self) -> Iterator[TraceRequest]:
        if self.format == "synthetic":
            for req in synthetic.generate(synthetic.parse_spec(self.source), self.seed):
                self.stats.rows += 1
                self.stats.yielded += 1
                yield req
            return
        path = Path(self.source)
        # The file stays open only while the generator runs; closing the generator closes it.
        with contextlib.closing(self._handle(path)) as fh, _utf8(path):
            if self.format in CSV_FORMATS:
                yield from read_csv_trace(path, fh, self.format, self.stats, self.skip_bad_rows)
            elif self.format == "mooncake":
                yield from read_mooncake(path, fh, self.stats, self.skip_bad_rows)
            else:
                yield from read_sharegpt(path, fh, self.stats, self.skip_bad_rows, jsonl=self.jsonl)

    def _handle(self, path: Path) -> TextIO:
        if not self._piped:
            return _text(_open_binary(path))
        if self._stream is None:
            raise TraceError(path, None, "not a regular file (a pipe?): it can be read only once")
        fh, self._stream = self._stream, None
        return fh


def open_trace(
    source: str | Path, format: str | None = None, skip_bad_rows: bool = False, seed: int = 0
) -> Trace:
    """A `Trace` for a file or a `synthetic:` spec. Validates eagerly (format, spec) but reads lazily: only
    the start of a file is read now (and a regular file closed again until it is iterated)."""
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
    if format is not None and (format not in FORMATS or format == "synthetic"):
        raise TraceError(path, None, f"unknown format {format!r} (one of {', '.join(FORMATS[:-1])})")
    raw = _open_binary(path)  # fails now, not mid-replay, when the file is missing
    try:
        head = _read_head(raw, path)
        first, cut = _first_line(head, path)
        fmt = format or _detect(path, first, cut)
        piped = not stat.S_ISREG(os.fstat(raw.fileno()).st_mode)
    except BaseException:
        raw.close()
        raise
    stream = _text(_Replayed(head, raw)) if piped else None
    if not piped:
        raw.close()
    fmt = "sharegpt" if fmt == "sharegpt-jsonl" else fmt
    return Trace(text, fmt, skip_bad_rows, seed, jsonl=first.startswith("{"), _stream=stream, _piped=piped)
