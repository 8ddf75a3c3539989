"""A pool's `runner: pooling`: its pods serve embeddings (`vllm serve … --runner pooling`, or a simulated
`mosaic worker --runner pooling`), the gateway's config says so (it answers `/v1/embeddings` for that model
only), the controller leaves the pool out of the Deployments it scales, and what the gateway would refuse
(a pooling pool that is not mixed, one model under both runners) fails the render."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm

from tests.chart.chartkit import (
    container_args,
    parse_mosaic_args,
    refusal,
    render,
    validated_deployment,
)

GENERATE = {"name": "chat", "model": "llama-3-8b", "gpu": "L4"}
EMBED = {
    "name": "embed",
    "model": "e5-mistral",
    "modelSource": "intfloat/e5-mistral-7b-instruct",
    "gpu": "L4",
}
# the embedding model is a catalog row's architecture under a name of its own
MODELS = {"models": [{"name": "llama-3-8b"}, {"name": "e5-mistral", "spec": "mistral-7b"}]}


def _values(*pools: dict[str, object]) -> dict[str, object]:
    return {"pools": list(pools), "config": MODELS}


def test_a_pooling_pool_runs_vllm_with_the_pooling_runner(chart: helm.Chart, tmp_path: Path) -> None:
    rendered = render(
        chart, _values(GENERATE, {**EMBED, "runner": "pooling", "extraArgs": ["--convert", "embed"]})
    )
    args = container_args(validated_deployment(rendered, "embed"))
    at = args.index("--runner")
    assert args[at : at + 2] == ["--runner", "pooling"]
    assert args[-2:] == ["--convert", "embed"]  # the operator's extra args come last, as for every pool
    assert "--runner" not in container_args(validated_deployment(rendered, "chat"))  # vLLM's own default
    entries = {e["name"]: e for e in rendered.config()["pools"]}
    assert entries["embed"]["runner"] == "pooling"
    assert "runner" not in entries["chat"]  # a generate pool's config is what it was before runners
    pools = {p.name: p for p in rendered.load_config(tmp_path).pools}
    assert (pools["embed"].runner, pools["chat"].runner) == ("pooling", "generate")


def test_a_simulated_pooling_pool_runs_a_pooling_worker(chart: helm.Chart) -> None:
    sim = {**EMBED, "simulated": True, "runner": "pooling"}
    args = container_args(validated_deployment(render(chart, _values(GENERATE, sim)), "embed"))
    params = parse_mosaic_args(args)  # Mosaic's own CLI parses what the chart wrote
    assert params["runner"] == "pooling"


def test_the_controller_does_not_scale_a_pooling_pool(chart: helm.Chart, tmp_path: Path) -> None:
    rendered = render(chart, _values(GENERATE, {**EMBED, "runner": "pooling"}))
    deployments = rendered.config()["autoscaler"]["kubernetes"]["deployments"]
    assert list(deployments) == ["chat"]
    rendered.load_config(tmp_path)  # the gateway accepts it (it refuses a pooling pool mapped to scale)


def test_what_the_gateway_refuses_fails_the_render(chart: helm.Chart) -> None:
    prefill = {**EMBED, "runner": "pooling", "role": "prefill"}
    decode = {**EMBED, "name": "embed-decode", "role": "decode"}
    message = refusal(chart, _values(prefill, decode))
    assert "embed has runner pooling and role prefill" in message
    both = refusal(chart, _values(GENERATE, {**GENERATE, "name": "chat-embed", "runner": "pooling"}))
    assert (
        'model "llama-3-8b" is served by chat with runner generate and by chat-embed with runner pooling'
        in both
    )
    assert "runner" in refusal(chart, _values({**EMBED, "runner": "auto"}))  # the schema's enum
