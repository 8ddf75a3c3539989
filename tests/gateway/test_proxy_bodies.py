"""Body rewrites (usage injection, P/D hops), the SSE relay filter, and request parsing / footprint."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.errors import Cause, GatewayError
from server.footprint import parse_request, route_request
from server.proxy import (
    PREFILL_KV_PARAMS,
    SseRelay,
    decode_body,
    prefill_body,
    splice_usage_option,
    usage_body,
)


def test_splice_adds_include_usage_without_reencoding() -> None:
    body = b'{"model":"m","stream":true,"vllm_xargs":{"a":1}}  \n'
    out = splice_usage_option(body)
    assert out == b'{"model":"m","stream":true,"vllm_xargs":{"a":1},"stream_options":{"include_usage":true}}'
    assert splice_usage_option(b"{}") == b'{"stream_options":{"include_usage":true}}'


def test_usage_body_merges_existing_stream_options() -> None:
    data = {"model": "m", "stream": True, "stream_options": {"include_obfuscation": False}}
    out = json.loads(usage_body(json.dumps(data).encode(), lambda: data, has_stream_options=True))
    assert out["stream_options"] == {"include_obfuscation": False, "include_usage": True}


@pytest.mark.parametrize("pd", [False, True], ids=["single", "pd decode hop"])
def test_continuous_usage_without_include_usage_is_not_turned_on_upstream(pd: bool) -> None:
    """vLLM sends per-chunk usage only with include_usage and continuous_usage_stats both on; a client
    that set only the second gets no usage from vLLM, so the gateway's forced include_usage must not
    switch per-chunk usage on (the relay strips only the final usage chunk)."""
    options = {"include_usage": False, "continuous_usage_stats": True}
    data = {"model": "m", "stream": True, "stream_options": options}
    body = (
        decode_body(data, {"do_remote_prefill": True}, stream_needs_usage=True)
        if pd
        else usage_body(json.dumps(data).encode(), lambda: data, has_stream_options=True)
    )
    assert json.loads(body)["stream_options"] == {"include_usage": True}


def test_prefill_body_follows_vllm_pd_protocol() -> None:
    data = {
        "model": "m",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 200,
        "min_tokens": 5,
        "top_k": 3,
    }
    out = json.loads(prefill_body(data))
    assert (
        out["kv_transfer_params"]
        == PREFILL_KV_PARAMS
        == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
    )
    assert (out["stream"], out["max_tokens"], out["max_completion_tokens"]) == (False, 1, 1)
    assert "stream_options" not in out and "min_tokens" not in out
    assert out["top_k"] == 3  # unknown fields pass through
    assert data["max_tokens"] == 200  # the original is not mutated


def test_decode_body_carries_prefill_params() -> None:
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_block_ids": [1],
        "remote_host": "h",
        "remote_port": 1,
    }
    out = json.loads(
        decode_body({"model": "m", "stream": True, "max_tokens": 9}, params, stream_needs_usage=True)
    )
    assert out["kv_transfer_params"] == params and out["max_tokens"] == 9
    assert out["stream_options"] == {"include_usage": True}


def _events(*payloads: object) -> bytes:
    return b"".join(
        b"data: " + (p if isinstance(p, bytes) else json.dumps(p).encode()) + b"\n\n" for p in payloads
    )


USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}


@pytest.mark.parametrize(
    "strip", [True, False], ids=["client did not ask → usage chunk stripped", "client asked → kept"]
)
def test_relay_strips_injected_usage_only_when_not_asked(strip: bool) -> None:
    relay = SseRelay(strip_usage=strip)
    stream = _events(CHUNK, CHUNK, USAGE, b"[DONE]")
    out = b"".join(relay.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + relay.flush()
    expected = _events(CHUNK, CHUNK, b"[DONE]") if strip else stream
    assert out == expected
    assert relay.usage == USAGE["usage"]


FP = "vllm-0.32.0-3d1d254b"
LAST = {"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]}


def _compact(*payloads: object) -> bytes:
    """Events as vLLM writes them (compact JSON: the relay reads a set finish_reason as `"finish_reason":"`)."""
    return b"".join(
        b"data: " + (p if isinstance(p, bytes) else json.dumps(p, separators=(",", ":")).encode()) + b"\n\n"
        for p in payloads
    )


def test_the_last_choice_events_carry_the_fingerprint_the_dropped_usage_event_had() -> None:
    """Asked for usage, vLLM 0.32 names itself on the usage-only event, not on the last choice events where
    it names itself for a client that asked for none: with the usage injected and dropped, every stream
    reached the client 44 bytes short of vLLM's. The relay learns the worker's fingerprint from a dropped
    usage event and puts it on the last choice events of the streams after (both of n = 2)."""
    second = {"choices": [{**LAST["choices"][0], "index": 1}]}
    upstream = [
        _compact(CHUNK),
        _compact(LAST),
        _compact(second),
        _compact({**USAGE, "system_fingerprint": FP}),
    ]
    first = SseRelay(strip_usage=True)
    assert b"".join(first.feed(c) for c in upstream) == _compact(CHUNK, LAST, second)  # not known yet
    assert first.seen_fingerprint == json.dumps(FP).encode()
    later = SseRelay(strip_usage=True, fingerprint=first.seen_fingerprint)
    named = [{**e, "system_fingerprint": FP} for e in (LAST, second)]
    assert b"".join(later.feed(c) for c in upstream) == _compact(CHUNK, *named)
    asked = SseRelay(strip_usage=False, fingerprint=first.seen_fingerprint)  # vLLM names itself on its usage
    assert b"".join(asked.feed(c) for c in upstream) == b"".join(upstream)


def test_relay_passes_chunks_through_untouched() -> None:
    relay = SseRelay(strip_usage=True)
    raw = b'data: {"choices":[{"delta":{"content":"a\\n\\nb"}}]}\n\n'  # escaped newlines stay inside JSON
    assert relay.feed(raw) is raw


def test_relay_holds_back_only_an_incomplete_event() -> None:
    relay = SseRelay(strip_usage=True)
    assert relay.feed(b"data: {}\n\ndata: {") == b"data: {}\n\n"
    assert relay.feed(b'"x": 1}\n\n') == b'data: {"x": 1}\n\n'


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=400), max_size=12), st.booleans())
def test_a_crlf_framed_stream_is_relayed_lf_framed_wherever_its_chunks_split(
    cuts: list[int], strip: bool
) -> None:
    """A worker framing SSE with CRLF (sse-starlette's default): the client gets the same stream LF-framed,
    usage read and stripped as in an LF stream, [DONE] seen, however the reads split it (a CR and its LF in
    two chunks too). Before, no event was ever complete (no `\\n\\n`): the whole stream was dropped."""
    lf = _events(CHUNK, CHUNK, USAGE, b"[DONE]")
    crlf = lf.replace(b"\n", b"\r\n")
    bounds = sorted({0, len(crlf), *(c % (len(crlf) + 1) for c in cuts)})
    relay = SseRelay(strip_usage=strip)
    out = b"".join(relay.feed(crlf[a:b]) for a, b in itertools.pairwise(bounds)) + relay.flush()
    assert out == (_events(CHUNK, CHUNK, b"[DONE]") if strip else lf)
    assert relay.usage == USAGE["usage"] and relay.done


@pytest.mark.parametrize(
    ("chunk", "done"),
    [
        (b"data: [DONE]\n\n", True),
        (b"data:[DONE]\n\n\n", True),
        (b'data: {"choices":[]}\n\ndata: [DONE]\n\n', True),
        (b'data: {"choices":[{"finish_reason":"stop","stop_reason":"[DONE]"}]}\n\n', False),
        (b'data: {"choices":[{"text":"x data: [DONE]"}]}\n\n', False),  # not an event of its own
        (b'data: {"choices":[{"text":"[DONE]"}]}\n\n', False),
        (b'data: {"choices":[{"text":"x\\ndata: [DONE]\\n"}]}\n\n', False),  # escaped newlines
        (b"data: [DONE]\n\ndata: late\n\n", True),
    ],
)
def test_done_is_the_event_not_the_text(chunk: bytes, done: bool) -> None:
    """`[DONE]` ends a stream only as the event `data: [DONE]`: a model stopped on the stop string `[DONE]`
    ends its last token event with it (found by the fault property test: the usage event and the real
    `[DONE]` after it were dropped)."""
    relay = SseRelay(strip_usage=False)
    relay.feed(chunk)
    assert relay.done is done


@pytest.mark.parametrize(
    "extra",
    [
        b'data: {"choices":[{"text":"late"}]}\n\n',  # an event after [DONE] in the same read
        b"data: [DONE]\n\n",  # a second [DONE]
        b"junk without a line break",  # bytes ending no event: held back, then sent at the end
    ],
)
def test_nothing_after_done_in_the_same_read_is_relayed(extra: bytes) -> None:
    """Found by the socket-level fault property test: `[DONE]` was looked for in a read's last 16 bytes only,
    so with more bytes behind it in the same read the stream went on (the extra relayed, and at the body's
    end an error event and a second [DONE] appended: worker_error, breaker told)."""
    relay = SseRelay(strip_usage=True)
    head = b'data: {"choices":[{"text":"a","finish_reason":"length"}]}\n\n'
    out = relay.feed(head + b"data: [DONE]\n\n" + extra) + relay.flush()
    assert out == head + b"data: [DONE]\n\n"
    assert relay.done and relay.finished
    assert relay.feed(b"data: more\n\n") == b"" and relay.flush() == b""


def test_an_lf_stream_with_a_cr_inside_an_event_keeps_it() -> None:
    """The first line break decides the framing: an LF stream is passed through as it came."""
    relay = SseRelay(strip_usage=True)
    raw = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert relay.feed(raw) is raw
    assert relay.feed(b"data: x\r\n\n") == b"data: x\r\n\n"


_USAGE_ONLY = b'data: {"choices":[],"usage":{"completion_tokens":3}}'
_PIECES = [
    b'data: {"choices":[{"text":"a"}]}',
    _USAGE_ONLY,
    b'data: {"choices":[{"text":"b"}],"usage":{"completion_tokens":1}}',  # usage with choices: kept
    b'data: {"note":"usage"}',  # mentions it in a value
    b'data: {"usage"',  # not JSON
    b'event: x\n{"usage":{"a":1}}',  # not a data line
    b"data: [DONE]",
    b"",
    b"\n",  # with a neighbour's blank line: a run of three newlines
    b"\n" + _USAGE_ONLY,
]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=8), st.booleans())
def test_usage_filter_finds_the_events_split_would(pieces: list[bytes], strip: bool) -> None:
    """Finding the events that mention usage from the mention keeps what splitting the chunk at every
    blank line keeps (the same events dropped, the same usage read), whatever the events around them."""
    chunk = b"\n\n".join(pieces) + b"\n\n"
    fast, split = SseRelay(strip_usage=strip), SseRelay(strip_usage=strip)
    assert fast._filter(chunk) == split._filter_split(chunk)
    assert fast.usage == split.usage


@pytest.mark.parametrize(
    ("kind", "body", "prompt", "exact", "max_out"),
    [
        pytest.param(
            "completions",
            {"model": "m", "prompt": "abcdefgh"},
            2,
            False,
            16,
            id="text prompt: ceil(8 chars / 4) = 2 tokens; completions default max_tokens 16",
        ),
        pytest.param(
            "completions",
            {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5},
            3,
            True,
            5,
            id="token ids: exact count",
        ),
        pytest.param(
            "completions",
            {"model": "m", "prompt": [[1, 2], [3, 4, 5]], "max_tokens": 4, "n": 2},
            5,
            True,
            16,
            id="two id prompts × n=2: 2+3 tokens, 4 × 2 × 2 = 16 output",
        ),
        pytest.param(
            "chat",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "abcdefghi"}],
                "max_completion_tokens": 7,
            },
            9,
            False,
            7,
            id="chat: ceil(9/4)=3 + 3 framing + 3 priming = 9; max_completion_tokens wins",
        ),
        pytest.param(
            "completions",
            {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2000, "max_completion_tokens": 1},
            3,
            True,
            2000,
            id="completions: vLLM ignores max_completion_tokens and generates max_tokens, so that is charged",
        ),
        pytest.param(
            "completions",
            {"model": "m", "prompt": [1, 2, 3], "max_completion_tokens": 5000},
            3,
            True,
            16,
            id="completions: max_completion_tokens alone leaves vLLM's default 16",
        ),
        pytest.param(
            "chat",
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "abcd"},
                            {"type": "image_url", "image_url": {"url": "x"}},
                        ],
                    }
                ],
            },
            7,
            False,
            8192 - 7,
            id="chat parts: text counted (1) + 6; no max_tokens → context − prompt",
        ),
    ],
)
def test_footprint(kind: str, body: dict[str, object], prompt: int, exact: bool, max_out: int) -> None:
    p = parse_request(kind, json.dumps(body).encode(), {"m": 8192})  # type: ignore[arg-type]
    assert (p.prompt_tokens, p.prompt_exact, p.max_output_tokens) == (prompt, exact, max_out)
    r = route_request(p, "rid", 0.0, default_output_tokens=256)
    assert r.predicted_output_tokens == min(max_out, 256 * p.sequences)


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        pytest.param("chat", b"{not json", None, id="malformed JSON → 400"),
        pytest.param("chat", b"[1, 2]", None, id="not an object → 400"),
        pytest.param(
            "chat",
            b'{"messages": [{"role": "user", "content": "x"}]}',
            "model",
            id="missing model → 400 param model",
        ),
        pytest.param("chat", b'{"model": "m", "messages": []}', "messages", id="empty messages → 400"),
        pytest.param(
            "completions",
            b'{"model": "m", "prompt": "x", "max_tokens": "lots"}',
            "max_tokens",
            id="max_tokens not an int → 400",
        ),
        pytest.param("chat", b'{"model": "m", "messages": [1]}', "messages.0", id="a message not an object"),
        pytest.param(
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": 5}]}',
            "messages.0.content",
            id="content neither text nor parts",
        ),
        pytest.param("completions", b'{"model": "m", "prompt": null}', "prompt", id="prompt null"),
        pytest.param("completions", b'{"model": "m", "prompt": [1.5, 2]}', "prompt", id="prompt of floats"),
    ],
)
def test_bad_bodies_are_400_with_param(kind: str, body: bytes, param: str | None) -> None:
    with pytest.raises(GatewayError) as err:
        parse_request(kind, body)  # type: ignore[arg-type]
    assert err.value.cause is Cause.BAD_REQUEST
    assert err.value.param == param


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        ("chat", b"[1, 2]", "Request body must be a JSON object"),
        (
            "chat",
            b'{"model": "m", "messages": [1]}',
            "Invalid value for 'messages.0': Input should be an object",
        ),
        (
            "completions",
            b'{"model": "m", "prompt": [1.5, 2]}',
            "Invalid value for 'prompt': expected one of str, list[int], list[str], list[list[int]]",
        ),
        *(
            (
                "completions",
                b'{"model": "m", "prompt": %b}' % prompt,
                "Invalid value for 'prompt': expected one of str, list[int], list[str], list[list[int]]; "
                "token ids are integers from 0 to 2^63 - 1",
            )
            # token ids past int64 (or negative): 400, not the router's OverflowError as a 500 worker_error
            for prompt in (b"[1, 9223372036854775808]", b"[[1, -1]]", b"[1, 1000000000000000000000000000000]")
        ),
    ],
)
def test_bad_bodies_name_what_is_wrong_not_pydantics_union_members(
    kind: str, body: bytes, message: str
) -> None:
    with pytest.raises(GatewayError) as err:
        parse_request(kind, body)  # type: ignore[arg-type]
    assert err.value.message == message


@pytest.mark.parametrize("model", [b"", b',"model":null', b',"model":""'], ids=["absent", "null", "empty"])
def test_a_request_naming_no_model_asks_for_the_only_one(model: bytes) -> None:
    """As vLLM serves its one model then; with several models (no default) it is a 400 naming `model`."""
    body = b'{"messages":[{"role":"user","content":"hi"}]%b}' % model
    assert parse_request("chat", body, {"m": 8192}, default_model="m").model == "m"
    with pytest.raises(GatewayError) as err:
        parse_request("chat", body, {"m": 8192, "n": 4096})
    assert (err.value.param, err.value.message) == (
        "model",
        "'model' is required: this gateway serves several models (GET /v1/models lists them)",
    )


def test_unknown_fields_are_ignored_by_the_parser() -> None:
    p = parse_request(
        "completions", b'{"model":"m","prompt":"x","guided_json":{"type":"object"},"ignore_eos":true}'
    )
    assert p.body.endswith(b'"ignore_eos":true}')  # forwarded bytes are the client's


def _chat_event(delta: dict[str, object], index: int = 0) -> bytes:
    choice = {"index": index, "delta": delta, "finish_reason": None}
    return b"data: " + json.dumps({"id": "c", "choices": [choice]}).encode() + b"\n\n"


def test_relay_counts_the_role_only_events_that_open_a_chat_stream() -> None:
    """n = 2: a role event per choice, then tokens. Counted at the start of a chunk only, and only until the
    caller's first token (`watch_roles`): role events open a stream."""
    role = {"role": "assistant", "content": ""}
    relay = SseRelay(strip_usage=False)
    first = _chat_event(role, 0) + _chat_event(role, 1)[:20]  # the second role event split across reads
    assert relay.feed(first) == _chat_event(role, 0) and relay.role_only_relayed == 1
    relay.feed(_chat_event(role, 1)[20:] + _chat_event({"content": "Hi"}, 0))
    assert relay.role_only_relayed == 2
    # a role with content is a token; an event after a token is not looked at
    relay = SseRelay(strip_usage=False)
    relay.feed(_chat_event({"role": "assistant", "content": "Hi"}) + _chat_event(role, 1))
    assert relay.role_only_relayed == 0
    relay = SseRelay(strip_usage=False)
    relay.watch_roles = False
    relay.feed(_chat_event(role))
    assert relay.role_only_relayed == 0


@pytest.mark.parametrize(
    ("options", "wants"),
    [
        pytest.param(None, False, id="no stream_options"),
        pytest.param({}, False, id="empty: vLLM 0.32's include_usage defaults to false"),
        pytest.param({"include_usage": True}, True, id="true"),
        pytest.param({"include_usage": "false"}, False, id="'false' is false to vLLM's pydantic, not truthy"),
        pytest.param({"include_usage": "no"}, False, id="'no' likewise"),
        pytest.param({"include_usage": 1}, True, id="1 is true"),
    ],
)
def test_client_wants_usage_reads_stream_options_as_vllm_does(options: object, wants: bool) -> None:
    body: dict[str, object] = {"model": "m", "prompt": "x", "stream": True}
    if options is not None:
        body["stream_options"] = options
    assert parse_request("completions", json.dumps(body).encode()).client_wants_usage is wants


def test_stream_options_of_the_wrong_type_are_refused() -> None:
    body = b'{"model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": "maybe"}}'
    with pytest.raises(GatewayError) as err:
        parse_request("completions", body)
    assert err.value.cause is Cause.BAD_REQUEST and err.value.param == "stream_options.include_usage"


@pytest.mark.parametrize(
    ("kind", "fields", "wants"),
    [
        pytest.param("chat", {}, False, id="chat, nothing asked"),
        pytest.param(
            "chat", {"prompt_logprobs": 0}, True, id="chat prompt_logprobs 0: the prompt tokens' own"
        ),
        pytest.param("chat", {"prompt_logprobs": None}, False, id="chat prompt_logprobs null"),
        pytest.param("chat", {"echo": True}, True, id="chat echo: top_logprobs defaults to 0 in vLLM"),
        pytest.param("chat", {"echo": True, "top_logprobs": None}, False, id="chat echo, top_logprobs null"),
        pytest.param("chat", {"echo": "false", "top_logprobs": 5}, False, id="chat echo 'false' is false"),
        pytest.param("chat", {"logprobs": True, "top_logprobs": 5}, False, id="chat output logprobs only"),
        pytest.param("completions", {"echo": True}, False, id="completions echo: logprobs default null"),
        pytest.param("completions", {"echo": True, "logprobs": 0}, True, id="completions echo + logprobs 0"),
        pytest.param("completions", {"logprobs": 5}, False, id="completions output logprobs only"),
        pytest.param("completions", {"prompt_logprobs": 2}, True, id="completions prompt_logprobs"),
    ],
)
def test_prompt_logprobs_are_read_as_vllm_reads_them(
    kind: str, fields: dict[str, object], wants: bool
) -> None:
    """vLLM 0.32's `to_sampling_params`: `prompt_logprobs` when set, else with `echo` the logprobs count
    (chat `top_logprobs`, default 0; completions `logprobs`, default null). Such a request never takes the
    P/D path: only a worker that runs the prompt has its logits."""
    base: dict[str, object] = (
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        if kind == "chat"
        else {"model": "m", "prompt": "x"}
    )
    p = parse_request(kind, json.dumps(base | fields).encode())  # type: ignore[arg-type]
    assert p.prompt_logprobs is wants
    assert route_request(p, "r", 0.0, 16).single_hop is wants


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        (
            "chat",
            b'{"model":"m","messages":[{"role":"user","content":"x"}],"prompt_logprobs":"a"}',
            "prompt_logprobs",
        ),
        ("chat", b'{"model":"m","messages":[{"role":"user","content":"x"}],"echo":"maybe"}', "echo"),
        ("completions", b'{"model":"m","prompt":"x","logprobs":[1]}', "logprobs"),
    ],
)
def test_prompt_logprob_fields_of_the_wrong_type_are_refused(kind: str, body: bytes, param: str) -> None:
    with pytest.raises(GatewayError) as err:
        parse_request(kind, body)  # type: ignore[arg-type]
    assert err.value.cause is Cause.BAD_REQUEST and err.value.param == param
