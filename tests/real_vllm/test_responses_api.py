"""OpenAI's Responses API (`client.responses.create`) on the real vLLM server, directly and through Mosaic:
the same answer shape, usage and stream events on both (`target`: "vllm" and "mosaic")."""

from __future__ import annotations

import openai
import pytest
from gateway_harness import Target

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


def test_responses_create_whole_and_streamed(target: Target) -> None:
    with target.openai() as client:
        r = client.responses.create(
            model=target.model,
            input="Hello there",
            instructions="be brief",
            max_output_tokens=5,
            temperature=0,
        )
        assert r.id.startswith("resp_") and r.object == "response" and r.model == target.model
        assert r.status in ("completed", "incomplete")
        assert r.usage is not None and 0 < r.usage.output_tokens <= 5 and r.usage.input_tokens > 0
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert r.output[0].type == "message"
        kinds: list[str] = []
        last = None
        for event in client.responses.create(
            model=target.model, input=[{"role": "user", "content": "Hi"}], max_output_tokens=4, stream=True
        ):
            kinds.append(event.type)
            last = event
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in TERMINAL and sum(k in TERMINAL for k in kinds) == 1
    assert "response.output_text.delta" in kinds
    assert last is not None and last.response.usage is not None  # type: ignore[union-attr]
    assert 0 < last.response.usage.output_tokens <= 4  # type: ignore[union-attr]


def test_responses_bad_input_is_a_400_on_both(target: Target) -> None:
    with target.openai() as client, pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=target.model, input=5)  # type: ignore[arg-type]
    assert err.value.status_code == 400


def test_a_stored_response_is_continued_and_retrieved(target: Target) -> None:
    """Only with a server started with VLLM_ENABLE_RESPONSES_API_STORE=1 (else vLLM stores nothing)."""
    with target.openai() as client:
        first = client.responses.create(model=target.model, input="Hello", max_output_tokens=3)
        try:
            client.responses.retrieve(first.id)
        except openai.NotFoundError:
            pytest.skip("the vLLM server does not store responses (VLLM_ENABLE_RESPONSES_API_STORE unset)")
        more = client.responses.create(
            model=target.model, input="more", max_output_tokens=2, previous_response_id=first.id
        )
        assert more.previous_response_id == first.id
        assert more.usage is not None and more.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
        assert client.responses.retrieve(more.id).id == more.id
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=target.model, input="x", previous_response_id="resp_nonexistent")


def test_an_unknown_response_id_and_an_output_past_the_context_are_vllms_errors_on_both(
    target: Target,
) -> None:
    """The gateway's own 404 for a response id it cannot place is vLLM's body, so a client sees one shape
    whichever answered; a `max_output_tokens` past `max_model_len` is vLLM's 400 naming it (the simulated
    worker used to clamp it)."""
    with target.openai() as client:
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve("resp_nonexistent")
        with pytest.raises(openai.BadRequestError) as too_long:
            client.responses.create(model=target.model, input="x", max_output_tokens=100000)
    assert missing.value.response.json() == {
        "error": {
            "message": "Response with id 'resp_nonexistent' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    err = too_long.value.response.json()["error"]
    assert err["param"] == "max_output_tokens"
    assert err["message"].startswith("max_output_tokens=100000 cannot be greater than max_model_len=")
