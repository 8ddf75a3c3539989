"""Serve a simulated worker with uvicorn inside the current event loop (tests, the gateway's embedded fleet).

    worker = await start_worker_server(WorkerConfig(...), host="127.0.0.1", port=0)
    worker.url            # "http://127.0.0.1:<bound port>"
    worker.port, worker.app, worker.runtime
    await worker.stop()   # graceful: uvicorn shutdown, then the app's lifespan closes the engine task

Port 0 binds a free port; the bound port is reported and written into the worker's kv_transfer_params
(`remote_port`). uvicorn's signal handlers are not installed (the embedding process owns signals).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from simulator.worker_app import WorkerConfig, WorkerRuntime, create_worker_app


class _EmbeddedServer(uvicorn.Server):
    abort_on_shutdown = True  # False: `RunningWorker.kill`, a crash (streams cut, nothing ended cleanly)

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield  # leave signal handling to whoever owns the process

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # vLLM (its default --shutdown-timeout 0) aborts what is running when it stops: every request ends
        # with finish_reason "abort" (a stream with its last event and [DONE]). Left running, uvicorn's
        # graceful-shutdown timeout cancelled the handlers: a plain-text 500 and a traceback.
        app = self.config.app
        runtime = getattr(getattr(app, "state", None), "worker", None)
        if runtime is not None and self.abort_on_shutdown:
            runtime.abort_all()
        await super().shutdown(sockets)


@dataclass(slots=True)
class RunningWorker:
    app: FastAPI
    host: str
    port: int
    _server: uvicorn.Server
    _task: asyncio.Task[None]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def runtime(self) -> WorkerRuntime:
        return self.app.state.worker

    async def stop(self) -> None:
        """Stop serving, as vLLM stops: what is running ends with finish_reason "abort" (`_EmbeddedServer.
        shutdown`); then wait for the server task. Idempotent."""
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def kill(self) -> None:
        """Stop as a crashed worker does (tests of the gateway's failure handling): open streams are cut,
        nothing running is ended cleanly."""
        server = self._server
        if isinstance(server, _EmbeddedServer):
            server.abort_on_shutdown = False
        for connection in list(server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()  # a reset, as the kernel sends for a process that died
        await self.stop()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (0 → a free port); OSError when it cannot bind.

    Created with `proto=IPPROTO_TCP` on purpose: asyncio sets TCP_NODELAY on an accepted connection only
    when the socket says it is TCP (`sock.proto == IPPROTO_TCP`), and a `socket.socket(AF_INET,
    SOCK_STREAM)` says 0. Without TCP_NODELAY, a response written as headers then body meets Nagle's
    algorithm and the client's delayed ACK: every response waited ~40 ms, whatever the time scale
    (measured, bench/gateway_overhead.py). The gateway's runner binds its socket with this too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def serve_until_started(server: uvicorn.Server, sock: socket.socket, what: str) -> asyncio.Task[None]:
    """Run `server` on `sock` as a task of this loop; return once it accepts connections. A startup
    failure is raised here (the socket closed), not left in a task nobody awaits. Used by the simulated
    worker and the gateway's runner."""
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # surfaces the startup error
                raise RuntimeError(f"{what} exited during startup")
            await asyncio.sleep(0.005)
    except BaseException:
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await task
        sock.close()
        raise
    return task


async def start_worker_server(
    cfg: WorkerConfig, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> RunningWorker:
    """Start `create_worker_app(cfg)` on host:port in this loop; returns once it accepts connections."""
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    app = create_worker_app(cfg)
    app.state.worker.advertise_port = cfg.advertise_port or bound
    config = uvicorn.Config(
        app, log_level=log_level, lifespan="on", access_log=False, timeout_graceful_shutdown=1
    )
    server = _EmbeddedServer(config)
    task = await serve_until_started(server, sock, "worker server")
    return RunningWorker(app, host, bound, server, task)
