"""What the real-vLLM tests talk to: a `Target` (base URL + model + key) and the Mosaic gateway process.

`MosaicGateway` runs the gateway (`create_app(load_config(FILE))` under uvicorn, fixtures/run_gateway.py) as
a subprocess with a static-endpoint pool in front of given vLLM URLs: config file → gateway → real vLLM.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import vllm_env
import yaml

from server.vllm_launcher import free_port, health_ok, log_tail

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CATALOG = FIXTURES / "catalog.yaml"
RUN_GATEWAY = FIXTURES / "run_gateway.py"
API_KEY = "sk-mosaic-real-vllm-test"
ADMIN_KEY = "sk-mosaic-real-vllm-admin"


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # "vllm" or "mosaic"
    base_url: str
    model: str
    api_key: str = "unused"
    admin_key: str | None = None

    @contextlib.contextmanager
    def openai(self) -> Iterator[openai.OpenAI]:
        client = openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key, timeout=60, max_retries=0
        )
        try:
            yield client
        finally:
            client.close()

    @contextlib.contextmanager
    def http(self) -> Iterator[httpx.Client]:
        headers = {"authorization": f"Bearer {self.api_key}"}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=60) as client:
            yield client


def static_config(
    model: str, urls: Sequence[str], *, pool: str = "real-vllm", extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A Mosaic config with one static pool of real vLLM CPU servers serving the tiny model.

    The catalog fixture describes the tiny model and the CPU "GPU"; `block_size: 128` is vLLM's CPU block size
    (the gateway reads the real one from `vllm:cache_config_info` after the first scrape anyway)."""
    config: dict[str, Any] = {
        "catalog": str(CATALOG),
        "models": [{"name": model, "max_model_len": 512}],
        "pools": [
            {
                "name": pool,
                "model": model,
                "gpu": "CPU-AVX2",
                "role": "mixed",
                "block_size": 128,
                "endpoints": {"static": list(urls)},
            }
        ],
        "auth": {"api_keys": [API_KEY], "admin_keys": [ADMIN_KEY]},
        # Under streaming load the CPU server answers /metrics in 0.1-0.8 s (its API process shares a core with
        # the engine): the default 0.5 s scrape timeout would leave the stats stale exactly when they matter.
        "scrape": {"interval_s": 0.25, "timeout_s": 3.0, "stale_after_s": 10.0},
        # A whole answer can time out before the server answers only by its connect timeout (2 s): seen once
        # in `make test-vllm`, a 504 on the first burst at a just-started server. The 2 s is wall time in the
        # gateway's own event loop, which a CPU vLLM's engine starves on the 2 shared cores (a connection
        # made while the loop waits for the CPU is lost to the timer that expired meanwhile).
        "limits": {"connect_timeout_s": 15.0},
    }
    for key, value in (extra or {}).items():  # a section given is merged over these defaults
        base = config.get(key)
        config[key] = {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
    return config


def launch_endpoints(log_dir: Path, replicas: int) -> dict[str, Any]:
    """A pool's `endpoints:` for `launch: vllm` of the CPU build serving the tiny model (no GPU assignment)."""
    return {
        "launch": {
            "model": str(vllm_env.MODEL_DIR),
            "replicas": replicas,
            "use_gpus": False,
            "vllm_command": f"{vllm_env.VENV_PYTHON} {vllm_env.CPU_CLI} serve",
            "extra_args": list(vllm_env.BASE_SERVER_ARGS),
            "env": vllm_env.server_env(),
            "log_dir": str(log_dir),
        }
    }


class MosaicGateway:
    """The gateway as a subprocess on a free loopback port. Context manager; stop() is idempotent."""

    def __init__(self, config: Mapping[str, Any], workdir: Path) -> None:
        self.config_path = workdir / "mosaic.yaml"
        self.config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
        self.log_path = workdir / "mosaic.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            [sys.executable, str(RUN_GATEWAY), str(self.config_path), str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not health_ok(self.url):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mosaic serve did not become healthy:\n{log_tail(self.log_path, 40)}")
            time.sleep(0.2)

    def wait_worker_scraped(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Until every worker is ready and has been scraped (capacity known from `cache_config_info`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.admin_get("/admin/workers")["workers"]
            if workers and all(
                w["state"] == "ready" and (w["stats"] or {}).get("num_gpu_blocks") for w in workers
            ):
                return list(workers)
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready and scraped after {timeout_s} s: {workers}")
            time.sleep(0.1)

    def target(self, model: str) -> Target:
        return Target("mosaic", self.url, model, api_key=API_KEY, admin_key=ADMIN_KEY)

    def admin_get(self, path: str) -> Any:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            resp = http.get(path, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        resp.raise_for_status()
        return resp.json()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:  # graceful: drains streams, then stops sources (a launched vLLM takes a few seconds)
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        self._log.close()

    def __enter__(self) -> MosaicGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
