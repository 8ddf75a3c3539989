"""Embedding models behind the gateway, without a fleet: how an embeddings body is sized for the router, what
the config accepts for `runner: pooling`, and the vLLM command line of a pooling pool."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.config import ConfigError, validate_config
from server.errors import GatewayError
from server.footprint import parse_request, route_request
from server.vllm_launcher import VllmLaunchSpec, build_command


def _parse(body: dict[str, Any]) -> Any:
    return parse_request("embeddings", json.dumps(body).encode(), None, None)


def test_token_id_inputs_are_counted_exactly_one_sequence_each_with_no_output() -> None:
    parsed = _parse({"model": "e5", "input": [[1, 2, 3], [4, 5]]})
    assert (parsed.prompt_tokens, parsed.prompt_exact, parsed.sequences) == (5, True, 2)
    assert (parsed.prompt_lens, parsed.max_output_tokens, parsed.stream) == ((3, 2), 0, False)
    req = route_request(parsed, "r1", 0.0, default_output_tokens=256)
    # an embedding ends at its prefill: nothing to hand to a decode worker, nothing predicted or reserved
    assert (req.single_hop, req.max_output_tokens, req.predicted_output_tokens) == (True, 0, 0)
    assert req.prompt_lens == (3, 2) and req.prompt_tokens_floor is None


def test_text_inputs_are_estimated_as_completion_prompts() -> None:
    one = _parse({"model": "e5", "input": "a" * 40})
    assert (one.prompt_tokens, one.prompt_exact, one.sequences, one.prompt_lens) == (10, False, 1, ())
    batch = _parse({"model": "e5", "input": ["a" * 8, "b" * 12, "猫"]})
    assert (batch.prompt_tokens, batch.sequences, batch.prompt_lens) == (6, 3, (2, 3, 1))
    single_ids = _parse({"model": "e5", "input": [7, 8, 9]})
    assert (single_ids.prompt_tokens, single_ids.sequences, single_ids.token_ids) == (3, 1, [7, 8, 9])


def test_chat_messages_are_counted_as_chat() -> None:
    parsed = _parse({"model": "e5", "messages": [{"role": "user", "content": "a" * 8}]})
    assert (parsed.prompt_tokens, parsed.sequences) == (2 + 3 + 3, 1)  # text, framing, reply priming


@pytest.mark.parametrize("field", ["input", "messages"])
def test_conversations_are_one_sequence_each_wherever_they_are(field: str) -> None:
    """vLLM takes a conversation, or a batch of them, in `messages` or in `input`: one vector each."""
    one = [{"role": "user", "content": "a" * 8}]
    two = [{"role": "system", "content": "b" * 4}, {"role": "user", "content": "c" * 12}]
    single = _parse({"model": "e5", field: one})
    assert (single.prompt_tokens, single.sequences, single.prompt_lens) == (8, 1, ())
    batch = _parse({"model": "e5", field: [one, two]})
    assert (batch.prompt_tokens, batch.sequences, batch.prompt_lens) == (8 + 13, 2, (8, 1 + 3 + 3 + 3 + 3))
    assert batch.prompt_text == "user\naaaaaaaa\n" and not batch.prompt_exact


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"model": "e5"}, "input", "'input' is required (or chat 'messages')"),
        ({"model": "e5", "input": 5}, "input", "Invalid value for 'input': expected one of str, list[int]"),
        ({"model": "e5", "input": [-1]}, "input", "token ids are integers from 0 to 2^63 - 1"),
        (
            {"model": "e5", "input": "x", "kv_transfer_params": {"do_remote_decode": True}},
            "kv_transfer_params",
            "clients may not send it",
        ),
    ],
)
def test_bad_embeddings_bodies_are_400_naming_the_field(
    body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(GatewayError) as caught:
        _parse(body)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert message in str(caught.value)


def test_an_empty_input_list_goes_to_the_worker_whose_400_names_it() -> None:
    """vLLM answers `input: []` "You must pass at least one prompt"; the gateway sizes it as one empty prompt
    and lets the worker say so in its own words (as it does for `input: ""`)."""
    parsed = _parse({"model": "e5", "input": []})
    assert (parsed.prompt_tokens, parsed.sequences) == (0, 1)


def _pools(*pools: dict[str, Any]) -> dict[str, Any]:
    return {"pools": [{"gpu": "L4", "endpoints": {"static": ["http://w:8000"]}, **p} for p in pools]}


def test_a_pooling_pool_must_be_mixed() -> None:
    with pytest.raises(
        ConfigError, match=r"pools\.0: .*a pooling pool serves whole requests: role must be mixed"
    ):
        validate_config(
            _pools(
                {"name": "e", "model": "e5", "role": "prefill", "runner": "pooling"},
                {"name": "d", "model": "e5", "role": "decode", "runner": "pooling"},
            ),
            "t",
        )


def test_a_model_is_served_by_one_runner() -> None:
    with pytest.raises(
        ConfigError, match=r"pools\.1\.runner: model 'm' is served by pool 'a' with runner generate"
    ):
        validate_config(
            _pools({"name": "a", "model": "m"}, {"name": "b", "model": "m", "runner": "pooling"}), "t"
        )
    with pytest.raises(ConfigError, match=r"pools\.0\.runner"):
        validate_config(_pools({"name": "a", "model": "m", "runner": "auto"}), "t")


def test_the_autoscaler_does_not_scale_a_pooling_pool() -> None:
    data = _pools(
        {"name": "chat", "model": "llama-3-8b"}, {"name": "embed", "model": "mistral-7b", "runner": "pooling"}
    )
    data["autoscaler"] = {"kubernetes": {"deployments": {"chat": "chat", "embed": "embed"}}}
    with pytest.raises(ConfigError, match=r"autoscaler\.kubernetes\.deployments\.embed: .*not scale"):
        validate_config(data, "t")
    data["autoscaler"] = {"kubernetes": {"domains": {"embed": {"zone-a": "embed-a"}}}}
    with pytest.raises(ConfigError, match=r"autoscaler\.kubernetes\.domains\.embed: .*not scale"):
        validate_config(data, "t")
    data["autoscaler"] = {"kubernetes": {"deployments": {"chat": "chat"}}}
    assert validate_config(data, "t").pools[1].runner == "pooling"


def test_a_pooling_pool_starts_vllm_with_the_pooling_runner() -> None:
    spec = VllmLaunchSpec(model="intfloat/e5-mistral-7b-instruct", port=8001, runner="pooling")
    cmd = build_command(spec)
    at = cmd.index("--runner")
    assert cmd[at : at + 2] == ["--runner", "pooling"]
    assert "--runner" not in build_command(VllmLaunchSpec(model="m", port=8001))  # vLLM's `auto` picks
    # the operator's own --runner (or its = form) wins and is not given twice
    mine = build_command(
        VllmLaunchSpec(model="m", port=8001, runner="pooling", extra_args=("--runner=pooling",))
    )
    assert [a for a in mine if a.startswith("--runner")] == ["--runner=pooling"]
    with pytest.raises(ValueError, match="runner: 'auto' is not one of generate, pooling"):
        VllmLaunchSpec(model="m", port=8001, runner="auto")


@pytest.mark.parametrize("field", ["input", "messages"])
def test_an_empty_conversation_in_a_batch_is_one_sequence_not_token_ids(field: str) -> None:
    """A second reviewer sent `[[40 messages], []]`: read as token-id prompts (the messages as ids), it
    crashed prefix hashing (a 500). It is a batch of two conversations; the worker refuses the empty one."""
    message = {"role": "user", "content": "a" * 8}
    parsed = _parse({"model": "e5", field: [[message] * 40, []]})
    assert (parsed.sequences, parsed.prompt_lens, parsed.prompt_exact) == (2, (40 * 5 + 3, 3), False)
    assert parsed.token_ids is None
    route_request(parsed, "r1", 0.0, default_output_tokens=256)  # hashes the text, not the messages
    empty_prompts = _parse({"model": "e5", field: [[], []]}) if field == "input" else None
    if empty_prompts is not None:  # two empty token-id prompts, for the worker to refuse
        assert (empty_prompts.sequences, empty_prompts.prompt_tokens) == (2, 0)


def test_the_runner_names_agree_across_floors() -> None:
    """Three packages name vLLM's runners (the config's Literal, the launcher's standard-library list, the
    simulated worker's), each unable to import the others' by the package floors: they must agree."""
    from typing import get_args

    from server.config import RunnerName
    from server.vllm_launcher import RUNNERS as LAUNCHED
    from simulator.worker_app import RUNNERS as SIMULATED

    assert get_args(RunnerName) == LAUNCHED == SIMULATED == ("generate", "pooling")
