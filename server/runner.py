"""Run the gateway app with uvicorn inside the current event loop (`mosaic serve`, tests, benchmarks).

    running = await start_gateway_server(config, host="127.0.0.1", port=0)
    running.url, running.gateway            # bound URL; the app's Gateway
    await running.stop()                    # graceful: drains in-flight requests (limits.shutdown_grace_s)

Graceful shutdown: on SIGTERM/SIGINT (when `install_signals`) or `stop()`, the gateway is marked
draining first (new requests → 503, `/ready` → 503 so load balancers stop sending) and requests still
waiting in the admission queue get 503; uvicorn stops accepting connections and waits up to
`limits.shutdown_grace_s` for in-flight requests — streams included — to finish. Half a second before
that runs out the gateway ends what is left itself (`Gateway.begin_shutdown`: 503 in OpenAI's shape, or an
error event and `[DONE]`), then the lifespan stops discovery, scraping and simulated workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from server.app import create_app
from server.config import MosaicConfig
from server.gateway import Gateway
from simulator.worker_server import (  # one TCP_NODELAY-safe listener for gateway and workers
    bind_socket,
    serve_until_started,
)

log = logging.getLogger("mosaic.gateway")


def http_protocol() -> Any:
    """uvicorn's httptools protocol with the proxy endpoints on a lean cycle (`server.fast_http`) when this
    uvicorn has the internals it extends; else uvicorn's own choice ("auto"), which serves the same
    answers at a higher CPU cost per request."""
    try:
        from server.fast_http import GatewayHttpProtocol, compatible
    except ImportError:  # httptools not installed (uvicorn without the [standard] extra)
        log.warning("httptools is not installed: serving with uvicorn's default HTTP protocol")
        return "auto"
    if not compatible():
        log.warning(
            "uvicorn %s lacks the internals server.fast_http extends: serving with its default HTTP protocol",
            uvicorn.__version__,
        )
        return "auto"
    return GatewayHttpProtocol


class _GatewayServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, gateway: Gateway, install_signals: bool, grace_s: float
    ) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._install_signals = install_signals
        self.grace_s = grace_s
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.gateway.draining = True  # refuse new work before uvicorn starts draining connections
        # a signal handler runs between two bytecodes of whatever the loop was doing: schedule, don't act
        self._loop.call_soon_threadsafe(self.gateway.begin_shutdown, self.grace_s)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if self._install_signals:
            with super().capture_signals():
                yield
        else:
            yield


@dataclass(slots=True)
class RunningGateway:
    app: FastAPI
    host: str
    port: int
    server: _GatewayServer
    task: asyncio.Task[None]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway  # type: ignore[no-any-return]

    async def stop(self) -> None:
        """Drain and stop; idempotent."""
        self.gateway.begin_shutdown(self.server.grace_s)
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def wait(self) -> None:
        """Until the server exits (a signal, or `stop()` from elsewhere)."""
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def start_gateway_server(
    config: MosaicConfig,
    host: str | None = None,
    port: int | None = None,
    *,
    install_signals: bool = False,
    log_level: str = "warning",
    sock: socket.socket | None = None,
    **app_kwargs: Any,
) -> RunningGateway:
    """Start `create_app(config)` on host:port in this loop; returns once it accepts connections
    (simulated workers started, first health checks and scrapes done)."""
    host = host if host is not None else config.gateway.host
    port = port if port is not None else config.gateway.port
    sock = sock or bind_socket(host, port)
    bound = sock.getsockname()[1]
    app = create_app(config, **app_kwargs)
    uv = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(config.limits.shutdown_grace_s),
        backlog=4096,
        http=http_protocol(),
    )
    server = _GatewayServer(uv, app.state.gateway, install_signals, config.limits.shutdown_grace_s)
    task = await serve_until_started(server, sock, "gateway")
    return RunningGateway(app, host, bound, server, task)
