"""The simulated worker's /tokenize and /detokenize (`simulator.tokenize_api`): vLLM's request and answer
shapes, and counts that agree with what the worker charges the same text in its completions' usage."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from simulator.tokens import WORDS, render_chat, text_token_ids
from simulator.worker_app import WorkerConfig, create_worker_app

PROMPT = "The quick brown fox jumps over the lazy dog."  # 44 characters → 11 pieces of 4


@pytest.fixture(scope="module")
def client() -> Any:
    with TestClient(create_worker_app(WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1e6))) as c:
        yield c


def test_text_prompt_counts_what_completions_charge(client: TestClient) -> None:
    r = client.post("/tokenize", json={"model": "llama-3-8b", "prompt": PROMPT, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == 11 and body["tokens"] == text_token_ids(PROMPT)
    assert body["token_strs"] == [
        "The ",
        "quic",
        "k br",
        "own ",
        "fox ",
        "jump",
        "s ov",
        "er t",
        "he l",
        "azy ",
        "dog.",
    ]
    assert body["max_model_len"] == 8192
    usage = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]
    plain = client.post("/tokenize", json={"prompt": PROMPT}).json()  # no model: the served one
    assert plain["token_strs"] is None and plain["tokens"] == body["tokens"]


def test_chat_form_applies_the_template_as_chat_completions_do(client: TestClient) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    body = client.post("/tokenize", json={"messages": messages}).json()
    assert body["tokens"] == text_token_ids(render_chat(messages))
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    bare = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == text_token_ids(render_chat(messages, add_generation_prompt=False))
    assert bare["count"] < body["count"]  # without the assistant header
    # both forms given: the chat form, as vLLM picks it
    both = client.post("/tokenize", json={"messages": messages, "prompt": "x"}).json()
    assert both["tokens"] == body["tokens"]


def test_empty_prompt_is_no_token(client: TestClient) -> None:
    assert client.post("/tokenize", json={"prompt": ""}).json()["tokens"] == []


def test_detokenize_gives_pseudo_words_and_drops_ids_outside_the_vocabulary(client: TestClient) -> None:
    r = client.post("/detokenize", json={"tokens": [0, 1, len(WORDS) + 2, 128_256]})
    assert r.status_code == 200 and r.json() == {"prompt": f" {WORDS[0]} {WORDS[1]} {WORDS[2]}"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "type_", "param"),
    [
        ("/tokenize", {"model": "llama-3-8b"}, 400, "Bad Request", "body.prompt"),
        ("/tokenize", {"prompt": 5}, 400, "Bad Request", "body.prompt"),
        ("/tokenize", {"prompt": [1, 2]}, 400, "Bad Request", "body.prompt"),
        ("/tokenize", {"messages": 5}, 400, "Bad Request", "body.prompt"),
        ("/tokenize", {"messages": []}, 400, "BadRequestError", None),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model"),
        ("/detokenize", {"tokens": "abc"}, 400, "Bad Request", "body.tokens"),
        ("/detokenize", {}, 400, "Bad Request", "body.tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "NotFoundError", "model"),
        ("/detokenize", {"tokens": [3, -1]}, 400, "Bad Request", "body.tokens.1"),  # vLLM's ids are ≥ 0
        # the chat form's generation-prompt checks, as vLLM's chat completions make them (its before-validator,
        # then its renderer, continue_final_message with the default add_generation_prompt)
        (
            "/tokenize",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            400,
            "BadRequestError",
            None,
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
            400,
            "BadRequestError",
            None,
        ),
    ],
)
def test_errors_in_vllm_shapes(
    client: TestClient, path: str, body: dict[str, Any], status: int, type_: str, param: str | None
) -> None:
    r = client.post(path, json=body)
    err = r.json()["error"]
    assert (r.status_code, err["type"], err["param"], err["code"]) == (status, type_, param, status)


def test_union_errors_list_both_forms(client: TestClient) -> None:
    message = client.post("/tokenize", json={"prompt": 5}).json()["error"]["message"]
    assert message.splitlines()[0] == "2 validation errors:"
    assert (
        "'loc': 'body.prompt'" in message.splitlines()[1]
        and "'loc': 'body.messages'" in message.splitlines()[2]
    )


def test_body_must_be_json(client: TestClient) -> None:
    r = client.post("/tokenize", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"
    assert client.get("/tokenize").status_code == 405
