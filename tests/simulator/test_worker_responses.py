"""POST /v1/responses on the simulated worker, in vLLM 0.32's shapes (tests/gateway/fixtures/vllm_responses_*):
the whole answer's fields and usage, counted as the chat path counts the same messages; a stream's events in
vLLM's order and numbering; vLLM's errors for a malformed `input` and for a `previous_response_id`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from simulator.worker_app import WorkerConfig

pytestmark = pytest.mark.anyio
FAST = WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1000.0, seed=7)
FIXTURES = Path(__file__).parent.parent / "gateway" / "fixtures"
INPUT = [
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog."},
    {"role": "assistant", "content": [{"type": "output_text", "text": "And then?"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "It slept."}]},
]
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog."},
    {"role": "assistant", "content": [{"type": "text", "text": "And then?"}]},
    {"role": "user", "content": [{"type": "text", "text": "It slept."}]},
]


def events(sse: str) -> list[tuple[str, dict[str, Any]]]:
    """`event: <type>\\ndata: {json}` blocks; a block of another shape fails the test."""
    out = []
    for block in sse.strip().split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def test_whole_answer_counts_input_as_chat_and_is_cut_at_max_output_tokens(asgi) -> None:
    async with asgi(FAST) as (client, _):
        chat = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        r = await client.post(
            "/v1/responses",
            json={"input": INPUT, "instructions": "be brief", "max_output_tokens": 4, "store": True},
        )
    assert r.status_code == 200
    body = r.json()
    recorded = json.loads((FIXTURES / "vllm_responses_whole.json").read_text())
    assert list(body) == list(recorded)  # every field vLLM answers, in its order
    assert re.fullmatch(r"resp_[0-9a-f]{16}", body["id"])
    assert (body["object"], body["status"], body["instructions"]) == ("response", "incomplete", "be brief")
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    usage = body["usage"]
    assert list(usage) == list(recorded["usage"])
    assert usage["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == 4
    assert usage["total_tokens"] == usage["input_tokens"] + 4
    (item,) = body["output"]
    assert (item["type"], item["role"], item["status"]) == ("message", "assistant", "completed")
    assert re.fullmatch(r"msg_[0-9a-f]{16}", item["id"])
    (part,) = item["content"]
    assert part["type"] == "output_text" and len(part["text"].split()) == 4  # one pseudo-word per token


async def test_whole_answer_that_ends_by_itself_is_completed(asgi) -> None:
    async with asgi(FAST) as (client, _):
        r = await client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 8000})
    body = r.json()
    assert r.status_code == 200
    assert (body["status"], body["incomplete_details"]) == ("completed", None)
    assert 0 < body["usage"]["output_tokens"] < 8000


async def test_stream_events_in_vllms_order_one_delta_per_token(asgi) -> None:
    async with asgi(FAST) as (client, _):
        r = await client.post(
            "/v1/responses",
            json={
                "input": "be brief, please",
                "instructions": "be brief",
                "max_output_tokens": 6,
                "stream": True,
            },
        )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = events(r.text)
    types = [t for t, _ in got]
    assert [t for t, _ in events((FIXTURES / "vllm_responses_stream.sse").read_text())][:4] == types[:4]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 6,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert all(t == data["type"] for t, data in got)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    deltas = "".join(data["delta"] for t, data in got if t == "response.output_text.delta")
    final = got[-1][1]["response"]
    assert got[-4][1]["text"] == deltas == final["output"][0]["content"][0]["text"]
    assert final["usage"]["output_tokens"] == 6 and final["status"] == "incomplete"
    assert got[0][1]["response"]["status"] == "in_progress" and got[0][1]["response"]["usage"] is None


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": 5}, 400, "body.input"),
        ({"input": [{"role": "user", "content": 5}]}, 400, None),
        ({}, 400, "body.input"),
        ({"input": "x", "previous_response_id": "resp_0"}, 404, "response_id"),
    ],
)
async def test_malformed_input_and_previous_response_are_refused(
    asgi, body: dict[str, Any], status: int, param: str | None
) -> None:
    async with asgi(FAST) as (client, worker):
        r = await client.post("/v1/responses", json=body)
        assert worker.inflight == 0
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status
    assert err["type"] == ("Bad Request" if status == 400 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize(
    ("body", "message", "kind"),
    [
        pytest.param(
            {"input": "x", "background": True, "store": False},
            "background can only be used when `store` is true (parameter=background)",
            "BadRequestError",
            id="background without store: vLLM's before-validator",
        ),
        pytest.param(
            {"input": "x", "background": True},
            "This vLLM engine does not support `store=True` and therefore does not support the background mode.",
            "invalid_request_error",
            id="background with vLLM's store off, as the simulator's",
        ),
        pytest.param(
            {"input": "x", "prompt": {"id": "pmpt_1"}, "background": True, "store": False},
            "prompt template is not supported (parameter=prompt)",
            "BadRequestError",
            id="an OpenAI prompt template: vLLM's validator, before the background one",
        ),
        pytest.param(
            {"input": "x", "max_output_tokens": 100000},
            "max_output_tokens=100000 cannot be greater than max_model_len=8192. Please request fewer output "
            "tokens. (parameter=max_output_tokens, value=100000)",
            "BadRequestError",
            id="max_output_tokens past max_model_len: refused, not clamped",
        ),
    ],
)
async def test_what_vllm_refuses_without_a_store_or_past_the_context_is_refused(
    asgi, body: dict[str, Any], message: str, kind: str
) -> None:
    """vLLM 0.32 (store off, its default) answers these 400s; the simulator ran them as ordinary requests."""
    async with asgi(FAST) as (client, worker):
        r = await client.post("/v1/responses", json=body)
        assert worker.inflight == 0
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith(message) and err["type"] == kind
    param = next(p for p in ("prompt", "max_output_tokens", "background") if p in body)
    assert err["param"] == param


async def test_a_stored_response_is_vllms_404_to_get_and_cancel(asgi) -> None:
    """vLLM always routes GET /v1/responses/{id} and .../cancel; with its store off no id is known: its 404
    in OpenAI's shape (the simulator answered Starlette's bare {"detail": "Not Found"})."""
    async with asgi(FAST) as (client, _):
        got = await client.get("/v1/responses/resp_1")
        cancelled = await client.post("/v1/responses/resp_1/cancel")
    for r in (got, cancelled):
        assert r.status_code == 404
        assert r.json() == {
            "error": {
                "message": "Response with id 'resp_1' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }


async def test_an_empty_input_and_a_text_format_of_no_known_type_are_vllms_400s(asgi) -> None:
    """`input: []` is vLLM's chat renderer's refusal (the chat path's `messages: []` too), and `text.format` is
    OpenAI's union, each member named in vLLM's validation errors (tests/real_vllm/test_fidelity.py compares
    the whole bodies with the real server)."""
    async with asgi(FAST) as (client, worker):
        empty = await client.post("/v1/responses", json={"input": [], "max_output_tokens": 4})
        chat = await client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 4})
        bogus = await client.post(
            "/v1/responses", json={"input": "hi", "text": {"format": {"type": "bogus"}}}
        )
        assert worker.inflight == 0
    expected = {
        "message": "Cannot apply chat template to an empty conversation. Provide at least one message.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert empty.json() == chat.json() == {"error": expected}
    err = bogus.json()["error"]
    assert (bogus.status_code, err["param"]) == (400, "body.text.format.ResponseFormatText.type")
    assert err["message"].startswith("5 validation errors:\n  {'type': 'literal_error', 'loc': ")
    assert "'ctx': {'expected': \"'text'\"}" in err["message"]  # pydantic's context, as FastAPI keeps it


@pytest.mark.parametrize(
    ("text", "echoed"),
    [
        pytest.param(None, None, id="none: null"),
        pytest.param({"verbosity": "low"}, {"format": None, "verbosity": "low"}, id="verbosity alone"),
        pytest.param(
            {"format": {"schema": {"type": "object"}, "type": "json_schema", "name": "x"}},
            {
                "format": {
                    "name": "x",
                    "schema": {"type": "object"},
                    "type": "json_schema",
                    "description": None,
                    "strict": None,
                },
                "verbosity": None,
            },
            id="json_schema: vLLM's field order and defaults",
        ),
    ],
)
async def test_the_text_config_is_echoed_as_vllm_echoes_it(
    asgi, text: dict[str, Any] | None, echoed: dict[str, Any] | None
) -> None:
    body: dict[str, Any] = {"input": "hi", "max_output_tokens": 2}
    if text is not None:
        body["text"] = text
    async with asgi(FAST) as (client, _):
        r = await client.post("/v1/responses", json=body)
    assert r.status_code == 200
    assert r.json()["text"] == echoed
    assert list((r.json()["text"] or {}).get("format") or {}) == list((echoed or {}).get("format") or {})
