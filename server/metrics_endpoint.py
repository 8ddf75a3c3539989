"""A Prometheus `/metrics` listener in the running event loop, for processes that serve no other HTTP
(`mosaic autoscale --metrics-port`): prometheus_client's ASGI app under uvicorn, on a socket bound by
`simulator.worker_server.bind_socket`, without uvicorn's signal capture (the command keeps SIGTERM/SIGINT).
Collection runs on the loop's thread, so collectors that read live objects need no locking."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app

from simulator.worker_server import bind_socket, serve_until_started


class _MetricsServer(uvicorn.Server):
    """uvicorn without its signal capture: SIGTERM/SIGINT stay with the command's own handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def metrics_endpoint(registry: CollectorRegistry, host: str, port: int) -> AsyncIterator[int]:
    """Serve `registry` (Prometheus text, prometheus_client's ASGI app) on host:port in this loop while
    inside; yields the bound port (port 0: a free one)."""
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    server = _MetricsServer(uvicorn.Config(make_asgi_app(registry), log_level="warning", lifespan="off"))
    task = await serve_until_started(server, sock, "metrics endpoint")
    try:
        yield bound
    finally:
        server.should_exit = True
        await task
        sock.close()
