"""Fixtures of the load-generator tests: a simulated worker served on 127.0.0.1 from a background loop, and
a port nothing listens on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from simulator.lora import LoraModule
from simulator.worker_app import WorkerConfig
from simulator.worker_server import RunningWorker, start_worker_server


@contextlib.contextmanager
def _served(cfg: WorkerConfig) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    worker: RunningWorker = asyncio.run_coroutine_threadsafe(start_worker_server(cfg), loop).result(30)
    try:
        yield worker.url
    finally:
        asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def worker_url() -> Iterator[str]:
    """One simulated H100 worker, 500× faster than real time, served from its own event-loop thread."""
    with _served(WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=500)) as url:
        yield url


@pytest.fixture(scope="module")
def lora_worker_url() -> Iterator[str]:
    """As `worker_url`, serving the LoRA adapters `sql` and `chat-v2` (vLLM's --lora-modules)."""
    mods = tuple(LoraModule(name, f"/adapters/{name}") for name in ("sql", "chat-v2"))
    with _served(WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=500, lora_modules=mods)) as url:
        yield url


@pytest.fixture
def closed_url() -> Iterator[str]:
    """A 127.0.0.1 port nothing listens on: bound (so no one else takes it) but not listening, every
    connection is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
