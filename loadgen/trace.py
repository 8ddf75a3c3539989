"""The load generator's unit of work: one request of a trace, and the bookkeeping every reader shares.

A reader turns a file into an iterator of `TraceRequest`s, one at a time (a multi-million-row trace is
never held in memory). Arrival times are seconds since the trace's first request; traces that carry only
lengths (ShareGPT, BurstGPT length samples) yield `arrival_s=None` and the replay times them with `--rate`.

A malformed row raises `TraceError` naming the file and the line. With `skip_bad_rows` the reader counts
the row in `ReadStats.skipped` (by reason) and goes on instead.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


class TraceError(ValueError):
    """A trace that cannot be read: the message starts with `file:line:` (or `file:` for whole-file errors)."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {reason}")


class RowError(ValueError):
    """Raised by a row parser; the reader turns it into a `TraceError` with file and line, or skips it.

    `kind` is a short stable key (`bad_count`, `bad_timestamp`, `time_backwards`, ...) used to count skips.
    """

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: when it arrives and how long its prompt and its answer are, in tokens."""

    arrival_s: float | None  # seconds since the first request of the trace; None: the trace has no times
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake block hashes (one per 512-token block): same id, same tokens
    line: int = 0  # 1-based source line (for messages and the report)


@dataclass(slots=True)
class ReadStats:
    """What a reader saw. Filled in while the iterator is consumed, so read it after the replay."""

    rows: int = 0  # data rows looked at (header excluded)
    yielded: int = 0  # requests produced
    skipped: Counter[str] = field(default_factory=Counter)  # malformed rows skipped, by reason
    dropped: Counter[str] = field(default_factory=Counter)  # well-formed rows left out on purpose, by reason

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def why_empty(self) -> str:
        """Why a read gave no request, for an error line: "is empty", or which rows were left out and why."""
        if self.rows == 0:
            return "is empty"
        reasons = ", ".join(f"{why} {n}" for why, n in sorted((self.dropped + self.skipped).items()))
        return f"has {self.rows} row(s), all left out" + (f" ({reasons})" if reasons else "")

    def as_dict(self) -> dict[str, object]:
        return {
            "rows": self.rows,
            "requests": self.yielded,
            "skipped_bad_rows": self.skipped_total,
            "skipped_by_reason": dict(sorted(self.skipped.items())),
            "dropped": self.dropped_total,
            "dropped_by_reason": dict(sorted(self.dropped.items())),
        }


def replayable(input_tokens: int, output_tokens: int, stats: ReadStats) -> bool:
    """Whether a well-formed row with these lengths can be replayed; counts the drop reason when not (an
    empty prompt is no request, and `max_tokens=0` is not a valid one), the same names in every reader."""
    if input_tokens == 0:
        stats.dropped["zero_input_tokens"] += 1
        return False
    if output_tokens == 0:
        stats.dropped["zero_output_tokens"] += 1
        return False
    return True


# The longest context any served model takes is 10M tokens (Llama 4 Scout); a larger count is a broken row,
# and building its prompt would allocate gigabytes before the first request is sent.
MAX_TOKENS = 10_000_000


def parse_count(value: object, what: str, minimum: int = 0) -> int:
    """A token count from a CSV cell or JSON value: an integer in [`minimum`, MAX_TOKENS] (JSON floats like
    12.0 accepted)."""
    if isinstance(value, bool):
        raise RowError("bad_count", f"{what} must be an integer, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            n = int(text)
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                raise RowError("bad_count", f"{what} must be an integer, got {value!r}") from None
            if not f.is_integer():
                raise RowError("bad_count", f"{what} must be an integer, got {value!r}") from None
            n = int(f)
    else:
        raise RowError("bad_count", f"{what} must be an integer, got {value!r}")
    if n < minimum:
        raise RowError("bad_count", f"{what} must be ≥ {minimum}, got {n}")
    if n > MAX_TOKENS:
        raise RowError("bad_count", f"{what} must be ≤ {MAX_TOKENS:,} tokens, got {n:,}")
    return n


def parse_seconds(value: object, what: str) -> float:
    """A finite, non-negative number of seconds (or milliseconds: the caller scales)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RowError("bad_time", f"{what} must be a number, got {value!r}")
    try:
        x = float(value)
    except ValueError:
        raise RowError("bad_time", f"{what} must be a number, got {value!r}") from None
    if x != x or x in (float("inf"), float("-inf")) or x < 0:
        raise RowError("bad_time", f"{what} must be a finite number ≥ 0, got {value!r}")
    return x
