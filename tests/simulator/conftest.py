"""Fixtures for the simulated worker: async tests run on asyncio through anyio's pytest plugin."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from simulator.worker_app import WorkerConfig, create_worker_app
from simulator.worker_server import RunningWorker, start_worker_server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def asgi_worker(cfg: WorkerConfig) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    """An in-process worker app behind httpx.ASGITransport; closes the engine task at the end."""
    app = create_worker_app(cfg)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            yield client, app.state.worker
    finally:
        await app.state.worker.aclose()


@contextlib.asynccontextmanager
async def real_worker(cfg: WorkerConfig) -> AsyncIterator[RunningWorker]:
    """A worker served by uvicorn on 127.0.0.1 (a free port) in this event loop."""
    worker = await start_worker_server(cfg)
    try:
        yield worker
    finally:
        await worker.stop()


@pytest.fixture
def asgi() -> object:
    return asgi_worker


@pytest.fixture
def served() -> object:
    return real_worker
