"""`truncate_prompt_tokens`: vLLM cuts each prompt to that many tokens before its context check, so a prompt over
the context with it is served. The gateway refused such prompts with its own context-length 400 (it never read
the field) and reserved KV for tokens the worker never holds; it now counts each prompt as vLLM will hold it.
(tests/real_vllm/test_openai_surface.py and test_embeddings_vllm.py check the same requests against vLLM.)"""

from __future__ import annotations

import collections.abc
import json
from typing import Any

import httpx
import pytest

from scheduler.routing.prefix import block_hashes
from server.config import validate_config
from server.errors import GatewayError
from server.footprint import ParsedRequest, parse_request, route_request, with_context
from tests.gateway.serverkit import GatewayThread

CONTEXT = 512
LIMITS = {"m": CONTEXT}
IDS = list(range(100, 700))  # 600 token ids: over the context


def _parse(kind: str, limits: dict[str, int] | None = None, **body: Any) -> ParsedRequest:
    return parse_request(
        kind, json.dumps({"model": "m", **body}).encode(), LIMITS if limits is None else limits
    )  # type: ignore[arg-type]


def test_a_completion_keeps_its_last_tokens_and_is_counted_by_them() -> None:
    parsed = _parse("completions", prompt=IDS, max_tokens=4, truncate_prompt_tokens=40)
    assert (parsed.prompt_tokens, parsed.prompt_exact, parsed.prompt_cap) == (40, True, 40)
    assert parsed.token_ids == IDS[-40:]  # vLLM's tokenizer truncates a generation's prompt on the left
    req = route_request(parsed, "r", 0.0, default_output_tokens=16, block_size=16)
    assert req.prefix_hashes == block_hashes(IDS[-40:], 16, 64, 0)  # affinity to the prefix the worker caches
    assert req.longest_prompt == 40


def test_truncation_side_right_keeps_the_first_tokens() -> None:
    parsed = _parse(
        "completions", prompt=IDS, max_tokens=4, truncate_prompt_tokens=40, truncation_side="right"
    )
    assert parsed.token_ids == IDS[:40]


@pytest.mark.parametrize(
    ("output", "cap"),
    [
        ({"max_tokens": 4}, CONTEXT - 1),
        ({}, CONTEXT - 1),
        ({"max_tokens": None}, CONTEXT - 1),
        ({"max_tokens": 0}, CONTEXT),
    ],
    ids=["a bound keeps one token back", "so does the default, 16", "and null, read as 16", "0 is no bound"],
)
def test_minus_one_is_the_context_less_what_vllm_keeps_for_the_output(
    output: dict[str, int], cap: int
) -> None:
    parsed = _parse("completions", prompt=IDS, truncate_prompt_tokens=-1, **output)
    assert parsed.prompt_tokens == cap


def test_each_prompt_of_a_batch_is_cut_on_its_own() -> None:
    parsed = _parse("completions", prompt=[IDS, [1, 2, 3], IDS[:45]], max_tokens=2, truncate_prompt_tokens=44)
    assert parsed.prompt_lens == (44, 3, 44)
    assert parsed.prompt_tokens == 91
    assert parsed.max_output_tokens == 6
    assert parsed.token_ids == IDS[-44:]


def test_a_short_prompt_is_untouched() -> None:
    parsed = _parse("completions", prompt=[1, 2, 3], max_tokens=4, truncate_prompt_tokens=40)
    assert (parsed.prompt_tokens, parsed.token_ids) == (3, [1, 2, 3])


def test_a_text_cut_on_the_left_loses_its_prefix_affinity_and_its_estimate() -> None:
    text = "hello world " * 400  # 4,800 characters: an estimate of 1,200 tokens, a floor of 600
    parsed = _parse("completions", prompt=text, max_tokens=4, truncate_prompt_tokens=100)
    assert (parsed.prompt_tokens, parsed.prompt_floor) == (100, 100)
    assert parsed.prompt_text is None  # where the kept tail begins is unknown without a tokenizer
    kept = _parse(
        "completions", prompt=text, max_tokens=4, truncate_prompt_tokens=100, truncation_side="right"
    )
    assert kept.prompt_text == text  # its first 100 tokens begin where the text begins


def test_a_chat_conversation_is_cut_whole_and_its_default_output_is_the_rest_of_the_context() -> None:
    messages = [{"role": "user", "content": "hello world " * 400}]
    parsed = _parse("chat", messages=messages, truncate_prompt_tokens=64)
    assert parsed.prompt_tokens == 64
    assert parsed.max_output_tokens == CONTEXT - 64  # vLLM's default: what the cut prompt leaves


def test_an_embedding_keeps_its_first_tokens_and_minus_one_is_the_whole_context() -> None:
    parsed = _parse("embeddings", input=IDS, truncate_prompt_tokens=-1)
    assert (parsed.prompt_tokens, parsed.max_output_tokens) == (CONTEXT, 0)
    assert parsed.token_ids == IDS[:CONTEXT]  # a pooling model's tokenizer truncates on the right
    batch = _parse("embeddings", input=[IDS, IDS[:10]], truncate_prompt_tokens=10, truncation_side="left")
    assert (batch.prompt_lens, batch.token_ids) == ((10, 10), IDS[-10:])


def test_a_responses_request_with_truncation_auto_is_cut_and_so_is_its_continuation() -> None:
    long_input = "hello world " * 400
    auto = _parse("responses", input=long_input, truncation="auto", max_output_tokens=8)
    assert (auto.prompt_tokens, auto.prompt_cap) == (CONTEXT - 1, CONTEXT - 1)
    assert _parse("responses", input=long_input, truncation=None).prompt_tokens == CONTEXT  # null is "auto"
    assert _parse("responses", input=long_input).prompt_tokens > CONTEXT  # "disabled" by default
    short = _parse("responses", input="hi", truncation="auto")
    assert short.prompt_tokens < 20
    with_context(short, 900, LIMITS)  # the stored conversation
    assert (short.prompt_tokens, short.max_output_tokens) == (CONTEXT, 1)


def test_without_a_known_context_minus_one_is_left_to_the_worker() -> None:
    assert _parse("completions", {}, prompt=IDS, truncate_prompt_tokens=-1).prompt_tokens == 600
    assert _parse("completions", {}, prompt=IDS, truncate_prompt_tokens=7).prompt_tokens == 7


@pytest.mark.parametrize(
    ("kind", "body", "message", "param"),
    [
        (
            "completions",
            {"prompt": [1], "truncate_prompt_tokens": 513},
            "truncate_prompt_tokens=513 cannot be greater than max_model_len = 512. "
            "Please request a smaller truncation size. (parameter=truncate_prompt_tokens, value=513)",
            "truncate_prompt_tokens",
        ),
        (
            "embeddings",
            {"input": [1], "truncate_prompt_tokens": 600},
            "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size.",
            None,
        ),
    ],
)
def test_a_cut_longer_than_the_context_is_refused_in_vllms_words(
    kind: str, body: dict[str, Any], message: str, param: str | None
) -> None:
    with pytest.raises(GatewayError) as err:
        _parse(kind, **body)
    assert (err.value.status, err.value.message, err.value.param) == (400, message, param)


@pytest.mark.parametrize(
    "body",
    [{"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": "x"}, {"truncation_side": "middle"}],
)
def test_a_malformed_truncation_is_a_400_naming_the_field(body: dict[str, Any]) -> None:
    with pytest.raises(GatewayError) as err:
        _parse("completions", prompt=[1], **body)
    assert err.value.status == 400 and err.value.param == next(iter(body))


@pytest.fixture(scope="module")
def gw() -> collections.abc.Iterator[GatewayThread]:
    sim = {"simulated": {"replicas": 1, "time_scale": 200.0}}
    cfg = validate_config(
        {
            "models": [
                {"name": "chat", "spec": "mistral-7b", "max_model_len": 64},
                {"name": "embed", "spec": "mistral-7b", "max_model_len": 64},
            ],
            "pools": [
                {"name": "chat-l4", "model": "chat", "gpu": "L4", "endpoints": sim},
                {"name": "embed-l4", "model": "embed", "gpu": "L4", "runner": "pooling", "endpoints": sim},
            ],
        },
        "test",
    )
    with GatewayThread(cfg) as thread:
        yield thread


@pytest.mark.parametrize(
    ("path", "body", "prompt_tokens"),
    [
        (
            "/v1/completions",
            {"model": "chat", "prompt": IDS[:100], "max_tokens": 4, "truncate_prompt_tokens": 20},
            20,
        ),
        (
            "/v1/completions",
            {"model": "chat", "prompt": "word " * 800, "max_tokens": 4, "truncate_prompt_tokens": -1},
            63,
        ),
        (
            "/v1/chat/completions",
            {
                "model": "chat",
                "messages": [{"role": "user", "content": "word " * 800}],
                "truncate_prompt_tokens": 30,
            },
            30,
        ),
        (
            "/v1/completions",
            {"model": "chat", "prompt": IDS[:100], "max_tokens": None, "truncate_prompt_tokens": -1},
            63,  # null is 16 to vLLM: one token is kept back for the output (a reviewer found it refused)
        ),
        ("/v1/embeddings", {"model": "embed", "input": IDS[:100], "truncate_prompt_tokens": -1}, 64),
        (
            "/v1/embeddings",
            {"model": "embed", "input": [IDS[:100], IDS[:5]], "truncate_prompt_tokens": 10},
            15,
        ),
    ],
)
def test_prompts_over_the_context_are_served_through_the_gateway(
    gw: GatewayThread, path: str, body: dict[str, Any], prompt_tokens: int
) -> None:
    """Each of these was the gateway's context-length 400; the simulated worker cuts as vLLM does."""
    resp = httpx.post(gw.url + path, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == prompt_tokens
