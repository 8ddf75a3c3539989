"""A pool's `dp`: engines per worker (vLLM's --data-parallel-size), each on `tp` GPUs behind the worker's one
API server. A real pool's pod runs `vllm serve … --data-parallel-size <dp>` on tp × dp GPUs, a simulated pool's
`mosaic worker` runs dp engines, and the gateway's config says dp so it sizes, prices and books the worker as
dp engines. At dp 1 nothing of a pod template changes (an upgrade restarts no GPU pod), and the flags the chart
writes from tp and dp may not also come through extraArgs, nor a pipeline or prefill context parallel size (not
modelled).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.chart.chartkit import (
    RELEASE,
    container,
    container_args,
    parse_mosaic_args,
    pod_spec,
    render,
    validated_deployment,
    with_decode,
)

REAL = {"name": "l4", "model": "llama-3-8b", "gpu": "L4"}
SIM = {"name": "sim", "model": "llama-3-8b", "gpu": "L4", "simulated": True}


def _after(args: list[str], flag: str) -> list[str]:
    """`args` up to and including `flag`'s value."""
    return args[: args.index(flag) + 2]


# ---- real vLLM pools ----


def test_a_real_dp_pool_runs_vllm_data_parallel_on_tp_times_dp_gpus(
    chart: helm.Chart, tmp_path: Path
) -> None:
    rendered = render(chart, {"pools": [{**REAL, "tp": 2, "dp": 2}]})
    dep = validated_deployment(rendered, "l4")
    assert container_args(dep) == [
        "llama-3-8b",
        "--served-model-name", "llama-3-8b",
        "--host", "0.0.0.0",
        "--port", "8000",
        "--tensor-parallel-size", "2",
        "--data-parallel-size", "2",
        "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256",
        "--block-size", "16",
        "--enable-prefix-caching",
        "--shutdown-timeout", "100",
    ]  # fmt: skip
    resources = container(dep)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 4 and resources["requests"]["nvidia.com/gpu"] == 4
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["mosaic.dev/tp"], annotations["mosaic.dev/dp"]) == ("2", "2")
    (entry,) = rendered.config()["pools"]
    assert (entry["tp"], entry["dp"]) == (2, 2)
    (pool,) = rendered.load_config(tmp_path).pools
    assert (pool.tp, pool.dp) == (2, 2)
    assert "l4: llama-3-8b on L4 (tp 2 × dp 2, role mixed" in rendered.notes


def test_a_dp_pool_takes_its_gpus_from_its_own_gpu_resource(chart: helm.Chart) -> None:
    pool = {**REAL, "dp": 4, "gpuResource": "amd.com/gpu", "gpuProducts": ["AMD-Instinct-MI300X"]}
    dep = validated_deployment(render(chart, {"pools": [pool]}), "l4")
    resources = container(dep)["resources"]
    assert resources["limits"]["amd.com/gpu"] == 4 and resources["requests"]["amd.com/gpu"] == 4
    assert "nvidia.com/gpu" not in resources["limits"]


def test_a_pd_dp_pool_declares_each_engines_nixl_side_channel(chart: helm.Chart) -> None:
    """vLLM 0.32's NIXL connector listens on VLLM_NIXL_SIDE_CHANNEL_PORT + the engine's data-parallel index."""
    rendered = render(chart, {"pools": with_decode({**REAL, "role": "prefill", "dp": 3})})
    ports = container(validated_deployment(rendered, "l4"))["ports"]
    assert ports == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "nixl", "containerPort": 5600, "protocol": "TCP"},
        {"name": "nixl-1", "containerPort": 5601, "protocol": "TCP"},
        {"name": "nixl-2", "containerPort": 5602, "protocol": "TCP"},
    ]


@pytest.mark.parametrize(
    ("port", "dp", "message"),
    [
        pytest.param(5600, 1, "vllm.kvTransfer.sideChannelPort 5600 is vllm.port", id="engine 0's, dp 1"),
        pytest.param(
            5602,
            3,
            "pools[0] (l4): vllm.port 5602 is the NIXL side channel of the pool's engine 2 "
            "(vllm.kvTransfer.sideChannelPort 5600 + its data-parallel index, 0..2)",
            id="the last engine's",
        ),
    ],
)
def test_vllms_port_on_an_engines_side_channel_is_refused(
    chart: helm.Chart, port: int, dp: int, message: str
) -> None:
    values = {"pools": [{**REAL, "role": "decode", "dp": dp}], "vllm": {"port": port}}
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, values)
    assert message in str(caught.value)
    render(chart, {**values, "vllm": {"port": port + 1}})  # just past the last engine's: fine


# ---- simulated pools ----


def test_a_simulated_dp_pool_runs_dp_engines(chart: helm.Chart, tmp_path: Path) -> None:
    rendered = render(chart, {"pools": [{**SIM, "tp": 2, "dp": 2}, {**SIM, "name": "one", "tp": 2}]})
    args, single = (
        container_args(validated_deployment(rendered, "sim")),
        container_args(validated_deployment(rendered, "one")),
    )
    cut = len(_after(single, "--tp"))
    # the dp = 1 pool's arguments with the engines inserted after --tp
    assert args == [*single[:cut], "--data-parallel-size", "2", *single[cut:]]
    params = parse_mosaic_args(args)
    assert (params["tp"], params["data_parallel_size"]) == (2, 2)
    annotations = validated_deployment(rendered, "sim")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["mosaic.dev/dp"] == "2"
    assert not any(
        "gpu" in k for k in container(validated_deployment(rendered, "sim"))["resources"].get("limits", {})
    )
    assert [(p.name, p.dp) for p in rendered.load_config(tmp_path).pools] == [("sim", 2), ("one", 1)]


# ---- dp 1: as before ----


@pytest.mark.parametrize(
    "pool", [REAL, {**REAL, "role": "prefill", "tp": 2}, SIM], ids=["real", "P/D tp 2", "sim"]
)
def test_dp_1_renders_the_pod_templates_as_before(chart: helm.Chart, pool: dict[str, Any]) -> None:
    """A pod-template change restarts every GPU pod (a model reload each): at dp 1 the chart writes no
    --data-parallel-size, no mosaic.dev/dp and no second side channel, and `dp: 1` renders byte-identical
    to no dp at all."""
    raw = chart.render({"pools": with_decode(pool)}, name=RELEASE, namespace="llm", is_install=True)
    explicit = chart.render(
        {"pools": with_decode({**pool, "dp": 1})}, name=RELEASE, namespace="llm", is_install=True
    )
    assert explicit["mosaic/templates/pools.yaml"] == raw["mosaic/templates/pools.yaml"]
    dep = render(chart, {"pools": with_decode(pool)}).pool_deployments()[0]
    c = container(dep)
    assert "--data-parallel-size" not in container_args(dep)
    assert "mosaic.dev/dp" not in dep["spec"]["template"]["metadata"]["annotations"]
    assert [p["name"] for p in c["ports"]] == ["http", *(["nixl"] if pool.get("role") == "prefill" else [])]
    if not pool.get("simulated"):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == pool.get("tp", 1)
    # the config says dp as it says tp: always
    assert render(chart, {"pools": with_decode(pool)}).config()["pools"][0]["dp"] == 1


# ---- values ----


@pytest.mark.parametrize(
    ("dp", "message"),
    [
        pytest.param(0, "at '/pools/0/dp': minimum: got 0, want 1", id="no engine"),
        pytest.param("2", "at '/pools/0/dp': got string, want integer", id="a string"),
        pytest.param(1.5, "at '/pools/0/dp': got number, want integer", id="a fraction"),
    ],
)
def test_the_schema_refuses_a_dp_that_is_not_a_count_of_engines(
    chart: helm.Chart, dp: Any, message: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema({"pools": [{**REAL, "dp": dp}]})
    assert message in str(caught.value)


def test_pool_defaults_dp_reaches_every_pool(chart: helm.Chart) -> None:
    rendered = render(chart, {"poolDefaults": {"dp": 2}, "pools": [REAL, {**SIM, "dp": 1}]})
    assert "--data-parallel-size" in container_args(validated_deployment(rendered, "l4"))
    assert "--data-parallel-size" not in container_args(validated_deployment(rendered, "sim"))
    assert [p["dp"] for p in rendered.config()["pools"]] == [2, 1]


# ---- the flags the chart writes from tp and dp, again in extraArgs ----

REFUSED_ARGS = [
    pytest.param(["--data-parallel-size", "2"], "--data-parallel-size", "dp", id="--data-parallel-size"),
    pytest.param(["-dp", "2"], "-dp", "dp", id="-dp"),
    pytest.param(["-dp=2"], "-dp=2", "dp", id="-dp=2"),
    pytest.param(["--data_parallel_size=2"], "--data_parallel_size=2", "dp", id="underscores"),
    pytest.param(
        ["--enforce-eager", "--tensor-parallel-size", "4"],
        "--tensor-parallel-size",
        "tp",
        id="--tensor-parallel-size",
    ),
    pytest.param(["-tp=4"], "-tp=4", "tp", id="-tp=4"),
    pytest.param(["--tensor-parallel", "4"], "--tensor-parallel", "tp", id="an abbreviation argparse takes"),
    pytest.param(["-t", "4"], "-t", "tp", id="a short one"),
]
VLLM_FLAG = {"dp": "--data-parallel-size", "tp": "--tensor-parallel-size"}


@pytest.mark.parametrize(("extra", "arg", "key"), REFUSED_ARGS)
def test_a_pools_extra_args_may_not_set_tp_or_dp(
    chart: helm.Chart, extra: list[str], arg: str, key: str
) -> None:
    """vLLM keeps the last of a repeated flag, so the pool's would win over the chart's: a pod given tp × dp
    GPUs would start another shape (or fail to start), and the gateway would size and price it wrongly."""
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"pools": [SIM, {**REAL, "extraArgs": extra}]})
    assert (
        f'pools[1] (l4): pools[1].extraArgs has "{arg}", vLLM\'s {VLLM_FLAG[key]}, which the chart writes from '
        f"the pool's {key}"
    ) in str(caught.value)
    assert f"remove it and set pools[1].{key}" in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "arg"),
    [
        pytest.param(
            ["--pipeline-parallel-size", "2"], "--pipeline-parallel-size", id="--pipeline-parallel-size"
        ),
        pytest.param(["-pp", "2"], "-pp", id="-pp"),
        pytest.param(["-pp=2"], "-pp=2", id="-pp=2"),
        pytest.param(["--pipeline_parallel_size=2"], "--pipeline_parallel_size=2", id="underscores"),
        pytest.param(["--pi", "2"], "--pi", id="the shortest abbreviation argparse takes"),
    ],
)
def test_a_pools_extra_args_may_not_set_a_pipeline_parallel_size(
    chart: helm.Chart, extra: list[str], arg: str
) -> None:
    """Mosaic does not model pipeline parallelism: a replica would need tp × pp × dp GPUs, its pod gets tp × dp,
    and the gateway would size and price it as tp × dp."""
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"pools": [SIM, {**REAL, "extraArgs": extra}]})
    assert (
        f'pools[1] (l4): pools[1].extraArgs has "{arg}", vLLM\'s --pipeline-parallel-size, which Mosaic does '
        "not model: a replica would need tp × pp × dp GPUs while its pod gets tp × dp"
    ) in str(caught.value)
    assert "remove it and use pools[1].tp" in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "arg"),
    [
        pytest.param(
            ["--prefill-context-parallel-size", "2"],
            "--prefill-context-parallel-size",
            id="--prefill-context-parallel-size",
        ),
        pytest.param(["-pcp", "2"], "-pcp", id="-pcp"),
        pytest.param(["-pcp=2"], "-pcp=2", id="-pcp=2"),
        pytest.param(
            ["--prefill_context_parallel_size=2"], "--prefill_context_parallel_size=2", id="underscores"
        ),
        pytest.param(
            ["--prefill-c", "2"], "--prefill-c", id="the shortest abbreviation argparse takes (--prefill-s…)"
        ),
        pytest.param(["-pc", "2"], "-pc", id="-pc: argparse takes it for -pcp"),
    ],
)
def test_a_pools_extra_args_may_not_set_a_prefill_context_parallel_size(
    chart: helm.Chart, extra: list[str], arg: str
) -> None:
    """vLLM's world size is tp × pp × pcp: a pcp multiplies a replica's GPUs like a pp does, and Mosaic does not
    model it either."""
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"pools": [SIM, {**REAL, "extraArgs": extra}]})
    assert (
        f'pools[1] (l4): pools[1].extraArgs has "{arg}", vLLM\'s --prefill-context-parallel-size, which Mosaic '
        "does not model: a replica would need tp × pcp × dp GPUs while its pod gets tp × dp"
    ) in str(caught.value)
    assert "remove it and use pools[1].tp" in str(caught.value)


def test_pool_defaults_extra_args_are_named_as_such(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"poolDefaults": {"extraArgs": ["-dp", "2"]}, "pools": [REAL]})
    assert 'pools[0] (l4): poolDefaults.extraArgs has "-dp"' in str(caught.value)
    assert "remove it and set pools[0].dp" in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "arg", "key"),
    [
        pytest.param(["--data-parallel-size", "2"], "--data-parallel-size", "dp", id="--data-parallel-size"),
        pytest.param(["--tp=2"], "--tp=2", "tp", id="--tp=2"),
    ],
)
def test_simulator_extra_args_may_not_set_tp_or_dp(
    chart: helm.Chart, extra: list[str], arg: str, key: str
) -> None:
    flag = {"dp": "--data-parallel-size", "tp": "--tp"}[key]
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"simulator": {"extraArgs": extra}, "pools": [SIM]})
    assert f'pools[0] (sim): simulator.extraArgs has "{arg}", mosaic worker\'s {flag}' in str(caught.value)
    render(chart, {"simulator": {"extraArgs": extra}, "pools": [REAL]})  # no simulated pool reads them


@pytest.mark.parametrize(
    "extra",
    [
        ["--data-parallel-size-local", "1"],
        ["--data-parallel-backend", "mp"],
        ["--chat-template", "/t/tp.jinja"],
        ["--t"],  # ambiguous to vLLM's parser: its own error, not the chart's
    ],
    ids=["another DP flag", "DP backend", "a value", "too short a prefix"],
)
def test_other_flags_pass(chart: helm.Chart, extra: list[str]) -> None:
    dep = validated_deployment(render(chart, {"pools": [{**REAL, "dp": 2, "extraArgs": extra}]}), "l4")
    assert container_args(dep)[-len(extra) :] == extra
    assert pod_spec(dep)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
