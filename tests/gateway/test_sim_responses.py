"""The Responses API end to end on the default embedded fleet: the `openai` SDK's `client.responses.create`,
whole and streamed, through the gateway to simulated workers (which serve /v1/responses as vLLM 0.32)."""

from __future__ import annotations

import collections.abc

import openai
import pytest

from server.embedded import default_config
from tests.gateway.serverkit import GatewayThread

MODEL = "llama-3-8b"


@pytest.fixture(scope="module")
def client() -> collections.abc.Iterator[openai.OpenAI]:
    with (
        GatewayThread(default_config(time_scale=500.0)) as gw,
        openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30) as c,
    ):
        yield c


def test_whole_response_through_the_gateway(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Say hello.", instructions="be brief", max_output_tokens=5)
    assert r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 5 and r.usage.input_tokens > 0
    assert len(r.output_text.split()) == 5


def test_streamed_response_through_the_gateway(client: openai.OpenAI) -> None:
    with client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=7, stream=True) as stream:
        got = list(stream)
    types = [e.type for e in got]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert types.count("response.completed") == 1
    assert [e.sequence_number for e in got] == list(range(len(got)))
    deltas = [e.delta for e in got if e.type == "response.output_text.delta"]
    final = got[-1].response  # type: ignore[union-attr]
    assert len(deltas) == 7 and final.usage is not None and final.usage.output_tokens == 7
    assert "".join(deltas) == final.output_text
