"""`mosaic worker`: one simulated vLLM worker (OpenAI API + /metrics) for a GPU type and model, or with
`--engine vllm` a real `vllm serve` started with the same flags (`server/vllm_worker.py`).

    mosaic worker --gpu H100 --model llama-3-8b --port 8001 --time-scale 10

The engine flags keep vLLM's names (`--max-num-seqs`, `--max-num-batched-tokens`, `--block-size`,
`--gpu-memory-utilization`, `--num-gpu-blocks` = vLLM's --num-gpu-blocks-override, `--max-model-len`,
`--data-parallel-size`: engines behind the one server, each with those settings).
Port 0 picks a free port; the line printed at start names the URL. SIGINT/SIGTERM stop it.

LoRA takes vLLM's own flags, read from the rest of the line as vLLM's argparse reads them
(`lora_args`): `--lora-modules NAME=PATH|JSON ...` (one or more items; a later `--lora-modules` replaces
an earlier one, as in vLLM), `--max-loras N` (default 1) and `--enable-lora` (implied by adapters; alone it
turns LoRA on with none, as in vLLM). With `--engine vllm` they go to vLLM as they are, with
`--enable-lora` added when adapters are given without it (vLLM refuses to start otherwise).
Runtime adapter loading (`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`) is on when the environment has
vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set to "1" or "true" (vLLM's reading), or with
`--allow-runtime-lora-updating` (the simulator's own flag: vLLM has only the variable). As in vLLM it does not
turn LoRA on: a load without `--enable-lora` or adapters is vLLM's 500 "LoRA is not enabled".

`--runner pooling` makes it an embedding server, as vLLM's `--runner pooling --convert embed`: POST
/v1/embeddings and the score and rerank routes instead of the generation routes (mixed role only).

`serve_simulated` is the simulated backend; `--engine vllm` hands the flags to a real vLLM instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import typer

from server.commands.common import check_log_level, fail, raise_open_files_limit
from simulator.engine import EngineConfig
from simulator.engine_types import LONG_MAX_MODEL_LEN_ENV, vllm_env_flag
from simulator.lora import RUNTIME_LORA_ENV, LoraModule, parse_lora_modules, runtime_lora_updating
from simulator.worker_app import ROLES, RUNNERS, FaultConfig, WorkerConfig, WorkerRuntime
from simulator.worker_server import start_worker_server


@dataclass(frozen=True, slots=True)
class LoraArgs:
    """vLLM's LoRA flags on a `mosaic worker` line, and what else was left over."""

    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    enable_lora: bool | None = None  # None: not given
    rest: tuple[str, ...] = ()


class _ArgParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line for `fail`, not argparse's usage and exit
        raise ValueError(message)


class _LoraModulesAction(argparse.Action):
    """vLLM's `LoRAParserAction` (vllm/entrypoints/launchers/cli_args.py): the items after the flag."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        try:
            setattr(namespace, self.dest, parse_lora_modules(values))
        except ValueError as exc:
            parser.error(str(exc))


def lora_args(args: Sequence[str]) -> LoraArgs:
    """Read vLLM's `--lora-modules` (nargs +), `--max-loras` (int) and `--[no-]enable-lora` out of `args`
    (what the worker command did not parse itself); ValueError with one line on a bad value."""
    parser = _ArgParser(prog="mosaic worker", add_help=False, allow_abbrev=False)
    parser.add_argument("--lora-modules", nargs="+", action=_LoraModulesAction, default=())
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None)
    ns, rest = parser.parse_known_args(list(args))
    return LoraArgs(tuple(ns.lora_modules), ns.max_loras, ns.enable_lora, tuple(rest))


async def serve_simulated(cfg: WorkerConfig, host: str, port: int, log_level: str) -> None:
    """Serve until SIGINT/SIGTERM; prints one line with the URL and the engine's capacity."""
    try:
        worker = await start_worker_server(cfg, host=host, port=port, log_level=log_level)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    # As vLLM's server does after startup (vllm.utils.gc_utils.freeze_gc_heap): collect, then freeze the startup
    # heap so full collections skip it (each took ~50 ms, a stall for every request in flight).
    gc.collect()
    gc.freeze()
    rt = worker.runtime
    eng = rt.engine
    # data parallel: the blocks are each engine's (the cache_config_info rows report the server's sum)
    dp = f" ×{cfg.data_parallel_size} engines" if cfg.data_parallel_size > 1 else ""
    # an embedding worker says so: its clients need /v1/embeddings, not completions
    kind = "pooling (embedding) worker serving" if cfg.runner == "pooling" else "serving"
    typer.echo(
        f"mosaic worker: simulated {rt.perf.gpu.name} ×{cfg.tp} {kind} {rt.served} ({cfg.role}) at {worker.url} "
        f"— num_gpu_blocks={eng.num_gpu_blocks}{dp} block_size={eng.block_size} max_model_len={eng.max_model_len} "
        f"time_scale={cfg.time_scale:g}"
        + (
            f" lora_modules={','.join(m.name for m in cfg.lora_modules)} max_loras={cfg.engine.max_loras}"
            if cfg.lora_modules
            else ""
        )
        + (" runtime_lora_updating=on" if cfg.allow_runtime_lora_updating else ""),
        err=False,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await worker.stop()


def register(app: typer.Typer) -> None:
    @app.command("worker", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def worker(
        ctx: typer.Context,
        gpu: str | None = typer.Option(
            None, "--gpu", help="GPU type from the catalog (e.g. H100, A100-80GB, L4)."
        ),
        model: str = typer.Option(
            ..., "--model", help="Model from the catalog (e.g. llama-3-8b); --engine vllm: a path or HF name."
        ),
        engine: str = typer.Option(
            "sim",
            "--engine",
            help="sim: simulated worker | vllm: start a real `vllm serve` (args after -- go to it).",
        ),
        gpu_ids: str | None = typer.Option(
            None, "--gpu-ids", help="--engine vllm: GPUs to use, e.g. 0,1 (sets --tp)."
        ),
        vllm_command: str = typer.Option(
            "vllm serve", "--vllm-command", help="--engine vllm: command that runs vLLM."
        ),
        role: str = typer.Option("mixed", "--role", help="mixed | prefill | decode (P/D disaggregation)."),
        runner: str = typer.Option(
            "generate",
            "--runner",
            help="vLLM's --runner: generate (completions, chat) | pooling (an embedding server: /v1/embeddings, "
            "/score, /rerank).",
        ),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
        port: int = typer.Option(8001, "--port", help="Port to bind (0 = a free port)."),
        time_scale: float = typer.Option(
            1.0, "--time-scale", help="Run this many times faster than real time."
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of output lengths, text and failure injection."),
        tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree (GPUs per worker)."),
        data_parallel_size: int = typer.Option(
            1, "--data-parallel-size", help="Engines behind this one server (vLLM's data parallelism)."
        ),
        max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="vLLM --max-num-seqs."),
        max_num_batched_tokens: int = typer.Option(
            8192, "--max-num-batched-tokens", help="Token budget per step."
        ),
        block_size: int = typer.Option(16, "--block-size", help="KV block size in tokens."),
        gpu_memory_utilization: float = typer.Option(
            0.9, "--gpu-memory-utilization", help="vLLM's fraction."
        ),
        num_gpu_blocks: int | None = typer.Option(
            None, "--num-gpu-blocks", help="Override the KV block count."
        ),
        max_model_len: int | None = typer.Option(
            None, "--max-model-len", help="Context limit (default: model's)."
        ),
        enable_prefix_caching: bool = typer.Option(
            False,
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="Reuse cached full prompt blocks.",
        ),
        served_model_name: str | None = typer.Option(None, "--served-model-name", help="Name clients use."),
        catalog: str | None = typer.Option(
            None, "--catalog", help="YAML of GPU/model rows over the built-ins."
        ),
        kv_link_gbps: float = typer.Option(
            25.0, "--kv-link-gbps", help="P/D: GB/s the decode side pulls KV at."
        ),
        error_rate: float = typer.Option(
            0.0, "--error-rate", help="Fraction of requests answered with a 500."
        ),
        stall_rate: float = typer.Option(0.0, "--stall-rate", help="Fraction of requests stalled --stall-s."),
        stall_s: float = typer.Option(0.0, "--stall-s", help="Wall seconds a stalled request waits."),
        midstream_error_rate: float = typer.Option(
            0.0, "--midstream-error-rate", help="Streams cut with an error."
        ),
        log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level."),
        allow_runtime_lora_updating: bool = typer.Option(
            False,
            "--allow-runtime-lora-updating",
            help=f"Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: env {RUNTIME_LORA_ENV}, "
            "which is read too).",
        ),
        advertise_host: str | None = typer.Option(
            None,
            "--advertise-host",
            help="Host a P/D peer reaches this worker at (default: --host; in a pod, its IP). --engine vllm: "
            "the NIXL side-channel host (default: --host, or this machine's IP for 0.0.0.0).",
        ),
    ) -> None:
        """One simulated vLLM worker: vLLM's OpenAI API and /metrics, timed by the GPU perf model.

        LoRA: vLLM's --lora-modules NAME=PATH|JSON ... and --max-loras N [1] (--enable-lora implied); runtime
        loading with env VLLM_ALLOW_RUNTIME_LORA_UPDATING=true or --allow-runtime-lora-updating."""
        if engine == "vllm":  # a real vLLM server instead (server/vllm_worker.py, docs/real_vllm.md)
            from server.vllm_worker import run_vllm_worker

            raise typer.Exit(run_vllm_worker(ctx))
        if engine != "sim":
            fail(f"--engine must be sim or vllm, got {engine!r}")
        # --engine vllm's own flags, given to the simulated worker: refused, as the reverse is, not ignored
        vllm_only = [
            flag
            for name, flag in (("gpu_ids", "--gpu-ids"), ("vllm_command", "--vllm-command"))
            if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"
        ]
        if vllm_only:
            fail(
                f"{', '.join(vllm_only)}: --engine vllm only; the simulated worker (--engine sim) would ignore it"
            )
        log_level = check_log_level(log_level)
        if gpu is None:
            fail("--gpu is required for the simulated worker")
        try:
            lora = lora_args(ctx.args)
        except ValueError as exc:
            fail(str(exc))
        if lora.rest:
            fail(f"unexpected arguments: {' '.join(lora.rest)} (only --engine vllm passes extra args on)")
        if lora.modules and lora.enable_lora is False:
            fail("LoRA is not enabled. Use --enable-lora to enable LoRA.")  # vLLM's words, at its startup
        if role not in ROLES:
            fail(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
        if runner not in RUNNERS:
            fail(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
        if runner == "pooling" and role != "mixed":
            fail(f"--runner pooling needs --role mixed, got {role!r} (vLLM disaggregates generation only)")
        if not 0 <= port <= 65535:
            fail(f"--port must be in 0..65535, got {port}")
        try:
            cfg = WorkerConfig(
                gpu=gpu, model=model, role=role, tp=tp, time_scale=time_scale, seed=seed,
                engine=EngineConfig(
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                    gpu_memory_utilization=gpu_memory_utilization, num_gpu_blocks=num_gpu_blocks,
                    max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
                    max_loras=lora.max_loras,
                    allow_long_max_model_len=vllm_env_flag(os.environ, LONG_MAX_MODEL_LEN_ENV),
                ),
                served_model_name=served_model_name, catalog_path=catalog, kv_link_gbps=kv_link_gbps,
                faults=FaultConfig(error_rate=error_rate, stall_rate=stall_rate, stall_s=stall_s,
                                   midstream_error_rate=midstream_error_rate),
                advertise_host=advertise_host or host, data_parallel_size=data_parallel_size,
                lora_modules=lora.modules, enable_lora=bool(lora.enable_lora),
                allow_runtime_lora_updating=allow_runtime_lora_updating or runtime_lora_updating(os.environ),
                runner=runner,
            )  # fmt: skip
            # Build the runtime once up front so catalog and capacity errors exit 2 before binding.
            WorkerRuntime(cfg)
        except ValueError as exc:  # CatalogError is one; its message lists the valid names
            fail(str(exc))
        raise_open_files_limit()
        asyncio.run(serve_simulated(cfg, host, port, log_level))
