"""Fixtures of the load-generator tests: a simulated worker served on 127.0.0.1 from a background loop."""

from __future__ import annotations

import asyncio
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
