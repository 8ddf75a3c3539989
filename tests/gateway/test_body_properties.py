"""Any JSON a client sends in the fields the gateway reads either is refused with a 400 naming what is wrong
or is sized for the router without an error: never an exception that would reach the client as a 500. (A
reviewer found `input: [[40 messages], []]` on /v1/embeddings read as token ids, which crashed prefix hashing.)"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from server.errors import GatewayError
from server.footprint import parse_request, route_request

# JSON values leaning towards the shapes the fields take: token ids, texts, chat messages and lists of them
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"])},
    optional={
        "content": st.one_of(st.text(max_size=20), st.none(), st.just([{"type": "text", "text": "hi"}]))
    },
)
_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    _MESSAGE,
)
_JSON = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=40,
)
# the fields' own shapes, nested and mixed (a batch with an empty member, ids beside texts, score inputs)
_SCORE_INPUT = st.one_of(st.text(max_size=10), st.fixed_dictionaries({"content": _JSON}))
_VALUE = st.one_of(
    _JSON,
    _SCORE_INPUT,
    st.lists(_SCORE_INPUT, max_size=4),
    st.lists(_MESSAGE, max_size=4),
    st.lists(st.lists(_MESSAGE, max_size=3), max_size=3),
    st.lists(st.lists(st.integers(min_value=0, max_value=100), max_size=4), max_size=3),
    st.lists(st.one_of(st.text(max_size=5), st.integers(min_value=0, max_value=10)), max_size=4),
)
_FIELDS = {
    "embeddings": ("input", "messages"),
    "chat": ("messages",),
    "completions": ("prompt",),
    "responses": ("input",),
    "classify": ("input", "messages"),
    "score": ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2"),
    "rerank": ("query", "documents"),
}
# the other fields each kind reads (server.footprint's models), drawn as any JSON
_COMMON = (
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "kv_transfer_params",
    "prompt_logprobs",
    "echo",
    "truncate_prompt_tokens",
    "truncation_side",
)
_SCORING = (
    "model",
    "kv_transfer_params",
    "truncate_prompt_tokens",
    "truncation_side",
    "max_tokens_per_query",
    "max_tokens_per_doc",
    "padding",
)
_OTHERS = {
    "embeddings": ("model", "kv_transfer_params", "truncate_prompt_tokens", "truncation_side", "padding"),
    "classify": ("model", "kv_transfer_params", "truncate_prompt_tokens", "truncation_side", "padding"),
    "chat": (*_COMMON, "max_completion_tokens", "top_logprobs"),
    "completions": (*_COMMON, "logprobs"),
    "responses": (
        "model",
        "stream",
        "instructions",
        "max_output_tokens",
        "previous_response_id",
        "truncation",
    ),
    "score": _SCORING,
    "rerank": _SCORING,
}


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(sorted(_FIELDS)),
    st.data(),
)
def test_any_json_in_the_read_fields_is_a_400_or_a_routable_request(kind: str, data: st.DataObject) -> None:
    body: dict[str, Any] = {"model": "m"}
    for field in _FIELDS[kind]:
        if data.draw(st.booleans(), label=f"{field} present"):
            body[field] = data.draw(_VALUE, label=field)
    for field in _OTHERS[kind]:
        if data.draw(st.integers(min_value=0, max_value=3), label=f"{field} drawn") == 0:
            body[field] = data.draw(_JSON, label=field)
    try:
        parsed = parse_request(kind, json.dumps(body).encode(), {"m": 4096}, default_model="m")  # type: ignore[arg-type]
    except GatewayError as err:
        assert err.status == 400
        return
    req = route_request(parsed, "r", 0.0, default_output_tokens=64)
    assert req.prompt_tokens >= 0 and req.sequences >= 1 and req.longest_prompt >= 0
    assert all(isinstance(h, int) for h in req.prefix_hashes)
    if parsed.token_ids is not None:
        assert all(type(t) is int for t in parsed.token_ids)
