"""The simulated worker names itself as vLLM 0.32 does: `system_fingerprint` on whole answers and on a stream's
last events (the usage event when asked for, else each choice's finishing event), `GET /version`, `/ping`."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import pytest

from simulator.engine import EngineConfig
from simulator.fingerprint import system_fingerprint
from simulator.worker_app import WorkerConfig

pytestmark = pytest.mark.anyio
FAST = WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=1000.0, seed=7)
FULL = re.compile(r"vllm-0\.32\.0-[0-9a-f]{8}")


def _events(raw: str) -> list[dict[str, Any]]:
    frames = raw.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]


def test_the_fingerprint_is_vllms_full_form_of_what_vllm_hashes() -> None:
    factors = {"max_model_len": 8192, "max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size": 16}
    one = system_fingerprint("llama-3-8b", 1, 1, factors)
    assert FULL.fullmatch(one)
    assert system_fingerprint("llama-3-8b", 1, 1, dict(factors)) == one  # a replica's is the same
    assert system_fingerprint("llama-3-8b", 1, 1, {**factors, "max_num_seqs": 64}) != one
    assert system_fingerprint("mistral-7b", 1, 1, factors) != one
    assert re.fullmatch(r"vllm-0\.32\.0-tp2-dp4-[0-9a-f]{8}", system_fingerprint("m", 2, 4, factors))


async def test_workers_differing_only_where_vllms_hash_does_not_look_share_it(asgi) -> None:
    """vLLM's config hash skips the device, memory utilisation, a block-count override and prefix caching;
    the seed and output-length law stand for weights, which it does not hash either. A scheduler knob counts."""
    same = [
        replace(FAST, gpu="A100-80GB", seed=8),
        replace(FAST, engine=EngineConfig(gpu_memory_utilization=0.8, enable_prefix_caching=True)),
        replace(FAST, engine=EngineConfig(num_gpu_blocks=4096, natural_output_mean=50.0)),
    ]
    async with asgi(FAST) as (_, rt):
        for cfg in same:
            async with asgi(cfg) as (_, other):
                assert other.fingerprint == rt.fingerprint, cfg
        async with asgi(replace(FAST, engine=EngineConfig(max_num_seqs=64))) as (_, other):
            assert other.fingerprint != rt.fingerprint


async def test_whole_answers_carry_the_workers_fingerprint(asgi) -> None:
    body = {"model": "llama-3-8b", "max_tokens": 3}
    async with asgi(FAST) as (client, rt):
        done = (await client.post("/v1/completions", json={**body, "prompt": "hello"})).json()
        chat = (await client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})).json()  # fmt: skip
    assert FULL.fullmatch(rt.fingerprint)
    assert done["system_fingerprint"] == chat["system_fingerprint"] == rt.fingerprint
    # where vLLM's response model has it: after choices, before usage
    assert list(chat)[list(chat).index("choices") + 1] == "system_fingerprint"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_a_stream_without_usage_names_itself_on_each_choices_last_event(asgi, chat: bool) -> None:
    """n = 2: both choices' finishing events carry it (vLLM stamps every chunk with a finish_reason), no other."""
    body: dict[str, Any] = {
        "model": "llama-3-8b",
        "max_tokens": 4,
        "n": 2,
        "stream": True,
        "ignore_eos": True,
    }
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello"}
    async with asgi(FAST) as (client, rt):
        resp = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    events = _events(resp.text)
    named = [e for e in events if "system_fingerprint" in e]
    assert [e["system_fingerprint"] for e in named] == [rt.fingerprint] * 2
    assert sorted(e["choices"][0]["index"] for e in named) == [0, 1]
    assert all(e["choices"][0]["finish_reason"] == "length" for e in named)
    assert all(e["choices"][0]["finish_reason"] is None for e in events if e not in named)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_a_stream_with_usage_names_itself_on_the_usage_event_only(asgi, chat: bool) -> None:
    body: dict[str, Any] = {"model": "llama-3-8b", "max_tokens": 3, "stream": True, "ignore_eos": True}
    body |= {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello"}
    async with asgi(FAST) as (client, rt):
        resp = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    events = _events(resp.text)
    assert [i for i, e in enumerate(events) if "system_fingerprint" in e] == [len(events) - 1]
    assert events[-1]["choices"] == [] and events[-1]["system_fingerprint"] == rt.fingerprint


async def test_an_echo_without_generation_names_itself_on_its_event(asgi) -> None:
    body = {"model": "llama-3-8b", "prompt": "hello", "max_tokens": 0, "echo": True, "stream": True}
    async with asgi(FAST) as (client, rt):
        events = _events((await client.post("/v1/completions", json=body)).text)
    assert [e.get("system_fingerprint") for e in events] == [rt.fingerprint]


async def test_version_and_ping_answer_as_vllms(asgi) -> None:
    async with asgi(FAST) as (client, _):
        version = await client.get("/version")
        pings = [(await client.request(m, "/ping")).status_code for m in ("GET", "POST")]
        await client.post("/sim/faults", json={"healthy": False})
        down = (await client.get("/ping")).status_code
    assert (version.status_code, version.json()) == (200, {"version": "0.32.0"})
    assert pings == [200, 200] and down == 503
