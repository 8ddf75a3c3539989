"""A pool's `lora`: the LoRA adapters its workers serve (vLLM's --enable-lora --lora-modules name=path ...,
--max-loras, --max-lora-rank, VLLM_ALLOW_RUNTIME_LORA_UPDATING; a simulated pool's `mosaic worker` takes the
same --lora-modules and --max-loras). The gateway finds the adapters on each worker's /v1/models, so the config
does not change. Without adapters (no `modules`, no `runtimeUpdating`) nothing of a pod template changes, and
the values vLLM would refuse at start, or that would make an adapter unreachable through the gateway, fail the
render; with LoRA on, extraArgs may not repeat the flags the chart writes from `lora`.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from server.commands.worker import lora_args
from tests.chart.chartkit import (
    RELEASE,
    container,
    container_args,
    env_map,
    parse_mosaic_line,
    render,
    validated_deployment,
    with_decode,
)

REAL = {"name": "l4", "model": "llama-3-8b", "gpu": "L4"}
SIM = {"name": "sim", "model": "llama-3-8b", "gpu": "L4", "simulated": True}
ADAPTERS = [
    {"name": "sql", "path": "/adapters/sql"},  # a directory on a volume
    {"name": "chat", "path": "my-org/llama3-chat-lora"},  # a Hugging Face repo id vLLM downloads
]
LORA = {"modules": ADAPTERS, "maxLoras": 2, "maxLoraRank": 64}
RUNTIME = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def _refused(chart: helm.Chart, values: dict[str, Any]) -> str:
    chart.validate_schema(values)  # each value is fine alone …
    with pytest.raises(helm.HelmRenderError) as caught:  # … the combination is not
        render(chart, values)
    return str(caught.value)


# ---- real vLLM pools ----


def test_a_real_lora_pool_runs_vllm_with_its_adapters(chart: helm.Chart) -> None:
    rendered = render(chart, {"pools": [{**REAL, "lora": LORA}]})
    dep = validated_deployment(rendered, "l4")
    assert container_args(dep) == [
        "llama-3-8b",
        "--served-model-name", "llama-3-8b",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--tensor-parallel-size", "1",
        "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256",
        "--block-size", "16",
        "--enable-prefix-caching",
        "--enable-lora",
        "--lora-modules", "sql=/adapters/sql", "chat=my-org/llama3-chat-lora",
        "--max-loras", "2",
        "--max-lora-rank", "64",
        "--shutdown-timeout", "100",
    ]  # fmt: skip
    assert RUNTIME not in env_map(container(dep))  # run-time loading only when asked for


def test_the_gateway_config_is_the_same_with_or_without_adapters(chart: helm.Chart) -> None:
    """The gateway reads each worker's adapters off its /v1/models: nothing about them goes in the config."""
    plain = render(chart, {"pools": [REAL, SIM]}).config_text()
    lora = {"modules": ADAPTERS, "runtimeUpdating": True}
    assert render(chart, {"pools": [{**REAL, "lora": lora}, {**SIM, "lora": lora}]}).config_text() == plain


def test_runtime_updating_alone_enables_lora_and_vllms_load_endpoint(chart: helm.Chart) -> None:
    rendered = render(chart, {"pools": [{**REAL, "lora": {"runtimeUpdating": True}}]})
    dep = validated_deployment(rendered, "l4")
    args = container_args(dep)
    assert args[args.index("--enable-prefix-caching") + 1 :] == ["--enable-lora", "--shutdown-timeout", "100"]
    env = env_map(container(dep))
    assert env[RUNTIME] == {"name": RUNTIME, "value": "True"}
    # before vllm.env and the pool's env, as the chart's other variables
    names = [e["name"] for e in container(dep)["env"]]
    assert names.index(RUNTIME) == len(names) - 1


def test_runtime_updating_with_static_adapters(chart: helm.Chart) -> None:
    values = {"pools": [{**REAL, "lora": {"modules": ADAPTERS[:1], "runtimeUpdating": True}}]}
    values["vllm"] = {"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]}
    dep = validated_deployment(render(chart, values), "l4")
    args = container_args(dep)
    assert args[args.index("--enable-lora") :] == [
        "--enable-lora", "--lora-modules", "sql=/adapters/sql", "--shutdown-timeout", "100",
    ]  # fmt: skip
    names = [e["name"] for e in container(dep)["env"]]
    assert names[-2:] == [RUNTIME, "VLLM_LOGGING_LEVEL"]


def test_adapters_on_a_volume_of_the_pools_extra_volumes(chart: helm.Chart) -> None:
    """The documented way to a local adapter directory: a volume and mount of the pool's own (here a PVC)."""
    pool = {
        **REAL,
        "lora": {"modules": ADAPTERS[:1]},
        "extraVolumes": [
            {"name": "adapters", "persistentVolumeClaim": {"claimName": "lora", "readOnly": True}}
        ],
        "extraVolumeMounts": [{"name": "adapters", "mountPath": "/adapters", "readOnly": True}],
    }
    dep = validated_deployment(render(chart, {"pools": [pool]}), "l4")
    assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in container(dep)["volumeMounts"]
    assert "sql=/adapters/sql" in container_args(dep)


def test_pool_defaults_lora_settings_apply_to_the_pools_with_adapters(chart: helm.Chart) -> None:
    values = {
        "poolDefaults": {"lora": {"maxLoras": 4, "maxLoraRank": 32}},
        "pools": [REAL, {**REAL, "name": "a100", "gpu": "A100-80GB", "lora": {"modules": ADAPTERS}}],
    }
    rendered = render(chart, values)
    assert not any("lora" in a for a in container_args(validated_deployment(rendered, "l4")))
    args = container_args(validated_deployment(rendered, "a100"))
    assert args[args.index("--max-loras") :][:4] == ["--max-loras", "4", "--max-lora-rank", "32"]


def test_a_pool_can_turn_off_what_pool_defaults_turn_on(chart: helm.Chart) -> None:
    values = {
        "poolDefaults": {"lora": {"modules": ADAPTERS, "runtimeUpdating": True}},
        "pools": [REAL, {**REAL, "name": "plain", "lora": {"modules": [], "runtimeUpdating": False}}],
    }
    rendered = render(chart, values)
    assert "--enable-lora" in container_args(validated_deployment(rendered, "l4"))
    plain = validated_deployment(rendered, "plain")
    assert "--enable-lora" not in container_args(plain) and RUNTIME not in env_map(container(plain))


def test_one_adapter_name_on_pools_of_one_model(chart: helm.Chart) -> None:
    """The same adapter served by two pools of the base model: the gateway routes it to either."""
    pools = [{**REAL, "lora": LORA}, {**REAL, "name": "a100", "gpu": "A100-80GB", "lora": LORA}]
    rendered = render(chart, {"pools": pools})
    l4, a100 = (
        container_args(validated_deployment(rendered, "l4")),
        container_args(validated_deployment(rendered, "a100")),
    )
    assert l4[l4.index("--enable-lora") :] == a100[a100.index("--enable-lora") :]
    assert "chat=my-org/llama3-chat-lora" in l4


# ---- simulated pools ----


def test_a_simulated_lora_pool_serves_the_adapters_as_mosaic_worker_reads_them(chart: helm.Chart) -> None:
    lora = {**LORA, "runtimeUpdating": True}
    rendered = render(chart, {"pools": [{**SIM, "lora": lora}, {**SIM, "name": "plain"}]})
    dep, plain = (
        validated_deployment(rendered, "sim"),
        container_args(validated_deployment(rendered, "plain")),
    )
    # the pool's arguments without adapters, then vLLM's LoRA flags (no rank: the simulator has no LoRA cost)
    assert container_args(dep) == [
        *plain,
        "--enable-lora",
        "--lora-modules", "sql=/adapters/sql", "chat=my-org/llama3-chat-lora",
        "--max-loras", "2",
    ]  # fmt: skip
    params, rest = parse_mosaic_line(container_args(dep))
    assert params["served_model_name"] == "llama-3-8b"
    read = lora_args(rest)
    assert [(m.name, m.path) for m in read.modules] == [(a["name"], a["path"]) for a in ADAPTERS]
    assert (read.max_loras, read.enable_lora, read.rest) == (2, True, ())
    assert RUNTIME not in env_map(container(dep))  # no /v1/load_lora_adapter in the simulator


def test_a_simulated_pool_without_max_loras_takes_the_workers_default(chart: helm.Chart) -> None:
    dep = validated_deployment(render(chart, {"pools": [{**SIM, "lora": {"modules": ADAPTERS[:1]}}]}), "sim")
    read = lora_args(parse_mosaic_line(container_args(dep))[1])
    assert ([m.name for m in read.modules], read.max_loras) == (["sql"], 1)


# ---- no adapters: as before ----


@pytest.mark.parametrize(
    "lora",
    [
        {},
        {"modules": [], "runtimeUpdating": False, "maxLoras": None, "maxLoraRank": None},
    ],
    ids=["empty", "every key off"],
)
@pytest.mark.parametrize(
    "pool",
    [REAL, {**REAL, "role": "prefill", "dp": 2}, SIM],
    ids=["real", "P/D dp 2", "sim"],
)
def test_no_adapters_render_the_pod_templates_as_before(
    chart: helm.Chart, pool: dict[str, Any], lora: dict[str, Any]
) -> None:
    """A pod-template change restarts every GPU pod (a model reload each): a pool without adapters, `lora`
    off or absent, and `poolDefaults.lora` settings for the pools that have adapters, render byte-identical to
    no `lora` at all."""

    def pools_yaml(values: dict[str, Any]) -> str:
        out = chart.render(values, name=RELEASE, namespace="llm", is_install=True)
        return out["mosaic/templates/pools.yaml"]

    before = pools_yaml({"pools": with_decode(pool)})
    assert "lora" not in before.lower()
    assert pools_yaml({"pools": with_decode({**pool, "lora": lora})}) == before
    defaults = {"lora": {"maxLoras": 4, "maxLoraRank": 64}}
    assert pools_yaml({"poolDefaults": defaults, "pools": with_decode({**pool, "lora": lora})}) == before


# ---- values the schema refuses ----


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        pytest.param(
            {"modules": [{"name": "", "path": "/a"}]},
            "at '/pools/0/lora/modules/0/name': minLength: got 0, want 1",
            id="an empty name",
        ),
        pytest.param(
            {"modules": [{"name": "a=b", "path": "/a"}]},
            "at '/pools/0/lora/modules/0/name': 'a=b' does not match pattern",
            id="= in a name (vLLM splits name=path at the first =)",
        ),
        pytest.param(
            {"modules": [{"name": "a,b", "path": "/a"}]},
            "at '/pools/0/lora/modules/0/name': 'a,b' does not match pattern",
            id=", in a name (vLLM reads the item as JSON)",
        ),
        pytest.param(
            {"modules": [{"name": "-a", "path": "/a"}]},
            "at '/pools/0/lora/modules/0/name': '-a' does not match pattern",
            id="a leading - (vLLM's parser takes it for a flag)",
        ),
        pytest.param(
            {"modules": [{"name": "sql ", "path": "/a"}]},
            "at '/pools/0/lora/modules/0/name': 'sql ' does not match pattern",
            id="a blank in a name",
        ),
        pytest.param(
            {"modules": [{"name": "a", "path": ""}]},
            "at '/pools/0/lora/modules/0/path': minLength: got 0, want 1",
            id="an empty path",
        ),
        pytest.param(
            {"modules": [{"name": "a", "path": "/a,b"}]},
            "at '/pools/0/lora/modules/0/path': '/a,b' does not match pattern",
            id=", in a path",
        ),
        pytest.param(
            {"modules": [{"name": "a"}]},
            "at '/pools/0/lora/modules/0': missing property 'path'",
            id="no path",
        ),
        pytest.param(
            {"modules": ["a=/b"]},
            "at '/pools/0/lora/modules/0': got string, want object",
            id="vLLM's name=path string",
        ),
        pytest.param({"maxLoras": 0}, "at '/pools/0/lora/maxLoras': minimum: got 0, want 1", id="maxLoras 0"),
        pytest.param(
            {"maxLoraRank": 24},
            "at '/pools/0/lora/maxLoraRank': value must be one of <nil>, 1, 8, 16, 32, 64, 128, 256, 320, 512",
            id="a rank vLLM does not take",
        ),
        pytest.param(
            {"runtimeUpdating": "True"},
            "at '/pools/0/lora/runtimeUpdating': got string, want boolean",
            id="runtimeUpdating as the env var's string",
        ),
        pytest.param(
            {"adapters": []}, "at '/pools/0/lora': additional properties 'adapters' not allowed", id="a typo"
        ),
    ],
)
def test_the_schema_refuses_lora_values_vllm_would_refuse(
    chart: helm.Chart, lora: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema({"pools": [{**REAL, "lora": lora}]})
    assert message in str(caught.value)


# ---- values the render refuses ----


def test_an_adapter_name_twice_in_a_pool_is_refused(chart: helm.Chart) -> None:
    lora = {"modules": [*ADAPTERS, {"name": "sql", "path": "/other/sql"}]}
    message = _refused(chart, {"pools": [{**SIM, "lora": lora}]})
    assert (
        'pools[0] (sim): lora.modules[2] names adapter "sql", as lora.modules[0] does; vLLM refuses an adapter '
        "name twice at start (\"The lora adapter 'sql' has already been loaded\")"
    ) in message


def test_an_adapter_named_as_the_pools_model_is_refused(chart: helm.Chart) -> None:
    lora = {"modules": [{"name": "llama-3-8b", "path": "/adapters/x"}]}
    message = _refused(chart, {"pools": [{**REAL, "lora": lora}]})
    assert (
        "pools[0] (l4): lora.modules[0] names adapter \"llama-3-8b\", the pool's model (vLLM's "
        "--served-model-name); vLLM refuses it at start (\"The lora adapter 'llama-3-8b' conflicts with a "
        'served base model")'
    ) in message


def test_an_adapter_named_as_another_pools_model_is_refused(chart: helm.Chart) -> None:
    """The gateway routes a pool's model name to that model: the adapter could never be reached."""
    pools = [
        {**REAL, "lora": {"modules": [{"name": "qwen2.5-7b", "path": "/adapters/q"}]}},
        {"name": "qwen", "model": "qwen2.5-7b", "gpu": "L4"},
    ]
    message = _refused(chart, {"pools": pools})
    assert (
        'pools[0] (l4): lora.modules[0] names adapter "qwen2.5-7b", the model of pools[1] (qwen); the gateway '
        "routes that name to the model, never to this adapter"
    ) in message


def test_one_adapter_name_on_pools_of_two_models_is_refused(chart: helm.Chart) -> None:
    pools = [
        {**REAL, "lora": {"modules": ADAPTERS}},
        {"name": "qwen", "model": "qwen2.5-7b", "gpu": "L4", "lora": {"modules": [ADAPTERS[0]]}},
    ]
    message = _refused(chart, {"pools": pools})
    assert (
        'pools[1] (qwen): lora.modules[0] names adapter "sql", as pools[0] (l4) does for model "llama-3-8b"; the '
        "gateway maps an adapter name to one base model"
    ) in message


@pytest.mark.parametrize("key", ["maxLoras", "maxLoraRank"])
def test_a_pools_lora_settings_without_adapters_are_refused(chart: helm.Chart, key: str) -> None:
    message = _refused(chart, {"pools": [{**REAL, "lora": {key: 16}}]})
    assert (
        f"pools[0] (l4): lora.{key} is set but the pool has no lora.modules and no lora.runtimeUpdating, so "
        "LoRA stays off"
    ) in message


@pytest.mark.parametrize("where", ["pool", "vllm"])
def test_runtime_updating_and_its_env_var_set_by_hand_are_refused(chart: helm.Chart, where: str) -> None:
    env = [{"name": RUNTIME, "value": "False"}]
    pool: dict[str, Any] = {**REAL, "lora": {"runtimeUpdating": True}}
    values: dict[str, Any] = {"pools": [pool]}
    if where == "pool":
        pool["env"] = env
    else:
        values["vllm"] = {"env": env}
    path = "pools[0].env" if where == "pool" else "vllm.env"
    assert f"pools[0] (l4): {path} sets {RUNTIME}, which the chart writes from lora.runtimeUpdating" in (
        _refused(chart, values)
    )
    # without runtimeUpdating, the variable set by hand is the pool's own business (the way before `lora`)
    pool["lora"] = {"modules": ADAPTERS}
    render(chart, values)


def test_runtime_updating_with_several_api_servers_is_refused(chart: helm.Chart) -> None:
    """vLLM 0.32 runs one API server per data-parallel engine by default, and then refuses run-time LoRA
    updating at start (VLLM_ALLOW_RUNTIME_LORA_UPDATING cannot be used with api_server_count > 1)."""
    pool = {**REAL, "dp": 2, "lora": {"runtimeUpdating": True}}
    message = _refused(chart, {"pools": [pool]})
    assert (
        "pools[0] (l4): lora.runtimeUpdating with dp 2: vLLM 0.32 starts one API server per engine and refuses "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING with more than one at start; add `--api-server-count 1` to "
        "pools[0].extraArgs"
    ) in message
    assert "pools[0] (l4)" in _refused(chart, {"pools": [{**pool, "extraArgs": ["--api-server-count", "2"]}]})
    for one in (["--api-server-count", "1"], ["-asc=1"], ["--api_server_count=1"], ["--api-s", "1"]):
        dep = validated_deployment(render(chart, {"pools": [{**pool, "extraArgs": one}]}), "l4")
        assert container_args(dep)[-len(one) :] == one
    render(chart, {"pools": [{**pool, "dp": 1}]})
    render(chart, {"pools": [{**pool, "lora": {"modules": ADAPTERS}}]})  # static adapters need no API


# ---- the flags the chart writes from lora, again in extraArgs ----

WRITES = "which the chart writes from pools[0].lora.{} (vLLM keeps the last of a repeated flag); remove it and set "
REPEATED = [
    pytest.param(
        ["--enable-lora"],
        "--enable-lora",
        "--enable-lora",
        "which the chart writes for pools[0].lora (its modules or runtimeUpdating); remove it",
        id="on",
    ),
    pytest.param(
        ["--no-enable-lora"],
        "--no-enable-lora",
        "--no-enable-lora",
        "which turns off the LoRA the chart turns on for pools[0].lora (vLLM then refuses its adapters at start)",
        id="off",
    ),
    pytest.param(
        ["--enable-lor"], "--enable-lor", "--enable-lora", "which the chart writes for", id="abbreviated"
    ),
    pytest.param(
        ["--no-enable-lor"], "--no-enable-lor", "--no-enable-lora", "which turns off", id="off, abbr."
    ),
    pytest.param(
        ["--lora-modules", "x=/x"], "--lora-modules", "--lora-modules", WRITES.format("modules"), id="modules"
    ),
    pytest.param(
        ["--lora_modules=x=/x"], "--lora_modules=x=/x", "--lora-modules", WRITES.format("modules"), id="_ ="
    ),
    pytest.param(
        ["--lora-m", "x=/x"], "--lora-m", "--lora-modules", WRITES.format("modules"), id="shortest prefix"
    ),
    pytest.param(
        ["--lora-modules.name", "x", "--lora-modules.path", "/x"],
        "--lora-modules.name",
        "--lora-modules",
        WRITES.format("modules"),
        id="vLLM's dotted JSON form",
    ),
    pytest.param(
        ["--max-loras", "4"], "--max-loras", "--max-loras", WRITES.format("maxLoras"), id="max loras"
    ),
    pytest.param(
        ["--max_loras=4"], "--max_loras=4", "--max-loras", WRITES.format("maxLoras"), id="max loras _ ="
    ),
    pytest.param(
        ["--max-lora-rank", "8"],
        "--max-lora-rank",
        "--max-lora-rank",
        WRITES.format("maxLoraRank"),
        id="rank",
    ),
    pytest.param(
        ["--max-lora-r=8"],
        "--max-lora-r=8",
        "--max-lora-rank",
        WRITES.format("maxLoraRank"),
        id="rank prefix",
    ),
]


@pytest.mark.parametrize(("extra", "arg", "flag", "why"), REPEATED)
@pytest.mark.parametrize("simulated", [False, True], ids=["real", "sim"])
def test_a_lora_pools_extra_args_may_not_repeat_the_lora_flags(
    chart: helm.Chart, extra: list[str], arg: str, flag: str, why: str, simulated: bool
) -> None:
    """vLLM keeps the last of a repeated flag (a later --lora-modules list replaces an earlier one), so the
    pool's extraArgs would override its `lora`; --no-enable-lora would turn LoRA off. Checked for a simulated
    pool too: its extraArgs are its vLLM arguments once it runs vLLM."""
    pool = {**REAL, "simulated": simulated, "lora": {"modules": ADAPTERS}, "extraArgs": extra}
    message = _refused(chart, {"pools": [pool]})
    assert f'pools[0] (l4): pools[0].extraArgs has "{arg}", vLLM\'s {flag}, {why}' in message


def test_pool_defaults_extra_args_are_named_as_such(chart: helm.Chart) -> None:
    message = _refused(
        chart, {"poolDefaults": {"extraArgs": ["--max-loras", "4"]}, "pools": [{**REAL, "lora": LORA}]}
    )
    assert 'pools[0] (l4): poolDefaults.extraArgs has "--max-loras"' in message


@pytest.mark.parametrize(
    "extra",
    [
        ["--max-cpu-loras", "8"],
        ["--lora-dtype", "bfloat16"],
        ["--fully-sharded-loras"],
        ["--lora-target-modules", "o_proj"],
        ["--max-lora", "4"],  # ambiguous to vLLM's parser (--max-loras, --max-lora-rank): its own error
        ["--enable-lo"],  # ambiguous too (--enable-log-requests, …)
        ["--enable-lora=1"],  # vLLM refuses a value for a switch
    ],
    ids=["cpu loras", "dtype", "fully sharded", "target modules", "--max-lora", "--enable-lo", "switch=1"],
)
def test_other_lora_flags_pass(chart: helm.Chart, extra: list[str]) -> None:
    dep = validated_deployment(render(chart, {"pools": [{**REAL, "lora": LORA, "extraArgs": extra}]}), "l4")
    assert container_args(dep)[-len(extra) :] == extra


def test_only_a_pool_with_lora_on_has_the_lora_flags_in_extra_args_refused(chart: helm.Chart) -> None:
    """Without adapters in `lora` the chart writes no LoRA flag, and extraArgs keep the way to LoRA there was
    before `lora`: such a pool renders as it did."""
    extra = ["--enable-lora", "--lora-modules", "sql=/adapters/sql", "--max-loras", "2"]
    assert "pools[0].extraArgs has" in _refused(
        chart, {"pools": [{**REAL, "lora": LORA, "extraArgs": extra}]}
    )
    for lora in ({}, {"modules": []}):
        dep = validated_deployment(
            render(chart, {"pools": [{**REAL, "lora": lora, "extraArgs": extra}]}), "l4"
        )
        assert container_args(dep)[-len(extra) :] == extra


@pytest.mark.parametrize(
    "extra",
    [["--lora-modules", "x=/x"], ["--max-loras=4"], ["--enable-lora"], ["--no-enable-lora"]],
    ids=["modules", "max loras", "on", "off"],
)
def test_simulator_extra_args_may_not_repeat_a_simulated_pools_lora_flags(
    chart: helm.Chart, extra: list[str]
) -> None:
    flag = extra[0].split("=")[0]
    message = _refused(chart, {"simulator": {"extraArgs": extra}, "pools": [{**SIM, "lora": LORA}]})
    assert (
        f"pools[0] (sim): simulator.extraArgs has \"{extra[0]}\", mosaic worker's {flag} (vLLM's)" in message
    )
    render(chart, {"simulator": {"extraArgs": extra}, "pools": [SIM, {**REAL, "lora": LORA}]})
