"""JSON trace readers: Mooncake/Kimi JSONL and ShareGPT conversations, both streamed.

**Mooncake** (`mooncake`, JSONL, FAST'25 release): one object per line,
`{"timestamp": ms since the trace start, "input_length", "output_length", "hash_ids": [int, ...]}`.
Each hash id names one 512-token block of the prompt (`ceil(input_length / 512)` ids); equal leading ids
mean a shareable KV prefix. The replay turns each id into the same 512 token ids every time it appears
(see `loadgen.prompts`), so prefix caching and prefix-aware routing see the sharing the trace recorded.

**ShareGPT** (`sharegpt`): a JSON array of `{"id", "conversations": [{"from": "human"|"gpt", "value": text}, ...]}`
(the public `ShareGPT_V3_unfiltered_cleaned_split.json`), or the same records one per line (JSONL). The
array is parsed element by element from a rolling buffer (`json.JSONDecoder.raw_decode`), never whole.
Like vLLM's benchmark, each conversation gives one request: the first human turn is the prompt, the
reply after it the output; conversations without such a pair are dropped (`no_prompt_reply_pair`).
There is no tokenizer dependency, so lengths are a documented estimate (`estimate_tokens`):
ceil(ASCII characters / 4) + 1 per non-ASCII character (OpenAI's ~4 characters per token for English;
CJK characters cost about one token each in Llama tokenizers). ShareGPT has no timestamps: replay it
with `--rate`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from loadgen.trace import (
    ReadStats,
    RowError,
    TraceError,
    TraceRequest,
    parse_count,
    parse_seconds,
    replayable,
)

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces (FAST'25 release README)
_CHUNK = 1 << 16
# json's decoder recurses once per nesting level: a row of `[[[[…` raises RecursionError, not a decode error
_TOO_DEEP = "invalid JSON: nested too deeply"


def estimate_tokens(text: str) -> int:
    """Documented token estimate: ceil(ascii_chars / 4) + non_ascii_chars, at least 1."""
    ascii_chars = sum(1 for ch in text if ord(ch) < 128)
    return max(1, math.ceil(ascii_chars / 4) + (len(text) - ascii_chars))


def _mooncake_record(obj: Any, last_ms: list[float]) -> TraceRequest:
    if not isinstance(obj, dict):
        raise RowError("bad_record", f"expected a JSON object, got {type(obj).__name__}")
    for key in ("timestamp", "input_length", "output_length"):
        if key not in obj:
            raise RowError("missing_field", f"missing field {key!r}")
    ms = parse_seconds(obj["timestamp"], "timestamp")
    if ms < last_ms[0]:
        raise RowError("time_backwards", f"timestamp goes backwards ({ms} ms after {last_ms[0]} ms)")
    inp = parse_count(obj["input_length"], "input_length")  # 0 is well formed: dropped by the reader
    out = parse_count(obj["output_length"], "output_length")
    raw_ids = obj.get("hash_ids", [])
    if not isinstance(raw_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in raw_ids
    ):
        raise RowError("bad_hash_ids", "hash_ids must be a list of integers")
    if len(raw_ids) > math.ceil(inp / MOONCAKE_BLOCK_TOKENS):
        raise RowError(
            "bad_hash_ids",
            f"{len(raw_ids)} hash_ids cover more than input_length {inp} ({MOONCAKE_BLOCK_TOKENS} tokens each)",
        )
    last_ms[0] = ms
    return TraceRequest(ms / 1000.0, inp, out, tuple(raw_ids), 0)


def read_mooncake(
    path: Path, fh: TextIO, stats: ReadStats, skip_bad_rows: bool = False
) -> Iterator[TraceRequest]:
    """Requests of a Mooncake JSONL trace; arrival = timestamp (ms) / 1000, relative to the first
    well-formed row (a row dropped for a zero length still starts the clock, as in the CSV readers)."""
    last_ms = [0.0]
    origin: float | None = None
    for line_no, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        stats.rows += 1
        try:
            req = _mooncake_record(_loads(line), last_ms)
        except RowError as e:
            if not skip_bad_rows:
                raise TraceError(path, line_no, str(e)) from None
            stats.skipped[e.kind] += 1
            continue
        assert req.arrival_s is not None
        if origin is None:
            origin = req.arrival_s
        if not replayable(req.input_tokens, req.output_tokens, stats):
            continue
        stats.yielded += 1
        yield TraceRequest(req.arrival_s - origin, req.input_tokens, req.output_tokens, req.hash_ids, line_no)


def _loads(text: str) -> Any:
    """One JSON line; invalid or too deeply nested JSON is a `bad_json` row."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError("bad_json", f"invalid JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise RowError("bad_json", _TOO_DEEP) from None


_USER_SPEAKERS = frozenset({"human", "user"})
# ShareGPT's model speakers (`gpt` in most dumps; `chatgpt`, `bard`, `bing` in some) and OpenAI's role
_MODEL_SPEAKERS = frozenset({"gpt", "chatgpt", "bard", "bing", "assistant", "model"})


def _sharegpt_record(obj: Any, stats: ReadStats, line: int) -> TraceRequest | None:
    if not isinstance(obj, dict):
        raise RowError("bad_record", f"expected a conversation object, got {type(obj).__name__}")
    conv = obj.get("conversations", obj.get("conversation"))
    if not isinstance(conv, list):
        raise RowError("bad_record", "missing 'conversations' list")
    for turn in conv:
        if not isinstance(turn, dict) or not isinstance(turn.get("value", turn.get("content")), str):
            raise RowError("bad_record", "each turn must be an object with a string 'value'")
    for i in range(len(conv) - 1):
        speaker = conv[i].get("from", conv[i].get("role"))
        answerer = conv[i + 1].get("from", conv[i + 1].get("role"))
        # a user turn answered by the model: a second user turn (or a system one) is no reply
        if speaker in _USER_SPEAKERS and answerer in _MODEL_SPEAKERS:
            prompt = conv[i].get("value", conv[i].get("content"))
            reply = conv[i + 1].get("value", conv[i + 1].get("content"))
            return TraceRequest(None, estimate_tokens(prompt), estimate_tokens(reply), (), line)
    stats.dropped["no_prompt_reply_pair"] += 1
    return None


def _cut_by_buffer(e: json.JSONDecodeError, size: int) -> bool:
    """Whether a decode error may only mean the element runs past the buffer (read more and retry), not that
    it is invalid: the decoder stopped within a literal's length of the end (`tr|ue`, `12|`, `"\\u12|`), or
    inside a string it never saw close. Anything else is bad JSON now; reading on would pull the rest of a
    huge file into memory only to report the same error at its end."""
    return e.pos >= size - 16 or e.msg.startswith("Unterminated string")


def _iter_json_array(fh: TextIO, path: Path) -> Iterator[tuple[int, Any | RowError]]:
    """(line, element) for each element of a top-level JSON array, decoding from a rolling buffer.

    An element that does not parse ends the stream with a RowError (the array cannot be resynchronised).
    """
    decoder = json.JSONDecoder()
    buf = fh.read(_CHUNK)
    pos = 0
    line = 1
    eof = not buf

    def skip(chars: str) -> None:
        nonlocal pos, line
        while pos < len(buf) and buf[pos] in chars:
            line += buf[pos] == "\n"
            pos += 1

    skip(" \t\r\n\ufeff")
    if pos >= len(buf) or buf[pos] != "[":
        raise TraceError(path, line, "ShareGPT JSON must be a top-level array of conversations")
    pos += 1
    first = True
    while True:
        skip(" \t\r\n")
        if pos >= len(buf) - 1 and not eof:  # keep at least one char ahead for ',' / ']'
            more = fh.read(_CHUNK)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        if pos >= len(buf):
            yield line, RowError("bad_json", "unterminated array")
            return
        if buf[pos] == "]":
            return
        if not first:
            if buf[pos] != ",":
                yield line, RowError("bad_json", f"expected ',' between conversations, got {buf[pos]!r}")
                return
            pos += 1
            skip(" \t\r\n")
        first = False
        while True:
            skip(" \t\r\n")  # raw_decode skips no whitespace: a refill after ",\n" starts with some
            try:
                obj, end = decoder.raw_decode(buf, pos)
                break
            except json.JSONDecodeError as e:
                if eof or not _cut_by_buffer(e, len(buf)):
                    yield line, RowError("bad_json", f"invalid JSON: {e.msg}")
                    return
                more = fh.read(max(_CHUNK, len(buf)))  # grow geometrically: a huge element stays linear
                eof = not more
                buf, pos = buf[pos:] + more, 0
            except RecursionError:  # this deep, reading more cannot make it parse
                yield line, RowError("bad_json", _TOO_DEEP)
                return
        yield line, obj
        line += buf.count("\n", pos, end)
        pos = end
        if pos > _CHUNK:  # drop consumed text so memory holds about one chunk plus one element
            buf, pos = buf[pos:], 0


def read_sharegpt(
    path: Path, fh: TextIO, stats: ReadStats, skip_bad_rows: bool = False, jsonl: bool = False
) -> Iterator[TraceRequest]:
    """Requests of a ShareGPT JSON array (or JSONL) file, estimated lengths, no arrival times."""
    if jsonl:
        items: Iterator[tuple[int, Any]] = (
            (n, _loads_or_error(text)) for n, text in enumerate(fh, start=1) if text.strip()
        )
    else:
        items = _iter_json_array(fh, path)
    for line, obj in items:
        stats.rows += 1
        try:
            if isinstance(obj, RowError):
                if obj.kind == "bad_json" and not jsonl:
                    raise TraceError(
                        path, line, str(obj)
                    )  # a broken array cannot be resumed, even when skipping
                raise obj
            req = _sharegpt_record(obj, stats, line)
        except RowError as e:
            if not skip_bad_rows:
                raise TraceError(path, line, str(e)) from None
            stats.skipped[e.kind] += 1
            continue
        if req is not None:
            stats.yielded += 1
            yield req


def _loads_or_error(text: str) -> Any:
    try:
        return _loads(text)
    except RowError as e:
        return e
