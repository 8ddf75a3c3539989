"""The exact `vllm serve` command lines and environments the launcher builds (no vLLM needed: these run in
`make test` everywhere). GPU and P/D flags can't run on a CPU-only machine, so their argv is asserted exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from server.vllm_launcher import (
    VllmLaunchSpec,
    build_command,
    build_env,
    detect_gpu_ids,
    kv_transfer_config,
    parse_gpu_ids,
)

NIXL_PRODUCER = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
NIXL_CONSUMER = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'


@pytest.mark.parametrize(
    ("spec", "argv"),
    [
        pytest.param(
            VllmLaunchSpec(
                model="meta-llama/Meta-Llama-3-8B-Instruct",
                port=8000,
                served_model_name="llama-3-8b",
                max_model_len=8192,
                gpu_memory_utilization=0.9,
                gpu_ids=("0",),
            ),
            [
                "vllm",
                "serve",
                "meta-llama/Meta-Llama-3-8B-Instruct",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--served-model-name",
                "llama-3-8b",
                "--tensor-parallel-size",
                "1",
                "--max-model-len",
                "8192",
                "--gpu-memory-utilization",
                "0.9",
            ],
            id="mixed worker on one GPU: no KV connector",
        ),
        pytest.param(
            VllmLaunchSpec(
                model="/models/llama-70b",
                port=8100,
                host="0.0.0.0",
                role="prefill",
                tensor_parallel_size=2,
                gpu_ids=("0", "1"),
            ),
            [
                "vllm",
                "serve",
                "/models/llama-70b",
                "--host",
                "0.0.0.0",
                "--port",
                "8100",
                "--tensor-parallel-size",
                "2",
                "--kv-transfer-config",
                NIXL_PRODUCER,
            ],
            id="prefill TP2: NixlConnector as kv_producer",
        ),
        pytest.param(
            VllmLaunchSpec(
                model="/models/llama-70b",
                port=8200,
                role="decode",
                tensor_parallel_size=4,
                gpu_ids=("4", "5", "6", "7"),
                max_model_len=4096,
                gpu_memory_utilization=0.85,
            ),
            [
                "vllm",
                "serve",
                "/models/llama-70b",
                "--host",
                "127.0.0.1",
                "--port",
                "8200",
                "--tensor-parallel-size",
                "4",
                "--max-model-len",
                "4096",
                "--gpu-memory-utilization",
                "0.85",
                "--kv-transfer-config",
                NIXL_CONSUMER,
            ],
            id="decode TP4: NixlConnector as kv_consumer",
        ),
        pytest.param(
            VllmLaunchSpec(
                model="/models/llama-70b",
                port=8300,
                role="decode",
                tensor_parallel_size=2,
                data_parallel_size=2,
                gpu_ids=("0", "1", "2", "3"),
                max_model_len=4096,
            ),
            [
                "vllm",
                "serve",
                "/models/llama-70b",
                "--host",
                "127.0.0.1",
                "--port",
                "8300",
                "--tensor-parallel-size",
                "2",
                "--data-parallel-size",
                "2",
                "--max-model-len",
                "4096",
                "--kv-transfer-config",
                NIXL_CONSUMER,
            ],
            id="decode TP2 x DP2: two engines of two GPUs behind one server",
        ),
        pytest.param(
            VllmLaunchSpec(
                model="m",
                port=9000,
                extra_args=("--enable-prefix-caching", "--max-num-seqs", "64"),
                vllm_command=("/venv/bin/python", "scripts/vllm_cpu_cli.py", "serve"),
            ),
            [
                "/venv/bin/python",
                "scripts/vllm_cpu_cli.py",
                "serve",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "9000",
                "--tensor-parallel-size",
                "1",
                "--enable-prefix-caching",
                "--max-num-seqs",
                "64",
            ],
            id="custom vllm command (CPU wrapper) and extra args kept last, in order",
        ),
        pytest.param(
            VllmLaunchSpec(
                model="intfloat/e5-mistral-7b-instruct",
                port=8001,
                served_model_name="e5",
                runner="pooling",
                extra_args=("--convert", "embed"),
            ),
            [
                "vllm",
                "serve",
                "intfloat/e5-mistral-7b-instruct",
                "--host",
                "127.0.0.1",
                "--port",
                "8001",
                "--served-model-name",
                "e5",
                "--tensor-parallel-size",
                "1",
                "--runner",
                "pooling",
                "--convert",
                "embed",
            ],
            id="a pooling pool: vLLM's pooling runner (an embeddings server)",
        ),
    ],
)
def test_command_line(spec: VllmLaunchSpec, argv: list[str]) -> None:
    assert build_command(spec) == argv


def test_kv_transfer_config_is_valid_json_with_vllm_keys() -> None:
    assert json.loads(NIXL_PRODUCER) == kv_transfer_config("prefill")
    assert kv_transfer_config("decode") == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert kv_transfer_config("mixed") is None


@pytest.mark.parametrize(
    ("spec", "expected", "absent"),
    [
        pytest.param(
            VllmLaunchSpec(model="m", port=1, gpu_ids=("2",)),
            {"CUDA_VISIBLE_DEVICES": "2", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
            ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
            id="mixed: only its GPU is visible, no NIXL side channel",
        ),
        pytest.param(
            VllmLaunchSpec(
                model="m",
                port=1,
                role="prefill",
                tensor_parallel_size=2,
                gpu_ids=("0", "1"),
                nixl_side_channel_port=5610,
                host="10.0.0.5",
            ),
            {
                "CUDA_VISIBLE_DEVICES": "0,1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": "5610",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5",
            },
            (),
            id="prefill: side channel on the bind host at the given port (TP ranks use 5610, 5611)",
        ),
        pytest.param(
            VllmLaunchSpec(
                model="m",
                port=1,
                role="decode",
                tensor_parallel_size=2,
                data_parallel_size=2,
                gpu_ids=("4", "5", "6", "7"),
                nixl_side_channel_port=5620,
            ),
            {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5620"},
            (),
            id="decode TP2 x DP2: every engine's GPUs visible (vLLM gives engine r ids 2r, 2r+1), one base port",
        ),
        pytest.param(
            VllmLaunchSpec(model="m", port=1, role="decode", env={"UCX_NET_DEVICES": "all"}),
            {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600", "UCX_NET_DEVICES": "all"},
            ("CUDA_VISIBLE_DEVICES",),
            id="decode without GPU ids: vLLM's default side-channel port, spec env added, CUDA var untouched",
        ),
    ],
)
def test_environment(spec: VllmLaunchSpec, expected: dict[str, str], absent: tuple[str, ...]) -> None:
    env = build_env(spec, base={"PATH": "/usr/bin"})
    assert env["PATH"] == "/usr/bin"
    for key, value in expected.items():
        assert env[key] == value
    for key in absent:
        assert key not in env


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"role": "router"}, "role", id="unknown role"),
        pytest.param(
            {"tensor_parallel_size": 2, "gpu_ids": ("0",)}, "gpu_ids", id="fewer GPUs than TP ranks"
        ),
        pytest.param({"tensor_parallel_size": 2, "gpu_ids": ("3", "3")}, "gpu_ids", id="same GPU twice"),
        pytest.param(
            {"tensor_parallel_size": 2, "data_parallel_size": 2, "gpu_ids": ("0", "1")},
            "gpu_ids",
            id="GPUs for one engine of two",
        ),
        pytest.param({"data_parallel_size": 0}, "data_parallel_size", id="zero DP"),
        pytest.param({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", id="utilisation over 1"),
        pytest.param({"tensor_parallel_size": 0}, "tensor_parallel_size", id="zero TP"),
        pytest.param({"port": 70000}, "port", id="port out of range"),
        pytest.param({"max_model_len": 0}, "max_model_len", id="zero max model len"),
        pytest.param({"runner": "auto"}, "runner", id="a runner vLLM has but a pool does not name"),
        pytest.param({"runner": "pooling", "role": "prefill"}, "runner", id="a pooling prefill worker"),
    ],
)
def test_bad_spec_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        VllmLaunchSpec(model="m", **{"port": 8000, **kwargs})  # type: ignore[arg-type]


def test_parse_gpu_ids() -> None:
    assert parse_gpu_ids("0,1") == ("0", "1")
    assert parse_gpu_ids(" 2 , 3 ") == ("2", "3")
    with pytest.raises(ValueError, match="comma-separated"):
        parse_gpu_ids("0,,1")


def test_detect_gpu_ids_prefers_cuda_visible_devices(tmp_path: Path) -> None:
    assert detect_gpu_ids({"CUDA_VISIBLE_DEVICES": "1,3"}) == ("1", "3")
    assert detect_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) == ()
    # A stand-in nvidia-smi printing two indices, as the real one does with --format=csv,noheader.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("import sys\nprint('0')\nprint('1')\n", encoding="utf-8")
    assert detect_gpu_ids({}, nvidia_smi=(sys.executable, str(fake))) == ("0", "1")
    assert detect_gpu_ids({}, nvidia_smi=(str(tmp_path / "absent"),)) == ()
