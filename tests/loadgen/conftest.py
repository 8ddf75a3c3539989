"""Fixtures of the load-generator tests: a simulated worker served on 127.0.0.1 from a background loop, and
a port nothing listens on."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from simulator.worker_app import WorkerConfig
from simulator.worker_server import RunningWorker, start_worker_server


@pytest.fixture(scope="module")
def worker_url() -> Iterator[str]:
    """One simulated H100 worker, 500× faster than real time, served from its own event-loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    worker: RunningWorker = asyncio.run_coroutine_threadsafe(
        start_worker_server(WorkerConfig(gpu="H100", model="llama-3-8b", time_scale=500)), loop
    ).result(30)
    try:
        yield worker.url
    finally:
        asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def closed_url() -> Iterator[str]:
    """A 127.0.0.1 port nothing listens on: bound (so no one else takes it) but not listening, every
    connection is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
