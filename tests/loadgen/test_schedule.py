"""Synthetic traces, replay scheduling (scale, window, cap, fixed rate) and exact-length prompts."""

from __future__ import annotations

import itertools
import json
import random
import re
import statistics
from collections.abc import Iterator

import pytest

from loadgen.formats import open_trace
from loadgen.prompts import BLOCK_TOKENS, TOKEN_ID_HIGH, TOKEN_ID_LOW, WORDS, PromptBuilder, build_body
from loadgen.schedule import ScheduledRequest, ScheduleError, ScheduleOptions, schedule
from loadgen.synthetic import SpecError, generate, parse_spec
from loadgen.trace import MAX_TOKENS, TraceError, TraceRequest


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param("synthetic:n=10", "rate=R", id="no rate → asks for rate"),
        pytest.param("synthetic:rate=5", "n=COUNT or duration", id="neither n nor duration → asks for one"),
        pytest.param("synthetic:rate=-1,n=5", "rate='-1' must be > 0", id="negative rate"),
        pytest.param(
            "synthetic:rate=1,n=5,arrival=weibull", "poisson, gamma or constant", id="unknown arrival process"
        ),
        pytest.param(
            "synthetic:rate=1,n=5,input=zipf:2",
            "unknown distribution 'zipf'",
            id="unknown length distribution",
        ),
        pytest.param("synthetic:rate=1,n=5,input=uniform:10", "uniform takes 2", id="uniform with one bound"),
        pytest.param("synthetic:rate=1,n=5,input=uniform:20:10", "LO ≤ HI", id="uniform bounds reversed"),
        pytest.param("synthetic:rate=1,n=5,colour=red", "unknown key(s) colour", id="unknown key"),
        pytest.param("synthetic:rate=1,n", "expected key=value", id="a bare word"),
        # a sweep found these hanging plan, simulate and replay (a trace that never ends)
        pytest.param(
            "synthetic:rate=5,duration=1e300",
            "rate × duration is 5e+300 requests; a synthetic trace has at most 100,000,000",
            id="a duration of 1e300 s",
        ),
        pytest.param(
            "synthetic:rate=1e6,n=100000000000",
            "n=100000000000 is 1e+11 requests; a synthetic trace has at most 100,000,000",
            id="n of 1e11",
        ),
    ],
)
def test_bad_synthetic_specs_name_the_key(spec: str, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec(spec)
    with pytest.raises(TraceError):
        open_trace(spec)


def test_constant_arrivals_are_evenly_spaced_and_lengths_fixed() -> None:
    reqs = list(generate(parse_spec("synthetic:rate=4,n=5,arrival=constant,input=100,output=7")))
    # gaps 1/4 s, the first before the first request (vLLM's spacing): the 5th at exactly 5 / 4 s
    assert [r.arrival_s for r in reqs] == [0.25, 0.5, 0.75, 1.0, 1.25]
    assert {(r.input_tokens, r.output_tokens) for r in reqs} == {(100, 7)}


def test_duration_stops_at_the_first_arrival_past_it() -> None:
    reqs = list(generate(parse_spec("synthetic:rate=10,duration=2,arrival=constant")))
    assert len(reqs) == 19 and reqs[-1].arrival_s == pytest.approx(1.9)  # 0.1 … 1.9 (2.0 is past it)
    capped = list(generate(parse_spec("synthetic:rate=10,n=50,duration=2,arrival=constant")))
    # n rescales nothing at constant gaps
    assert [r.arrival_s for r in capped] == pytest.approx([r.arrival_s for r in reqs], rel=1e-12)


def test_synthetic_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    spec = parse_spec("synthetic:rate=5,n=50,input=lognormal:300:0.8,output=exp:100")
    a, b, c = list(generate(spec, 1)), list(generate(spec, 1)), list(generate(spec, 2))
    assert a == b and a != c


@pytest.mark.parametrize(
    ("burstiness", "cv"),
    [
        pytest.param(1.0, 1.0, id="Poisson: inter-arrival CV 1"),
        pytest.param(0.25, 2.0, id="gamma k=0.25: CV = 1/sqrt(k) = 2 (burstier)"),
        pytest.param(4.0, 0.5, id="gamma k=4: CV = 1/sqrt(4) = 0.5 (smoother)"),
    ],
)
def test_gamma_arrivals_keep_the_rate_and_set_the_burstiness(burstiness: float, cv: float) -> None:
    spec = parse_spec(f"synthetic:rate=20,n=20001,arrival=gamma,burstiness={burstiness}")
    t = [r.arrival_s or 0.0 for r in generate(spec, 3)]
    gaps = [b - a for a, b in itertools.pairwise(t)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 20, rel=0.05)  # 20k samples: standard error ≤ 2/sqrt(20000) ≈ 1.4%
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.08)


def test_uniform_lengths_stay_in_bounds() -> None:
    reqs = list(generate(parse_spec("synthetic:rate=1,n=500,input=uniform:10:20,output=normal:50:100")))
    assert {r.input_tokens for r in reqs} == set(range(10, 21))
    assert min(r.output_tokens for r in reqs) == 1  # normal(50, 100) draws below 1 are clipped to 1


def trace(*arrivals: float | None) -> list[TraceRequest]:
    return [TraceRequest(a, 10 + i, 5, (), i + 2) for i, a in enumerate(arrivals)]


def send_times(reqs: list[TraceRequest], **kw: object) -> list[float]:
    return [s.send_at_s for s in schedule(reqs, ScheduleOptions(**kw))]  # type: ignore[arg-type]


def test_rate_scale_divides_trace_times() -> None:
    assert send_times(trace(0, 1, 3), rate_scale=2) == [0.0, 0.5, 1.5]


def test_window_selects_by_trace_time_then_shifts_to_zero() -> None:
    # window [1, 3): arrivals 1 and 2.5 → sent at 0 and 1.5; rate scale applies after the window
    assert send_times(trace(0, 1, 2.5, 3, 4), start_s=1, duration_s=2) == [0.0, 1.5]
    assert send_times(trace(0, 1, 2.5, 3, 4), start_s=1, duration_s=2, rate_scale=3) == [0.0, 0.5]


def test_window_stops_reading_the_trace_after_its_end() -> None:
    def endless() -> Iterator[TraceRequest]:
        for i in itertools.count():
            if i > 10:
                raise AssertionError("read past the window")
            yield TraceRequest(float(i), 1, 1)

    assert len(list(schedule(endless(), ScheduleOptions(duration_s=5)))) == 5


def test_max_requests_caps_and_indexes_from_zero() -> None:
    out = list(schedule(trace(0, 1, 2, 3), ScheduleOptions(max_requests=2)))
    assert [(s.index, s.input_tokens, s.trace_line) for s in out] == [(0, 10, 2), (1, 11, 3)]


def test_fixed_rate_retimes_in_order_and_keeps_lengths() -> None:
    out = list(schedule(trace(None, None, None), ScheduleOptions(rate=2, arrival="constant")))
    assert [(s.send_at_s, s.input_tokens) for s in out] == [(0.5, 10), (1.0, 11), (1.5, 12)]


def test_fixed_poisson_rate_is_seeded() -> None:
    reqs = trace(*[None] * 50)
    a = send_times(reqs, rate=10, seed=1)
    assert a == send_times(reqs, rate=10, seed=1) != send_times(reqs, rate=10, seed=2)
    assert a[0] > 0.0 and all(y >= x for x, y in itertools.pairwise(a))


@pytest.mark.parametrize("arrival", ["poisson", "gamma"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fixed_rate_spans_exactly_n_over_the_rate_whatever_the_seed(arrival: str, seed: int) -> None:
    """vLLM's get_request rescales the N gaps so that the last request goes at exactly N / R: otherwise the
    span, and every throughput over it, strays by the seed (30 requests at 100 req/s: 0.22–0.32 s)."""
    reqs = trace(*[None] * 30)
    a = send_times(reqs, rate=100, seed=seed, arrival=arrival, burstiness=0.5 if arrival == "gamma" else 1.0)
    assert a[-1] == pytest.approx(30 / 100, rel=1e-12) and a[0] > 0.0
    windowed = send_times(
        trace(*[float(i) for i in range(40)]), rate=100, seed=seed, start_s=5, max_requests=30
    )
    assert windowed[-1] == pytest.approx(30 / 100, rel=1e-12) and len(windowed) == 30


def test_synthetic_n_spans_exactly_n_over_the_rate() -> None:
    for seed in range(4):
        t = [
            r.arrival_s
            for r in generate(parse_spec("synthetic:rate=50,n=20,arrival=gamma,burstiness=0.5"), seed)
        ]
        assert t[-1] == pytest.approx(20 / 50, rel=1e-12) and 0 < t[0] < t[-1]


@pytest.mark.parametrize(
    ("opts", "timed", "message"),
    [
        pytest.param(
            ScheduleOptions(), False, "no arrival times: give --rate", id="length-only trace without --rate"
        ),
        pytest.param(ScheduleOptions(rate=1, rate_scale=2), True, "give one", id="--rate with --rate-scale"),
        pytest.param(ScheduleOptions(rate_scale=0), True, "rate scale must be > 0", id="zero rate scale"),
        pytest.param(
            ScheduleOptions(rate=1, duration_s=5),
            False,
            "select by arrival time",
            id="window on a trace without times",
        ),
        pytest.param(
            ScheduleOptions(max_requests=0), True, "--max-requests must be > 0", id="zero max requests"
        ),
    ],
)
def test_contradictory_options_are_refused(opts: ScheduleOptions, timed: bool, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        opts.validate(timed)


def req(index: int, n: int, hash_ids: tuple[int, ...] = ()) -> ScheduledRequest:
    return ScheduledRequest(index, 0.0, n, 4, hash_ids)


@pytest.mark.parametrize("n", [1, 511, 512, 513, 1100, 4096])
def test_token_id_prompts_have_exactly_the_input_length(n: int) -> None:
    ids = PromptBuilder(0).token_ids(req(0, n))
    assert len(ids) == n and all(TOKEN_ID_LOW <= t < TOKEN_ID_HIGH for t in ids)


def test_shared_hash_ids_give_shared_leading_tokens() -> None:
    """Mooncake rows [0, 1, 2] (1100 tokens) and [0, 3] (600 tokens) share exactly block 0 = 512 tokens."""
    p = PromptBuilder(7)
    a, b = p.token_ids(req(0, 1100, (0, 1, 2))), p.token_ids(req(1, 600, (0, 3)))
    assert a[:BLOCK_TOKENS] == b[:BLOCK_TOKENS]
    assert a[BLOCK_TOKENS : 2 * BLOCK_TOKENS] != b[BLOCK_TOKENS:]
    # block 3 is cut to 600 − 512 = 88 tokens: the start of the same block as a full request would send
    c = p.token_ids(req(2, 1024, (9, 3)))
    assert b[BLOCK_TOKENS:] == c[BLOCK_TOKENS : BLOCK_TOKENS + 88]


def test_same_block_across_runs_and_different_across_seeds() -> None:
    r = req(5, 700, (42, 43))
    assert PromptBuilder(1).token_ids(r) == PromptBuilder(1).token_ids(r) != PromptBuilder(2).token_ids(r)


@pytest.mark.parametrize(("a", "b"), [(0, 2**32), (-1, 2**32 - 1), (5, 2**40 + 5), (-3, 3)])
def test_seeds_that_differ_past_32_bits_give_other_prompts(a: int, b: int) -> None:
    """Before: seeds were cut to 32 bits, so seeds from large numbers (nanosecond timestamps) could send
    the same prompts as another run's, defeating "give each run its own --seed"."""
    r = req(5, 700, (42, 43))
    assert PromptBuilder(a).token_ids(r) != PromptBuilder(b).token_ids(r)


def test_seeds_within_32_bits_keep_their_prompts() -> None:
    """The fix changed no prompt of a seed in [0, 2**32): runs stay comparable with earlier reports."""
    r = req(0, 4)  # the ids these seeds drew before the change
    assert PromptBuilder(7).token_ids(r) == [9158, 9061, 5432, 13909]
    assert PromptBuilder(2**32 - 1).token_ids(r) == [23225, 11079, 6328, 20805]


def test_requests_without_hash_ids_share_nothing() -> None:
    p = PromptBuilder(0)
    a, b = p.token_ids(req(0, 64)), p.token_ids(req(1, 64))
    assert a[0] != b[0] or a[1] != b[1]
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 5  # 64 draws from 29k ids: ~0 coincide


def test_chat_text_has_one_word_per_token_and_shares_prefixes() -> None:
    p = PromptBuilder(0)
    a, b = p.text(req(0, 1100, (0, 1, 2))).split(" "), p.text(req(1, 600, (0, 3))).split(" ")
    assert len(a) == 1100 and len(b) == 600 and set(a) <= set(WORDS)
    assert a[:BLOCK_TOKENS] == b[:BLOCK_TOKENS] and a[BLOCK_TOKENS:600] != b[BLOCK_TOKENS:]


@pytest.mark.parametrize("n", [1, 7, 512, 3000])
def test_chat_text_is_four_characters_per_word(n: int) -> None:
    """4·n − 1 characters: a ceil(chars / 4) token estimate counts exactly n, like a real tokenizer."""
    text = PromptBuilder(0).text(req(0, n))
    assert len(text) == 4 * n - 1 and -(-len(text) // 4) == n and all(len(w) == 3 for w in text.split(" "))


def test_request_bodies_ask_for_exactly_the_output_length() -> None:
    r = ScheduledRequest(0, 0.0, 3, 17)
    comp = json.loads(build_body(r, "completions", "m", PromptBuilder(0)))
    assert len(comp["prompt"]) == 3 and comp["max_tokens"] == 17 and comp["ignore_eos"] is True
    assert (
        comp["stream"] is True and comp["stream_options"] == {"include_usage": True} and comp["model"] == "m"
    )
    chat = json.loads(build_body(r, "chat", "m", PromptBuilder(0)))
    assert chat["messages"][0]["role"] == "user" and len(chat["messages"][0]["content"].split(" ")) == 3
    assert "prompt" not in chat and chat["max_tokens"] == 17


@pytest.mark.parametrize(
    ("n", "documents", "query_words", "document_words"),
    [
        (100, 4, 16, [21, 21, 21, 21]),  # a 16-word query, the rest in four
        (102, 4, 16, [21, 22, 21, 22]),  # nearly equal
        (20, 4, 4, [4, 4, 4, 4]),  # a query of at most a fifth of the words
        (6, 4, 1, [1, 1, 1, 2]),
        (3, 4, 1, [1, 1]),  # fewer words than documents: one word each
        (1, 4, 1, [1]),  # a single word is its own document
    ],
)
def test_a_rerank_body_splits_the_input_into_a_query_and_documents(
    n: int, documents: int, query_words: int, document_words: list[int]
) -> None:
    text = PromptBuilder(0).text(req(0, n))
    body = json.loads(build_body(req(0, n), "rerank", "m", PromptBuilder(0), documents))
    assert set(body) == {"model", "query", "documents"}  # nothing is generated: no max_tokens, no stream
    assert len(body["query"].split(" ")) == query_words
    assert [len(d.split(" ")) for d in body["documents"]] == document_words
    if n > 1:  # every word sent once, in order
        assert " ".join([body["query"], *body["documents"]]) == text


def test_max_requests_stops_before_reading_the_next_row() -> None:
    """A bad row right after the cap is never read (the cap is checked before pulling another row)."""

    def rows() -> Iterator[TraceRequest]:
        yield TraceRequest(0.0, 10, 1)
        yield TraceRequest(1.0, 11, 1)
        raise AssertionError("read past --max-requests")

    out = list(schedule(rows(), ScheduleOptions(max_requests=2)))
    assert [s.input_tokens for s in out] == [10, 11]


def test_burstiness_without_a_rate_is_refused() -> None:
    with pytest.raises(ScheduleError, match="--burstiness shapes --rate"):
        ScheduleOptions(burstiness=0.2).validate(True)
    ScheduleOptions(rate=5, burstiness=0.2).validate(True)  # with --rate it shapes the arrivals


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("synthetic:rate=1,n=1,input=1e13", "at most 10,000,000 tokens"),
        ("synthetic:rate=1,n=1,input=uniform:1:1e12", "at most 10,000,000 tokens"),
        ("synthetic:rate=1,n=1,output=lognormal:2e7:0.5", "at most 10,000,000 tokens"),
    ],
)
def test_lengths_past_the_longest_context_are_refused(spec: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec(spec)


def test_wide_length_distributions_are_capped_not_overflowing() -> None:
    """lognormal with a huge sigma overflowed exp() (a traceback); samples are capped at MAX_TOKENS."""
    rng = random.Random(1)
    dist = parse_spec("synthetic:rate=1,n=1,input=lognormal:300:1000").input
    samples = [dist.sample(rng) for _ in range(200)]
    assert max(samples) == MAX_TOKENS and min(samples) >= 1


def test_a_rate_scale_that_sends_a_request_at_infinity_is_refused() -> None:
    """A rate scale that is positive and finite but so small that trace time / scale overflows scheduled the
    request at inf: the replay never ended."""
    out = schedule(iter(trace(0.0, 2.0)), ScheduleOptions(rate_scale=1e-320))
    assert next(out).send_at_s == 0.0
    with pytest.raises(ScheduleError, match="infinity"):
        next(out)
