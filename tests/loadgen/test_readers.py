"""Trace readers on small fixtures: well formed, malformed (error names file and line), skipped, empty."""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.formats import detect_format, open_trace
from loadgen.readers_json import _cut_by_buffer, _iter_json_array, estimate_tokens
from loadgen.trace import RowError, TraceError, TraceRequest

FIX = Path(__file__).parent / "fixtures"


def read(name: str, **kw: object) -> tuple[list[TraceRequest], dict[str, object]]:
    trace = open_trace(FIX / name, **kw)  # type: ignore[arg-type]
    reqs = list(trace)
    return reqs, trace.stats.as_dict()


def arrivals(reqs: list[TraceRequest]) -> list[float | None]:
    return [None if r.arrival_s is None else round(r.arrival_s, 6) for r in reqs]


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        pytest.param("azure_2023.csv", "azure", id="Azure 2023 header → azure"),
        pytest.param("azure_2024.csv", "azure", id="Azure 2024 header (same columns) → azure"),
        pytest.param("burstgpt.csv", "burstgpt", id="BurstGPT with Session ID and Elapsed time → burstgpt"),
        pytest.param(
            "burstgpt_old.csv", "burstgpt", id="older BurstGPT release without session columns → burstgpt"
        ),
        pytest.param(
            "burstgpt_lengths.csv", "burstgpt-lengths", id="request_tokens,response_tokens → burstgpt-lengths"
        ),
        pytest.param(
            "sharegpt_lengths.csv", "sharegpt-lengths", id="Vidur ShareGPT lengths → sharegpt-lengths"
        ),
        pytest.param("mooncake.jsonl", "mooncake", id="JSON line with hash_ids → mooncake"),
        pytest.param("sharegpt.json", "sharegpt", id="top-level JSON array → sharegpt"),
        pytest.param(
            "sharegpt.jsonl", "sharegpt-jsonl", id="JSON line with conversations → sharegpt (JSONL)"
        ),
    ],
)
def test_format_is_detected_from_the_first_line(name: str, fmt: str) -> None:
    assert detect_format(FIX / name) == fmt


def test_azure_2023_arrivals_are_seconds_since_the_first_row() -> None:
    reqs, stats = read("azure_2023.csv")
    # 18:15:46.68059 is t = 0; then +0.3 s, +1.5 s, +1.5 s (a tie is allowed)
    assert arrivals(reqs) == [0.0, 0.3, 1.5, 1.5]
    assert [(r.input_tokens, r.output_tokens, r.line) for r in reqs] == [
        (374, 44, 2),
        (396, 109, 3),
        (879, 55, 4),
        (91, 16, 5),
    ]
    assert stats["requests"] == 4 and stats["skipped_bad_rows"] == 0


def test_azure_2024_timestamps_with_zone_and_without_fraction() -> None:
    reqs, _ = read("azure_2024.csv")
    # 00:00:01 − 00:00:00.009930 = 0.99007; 01.509930 − 00.009930 = 1.5
    assert arrivals(reqs) == [0.0, 0.99007, 1.5]
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(2048, 12), (100, 3), (7, 1)]


def test_malformed_azure_row_names_file_and_line() -> None:
    with pytest.raises(
        TraceError, match=r"azure_bad_tokens\.csv:3: ContextTokens must be an integer, got 'lots'"
    ):
        read("azure_bad_tokens.csv")


def test_bad_rows_are_streamed_up_to_the_error() -> None:
    """A reader is lazy: the good row before the bad one is produced before the error is raised."""
    it = iter(open_trace(FIX / "azure_bad_tokens.csv"))
    assert next(it).line == 2
    with pytest.raises(TraceError, match=":3:"):
        next(it)


def test_skip_bad_rows_counts_each_reason() -> None:
    reqs, stats = read("azure_bad_tokens.csv", skip_bad_rows=True)
    # kept: line 2 (t = 0) and line 7 (18:15:50 − 18:15:46.68059 = 3.31941 s); line 6 goes back in time
    assert [(r.line, round(r.arrival_s or 0, 5)) for r in reqs] == [(2, 0.0), (7, 3.31941)]
    assert stats["skipped_by_reason"] == {"bad_count": 3, "bad_time": 1, "time_backwards": 1}
    assert stats["rows"] == 7 and stats["requests"] == 2


@pytest.mark.parametrize(
    ("header", "bad_first"),
    [
        ("TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:00:00.0000000,lots,12"),
        (
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
            "0,ChatGPT,x,5,5,Conversation log",
        ),
    ],
    ids=["azure", "burstgpt"],
)
def test_a_skipped_bad_first_row_does_not_start_the_clock(
    tmp_path: Path, header: str, bad_first: str
) -> None:
    """The first row the trace keeps is t = 0: a malformed first row, skipped, set the origin (the replay
    then idled until the first real request, 600 s here)."""
    if header.startswith("TIMESTAMP"):
        good = ["2023-11-16 18:10:00.0000000,10,10", "2023-11-16 18:10:01.5000000,20,20"]
    else:
        good = ["600,ChatGPT,10,10,20,Conversation log", "601.5,ChatGPT,20,20,40,Conversation log"]
    path = tmp_path / "first_bad.csv"
    path.write_text("\n".join([header, bad_first, *good]) + "\n")
    assert [r.arrival_s for r in open_trace(path, skip_bad_rows=True)] == [0.0, 1.5]


def test_burstgpt_drops_failed_rows_and_zero_prompts() -> None:
    reqs, stats = read("burstgpt.csv")
    # Timestamp 5 is t = 0; rows at 45 (0 response tokens) and 118.5 (0 request tokens) are dropped
    assert arrivals(reqs) == [0.0, 113.0, 125.0]
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(472, 18), (417, 1123), (61, 7)]
    assert stats["dropped_by_reason"] == {"failed_in_source": 1, "zero_input_tokens": 1}
    assert stats["skipped_bad_rows"] == 0


def test_burstgpt_row_with_missing_fields_is_malformed() -> None:
    with pytest.raises(TraceError, match=r"burstgpt_bad\.csv:3: expected 6 fields like the header, got 4"):
        read("burstgpt_bad.csv")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("burstgpt_lengths.csv", [(632, 34), (220, 7), (70, 30)], id="BurstGPT length sample"),
        pytest.param(
            "sharegpt_lengths.csv",
            [(3742, 284), (18, 243)],
            id="Vidur ShareGPT lengths (extra columns ignored)",
        ),
    ],
)
def test_length_only_csvs_have_no_arrival_times(name: str, expected: list[tuple[int, int]]) -> None:
    trace = open_trace(FIX / name)
    reqs = list(trace)
    assert not trace.timed
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == expected
    assert all(r.arrival_s is None for r in reqs)


def test_mooncake_times_are_ms_and_hash_ids_kept() -> None:
    reqs, _ = read("mooncake.jsonl")
    # timestamps 1000, 1000, 2500 ms → 0, 0, 1.5 s; the blank line 3 is not a row
    assert arrivals(reqs) == [0.0, 0.0, 1.5]
    assert [(r.hash_ids, r.line) for r in reqs] == [((0, 1, 2), 1), ((0, 3), 2), ((4,), 4)]


def test_mooncake_invalid_json_names_the_line() -> None:
    with pytest.raises(TraceError, match=r"mooncake_bad\.jsonl:2: invalid JSON"):
        read("mooncake_bad.jsonl")


def test_mooncake_skip_counts_reasons() -> None:
    reqs, stats = read("mooncake_bad.jsonl", skip_bad_rows=True)
    # line 2 broken JSON, line 3 no output_length, line 4: 2 ids for 100 tokens > ceil(100/512) = 1, line 5 ids not ints
    assert [r.line for r in reqs] == [1, 6]
    assert stats["skipped_by_reason"] == {"bad_hash_ids": 2, "bad_json": 1, "missing_field": 1}


def test_sharegpt_takes_the_first_prompt_reply_pair_with_estimated_lengths() -> None:
    reqs, stats = read("sharegpt.json")
    # "What is the capital of France?" 30 ASCII chars → ceil(30/4) = 8; the 31-char reply → 8;
    # conversation c: 6 and 4 CJK characters → 6 and 4 tokens; conversation b has no human turn
    assert [(r.input_tokens, r.output_tokens, r.line) for r in reqs] == [(8, 8, 2), (6, 4, 8)]
    assert stats["dropped_by_reason"] == {"no_prompt_reply_pair": 1}


def test_sharegpt_bad_record_names_line_and_can_be_skipped() -> None:
    with pytest.raises(TraceError, match=r"sharegpt_bad\.json:3: missing 'conversations' list"):
        read("sharegpt_bad.json")
    reqs, stats = read("sharegpt_bad.json", skip_bad_rows=True)
    # "hi there" 8 chars → 2, "hello" 5 → 2, "x" → 1, "y" → 1
    assert [(r.input_tokens, r.output_tokens, r.line) for r in reqs] == [(2, 2, 2), (1, 1, 4)]
    assert stats["skipped_by_reason"] == {"bad_record": 1}


def test_sharegpt_jsonl() -> None:
    reqs, _ = read("sharegpt.jsonl")
    # 8 chars → 2, 4 → 1; 3 → 1, 9 → 3
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(2, 1), (1, 3)]


def test_sharegpt_array_larger_than_the_read_buffer_streams(tmp_path: Path) -> None:
    convs = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": "w" * (4 * (i % 50 + 1))},
                {"from": "gpt", "value": "ok"},
            ],
        }
        for i in range(3000)
    ]
    path = tmp_path / "big.json"
    path.write_text(
        "[\n" + ",\n".join(json.dumps(c) for c in convs) + "\n]\n"
    )  # ~330 kB: several 64 KiB refills
    reqs = list(open_trace(path))
    assert len(reqs) == 3000
    assert [r.input_tokens for r in reqs[:3]] == [1, 2, 3]  # 4·k chars → k tokens
    assert reqs[-1].line == 3001 and reqs[-1].input_tokens == 50  # element i is on line i + 2


def test_truncated_sharegpt_array_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    path.write_text(
        '[{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}, {"conv'
    )
    with pytest.raises(TraceError, match=r"cut\.json:1: invalid JSON"):
        list(open_trace(path, skip_bad_rows=True))  # an array cannot resynchronise, even when skipping


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        pytest.param("azure_header_only.csv", None, id="a header without rows → no requests"),
        pytest.param("sharegpt_empty.json", None, id="an empty ShareGPT array → no requests"),
    ],
)
def test_header_only_traces_are_empty(name: str, fmt: str | None) -> None:
    assert read(name, format=fmt)[0] == []


def test_empty_file_is_an_error() -> None:
    with pytest.raises(TraceError, match=r"empty\.csv: empty file"):
        open_trace(FIX / "empty.csv")
    with pytest.raises(TraceError, match=r"empty\.csv: empty file \(no header row\)"):
        list(open_trace(FIX / "empty.csv", format="azure"))


def test_forced_format_with_the_wrong_header_names_the_missing_columns() -> None:
    with pytest.raises(
        TraceError, match=r"azure_2023\.csv:1: not a burstgpt trace: header lacks Model, Request tokens"
    ):
        list(open_trace(FIX / "azure_2023.csv", format="burstgpt"))


def test_a_jsonl_trace_forced_as_csv_names_the_format_with_its_article_and_a_short_header(
    tmp_path: Path,
) -> None:
    """`--format azure` on a JSONL trace: "not a azure trace" and every field of the first JSON line as the
    header it "has" (helper walkthrough); now "an", and the first 200 characters of the line."""
    trace = tmp_path / "long.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 5, "hash_ids": list(range(200))}) + "\n")
    with pytest.raises(TraceError) as caught:
        list(open_trace(trace, format="azure"))
    message = str(caught.value)
    assert "long.jsonl:1: not an azure trace: header lacks" in message
    has = message.split("(has ", 1)[1]
    assert has.startswith('{"timestamp": 0') and has.endswith("…)") and len(has) == 202


def test_unknown_header_and_missing_file() -> None:
    with pytest.raises(TraceError, match=r"unrecognised header"):
        open_trace(FIX / "unknown.csv")
    with pytest.raises(TraceError, match=r"nope\.csv: no such file"):
        open_trace(FIX / "nope.csv")
    with pytest.raises(TraceError, match=r"unknown format 'parquet'"):
        open_trace(FIX / "azure_2023.csv", format="parquet")


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        pytest.param("", 1, id="empty text still costs one token"),
        pytest.param("abcd", 1, id="4 ASCII chars → 1"),
        pytest.param("abcde", 2, id="5 ASCII chars → ceil(5/4) = 2"),
        pytest.param("héllo", 2, id="4 ASCII chars and one é → ceil(4/4) + 1 = 2"),
        pytest.param("東京です", 4, id="4 CJK characters → 4"),
    ],
)
def test_token_estimate(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens


class CountingReads(io.StringIO):
    """A text file that counts the characters read from it."""

    chars_read = 0

    def read(self, size: int | None = -1) -> str:
        text = super().read(size)
        self.chars_read += len(text)
        return text


def test_invalid_sharegpt_element_is_reported_without_reading_the_rest() -> None:
    """A broken element mid-buffer is bad JSON at once: the reader used to read on to EOF first (the whole
    file in memory, gigabytes for the real ShareGPT dump) only to report the same error."""
    good = json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]})
    text = "[\n" + good + ',\n{"conversations": [}]},\n' + ",\n".join([good] * 40_000) + "\n]\n"
    fh = CountingReads(text)  # ~3.8 MB after the broken element on line 3
    out = list(_iter_json_array(fh, Path("bad.json")))
    assert isinstance(out[-1][1], RowError) and out[-1][0] == 3 and "invalid JSON" in str(out[-1][1])
    assert len(out) == 2 and fh.chars_read <= 2 * 65_536  # one buffer (and at most one refill), not 3.8 MB


def test_sharegpt_elements_cut_anywhere_by_the_buffer_still_parse() -> None:
    """Every cut point of an element (inside strings, escapes, numbers, literals) reads on, not an error."""
    element = json.dumps(
        {"id": 'a"b\\c', "conversations": [{"from": "human", "value": "h\u00e9llo \u2603 " * 3},
                                             {"from": "gpt", "value": "x", "n": [1, -2.5e-3, True, False, None]}]}
    )  # fmt: skip
    decoder = json.JSONDecoder()
    for cut in range(1, len(element)):
        with pytest.raises(json.JSONDecodeError) as info:
            decoder.raw_decode(element[:cut])
        assert _cut_by_buffer(info.value, cut), element[:cut]
    with pytest.raises(json.JSONDecodeError) as info:
        decoder.raw_decode('{"conversations": [}]}' + " " * 100)
    assert not _cut_by_buffer(info.value, 122)


@pytest.mark.parametrize("gap", ["\n  ", "  ", "\n\n\t"])
def test_a_read_ending_in_the_whitespace_between_elements_reads_on(tmp_path: Path, gap: str) -> None:
    """A pretty-printed array (ShareGPT_V3's layout) whose first read ends after "," with the next element's
    indentation in the next read: valid JSON, read on (it was "invalid JSON: Expecting value")."""
    from loadgen.readers_json import _CHUNK

    def doc(pad: int) -> str:
        first = {
            "id": "a",
            "conversations": [{"from": "human", "value": "x" * pad}, {"from": "gpt", "value": "ok"}],
        }
        second = {
            "id": "b",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        }
        return "[" + json.dumps(first) + "," + gap + json.dumps(second) + "]"

    comma = doc(0).index("," + gap + '{"id": "b"')
    text = doc(_CHUNK - 2 - comma)  # the first read ends one whitespace character after the comma
    assert text[_CHUNK - 2] == "," and text[_CHUNK - 1 :].startswith(gap)
    path = tmp_path / "pretty.json"
    path.write_text(text)
    assert [r.output_tokens for r in open_trace(path)] == [1, 1]


def test_token_counts_past_the_longest_context_are_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5}\n'
        '{"timestamp": 1, "input_length": 1e13, "output_length": 5}\n'
    )
    with pytest.raises(TraceError, match=r"huge\.jsonl:2: input_length must be ≤ 10,000,000 tokens"):
        list(open_trace(path))
    reqs = list(open_trace(path, skip_bad_rows=True))
    assert [r.input_tokens for r in reqs] == [10]


# --- deep nesting, pipes, long first lines, byte-order marks, zero lengths ---------------------------------

DEEP = "[" * 200_000  # json's decoder recurses per level: RecursionError, not JSONDecodeError
MOONCAKE_ROW = '{"timestamp": 0, "input_length": 10, "output_length": 5}'
SHAREGPT_ROW = json.dumps(
    {"conversations": [{"from": "human", "value": "abcd"}, {"from": "gpt", "value": "ef"}]}
)


@pytest.mark.parametrize(
    ("text", "format", "skippable"),
    [
        pytest.param(f"{MOONCAKE_ROW}\n{DEEP}\n{MOONCAKE_ROW}\n", None, True, id="Mooncake row"),
        pytest.param(f"{SHAREGPT_ROW}\n{DEEP}\n{SHAREGPT_ROW}\n", None, True, id="ShareGPT JSONL row"),
        pytest.param(f"[{SHAREGPT_ROW},\n{DEEP}]\n", None, False, id="ShareGPT array element"),
    ],
)
def test_too_deeply_nested_json_is_a_bad_row(
    tmp_path: Path, text: str, format: str | None, skippable: bool
) -> None:
    """A RecursionError traceback, even with --skip-bad-rows: now `bad_json` like any invalid JSON."""
    path = tmp_path / "deep.json"
    path.write_text(text)
    with pytest.raises(TraceError, match=r"deep\.json:2: invalid JSON: nested too deeply"):
        list(open_trace(path, format))
    if skippable:
        trace = open_trace(path, format, skip_bad_rows=True)
        assert len(list(trace)) == 2 and trace.stats.skipped == {"bad_json": 1}
    else:  # an array cannot resynchronise: an error even when skipping
        with pytest.raises(TraceError, match="nested too deeply"):
            list(open_trace(path, format, skip_bad_rows=True))


def test_a_first_json_line_too_deep_to_decode_is_not_a_format(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    path.write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}\n")  # 10 kB: whole within the detection read
    with pytest.raises(TraceError, match="neither Mooncake"):
        detect_format(path)


@contextlib.contextmanager
def piped(data: bytes) -> Iterator[str]:
    """`data` behind a pipe, named as bash names `<(cmd)`: /dev/fd/N. A thread writes it (more than a pipe
    holds) and gives up if the reader closes first."""
    r, w = os.pipe()

    def write() -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(w, view) :]
        except BrokenPipeError:
            pass
        finally:
            os.close(w)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield f"/dev/fd/{r}"
    finally:
        os.close(r)
        writer.join(10)


def test_a_pipe_is_read_whole_from_one_handle() -> None:
    """Detection read the start of a pipe and the reader opened it again, past what detection had taken:
    `<(head -5 azure.csv)` was an "empty file", a 200-row Mooncake pipe gave 158 rows with --skip-bad-rows."""
    rows = [json.dumps({"timestamp": 10 * i, "input_length": 600, "output_length": 5, "hash_ids": [i, i + 1]})
            for i in range(200)]  # fmt: skip
    with piped(("\n".join(rows) + "\n").encode()) as path:
        trace = open_trace(path, skip_bad_rows=True)
        assert trace.format == "mooncake" and len(list(trace)) == 200 and trace.stats.skipped_total == 0
    azure = (FIX / "azure_2023.csv").read_bytes().splitlines(keepends=True)[:5]
    with piped(b"".join(azure)) as path:
        assert len(list(open_trace(path))) == 4


def test_a_pipe_with_a_forced_format_and_a_second_read() -> None:
    """--format sharegpt on a pipe was an io.UnsupportedOperation traceback (the reader seeked back)."""
    with piped((FIX / "sharegpt.json").read_bytes()) as path:
        trace = open_trace(path, "sharegpt")
        assert [(r.input_tokens, r.output_tokens) for r in trace] == [(8, 8), (6, 4)]
        with pytest.raises(TraceError, match=r"not a regular file .* can be read only once"):
            list(trace)
    with piped((FIX / "sharegpt.jsonl").read_bytes()) as path:
        trace = open_trace(path, "sharegpt")
        assert trace.jsonl and len(list(trace)) == 2


def test_detection_reads_only_the_start_of_a_long_first_line(tmp_path: Path) -> None:
    """Detection read the whole first line: 370 MB of memory for a minified 186 MB ShareGPT array. A byte
    that is not UTF-8 1 MB in shows whether it read that far."""
    path = tmp_path / "minified.json"
    path.write_bytes(b"[" + b" " * (1 << 20) + b"\xff]\n")
    assert detect_format(path) == "sharegpt"
    # a JSONL conversation longer than the detection read is still recognised by its keys
    long_row = json.dumps({"id": "x", "conversations": [{"from": "human", "value": "w" * 200_000},
                                                        {"from": "gpt", "value": "ok"}]})  # fmt: skip
    path.write_text(long_row + "\n")
    assert detect_format(path) == "sharegpt-jsonl"
    assert [r.input_tokens for r in open_trace(path)] == [50_000]


@pytest.mark.parametrize(
    ("fixture", "fmt", "n"),
    [
        pytest.param("mooncake.jsonl", "mooncake", 3, id="Mooncake"),
        pytest.param("sharegpt.jsonl", "sharegpt", 2, id="ShareGPT JSONL"),
        pytest.param("sharegpt.json", "sharegpt", 2, id="ShareGPT array"),
        pytest.param("azure_2023.csv", "azure", 4, id="Azure CSV"),
    ],
)
def test_a_utf8_byte_order_mark_is_dropped(tmp_path: Path, fixture: str, fmt: str, n: int) -> None:
    """Detection accepted a BOM but the JSONL readers failed on it ("Unexpected UTF-8 BOM")."""
    path = tmp_path / fixture
    path.write_bytes(codecs.BOM_UTF8 + (FIX / fixture).read_bytes())
    trace = open_trace(path)
    assert trace.format == fmt and len(list(trace)) == n


def test_mooncake_rows_of_zero_length_are_dropped(tmp_path: Path) -> None:
    """Rejected as malformed (exit 2); the docs say every format drops and counts them, as Azure does."""
    path = tmp_path / "zero.jsonl"
    path.write_text(
        '{"timestamp": 500, "input_length": 0, "output_length": 5, "hash_ids": []}\n'
        '{"timestamp": 1000, "input_length": 600, "output_length": 0, "hash_ids": [1]}\n'
        '{"timestamp": 2500, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}\n'
    )
    trace = open_trace(path)
    reqs = list(trace)
    # the first (dropped but well-formed) row starts the clock, as in the CSV readers
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in reqs] == [(2.0, 600, 3)]
    assert trace.stats.dropped == {"zero_input_tokens": 1, "zero_output_tokens": 1}


def test_sharegpt_pairs_a_user_turn_with_the_models_answer(tmp_path: Path) -> None:
    """A second user turn is no reply: `[human, human, gpt]` pairs the second human turn with the gpt one
    (it took the second human turn as the output); a conversation opening with system or model turns
    pairs its first answered user turn; user turns never answered are dropped."""
    conversations = [
        [("human", "a" * 40), ("human", "b" * 8), ("gpt", "c" * 20)],
        [("system", "s" * 100), ("gpt", "g" * 12), ("user", "u" * 16), ("assistant", "r" * 24)],
        [("human", "only a question"), ("human", "and another")],
    ]
    path = tmp_path / "sg.json"
    path.write_text(
        json.dumps([{"conversations": [{"from": f, "value": v} for f, v in c]} for c in conversations])
    )
    trace = open_trace(path)
    reqs = list(trace)
    assert [(r.input_tokens, r.output_tokens) for r in reqs] == [(2, 5), (4, 6)]
    assert trace.stats.as_dict()["dropped_by_reason"] == {"no_prompt_reply_pair": 1}
