"""Accepted connections of the gateway and of the simulated worker have TCP_NODELAY set.

Without it, a response written as headers then body waits for the client's delayed ACK (~40 ms on
Linux): the simulated worker answered every request in ≥ 40 ms whatever its time scale, and the gateway
added another ~40 ms (bench/gateway_overhead.py before the fix)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from server.config import validate_config
from server.runner import bind_socket, start_gateway_server
from simulator.worker_app import WorkerConfig
from simulator.worker_server import start_worker_server


def _accepted_nodelay(server: Any) -> list[int]:
    """TCP_NODELAY of every connection the uvicorn server has accepted."""
    return [
        conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        for conn in server.server_state.connections
    ]


async def _connect_and_check(port: int, server: Any) -> list[int]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")  # answered: the connection is registered with the server
        return _accepted_nodelay(server)
    finally:
        writer.close()
        await writer.wait_closed()


def test_bind_socket_is_a_tcp_socket_with_nodelay() -> None:
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # what asyncio checks before enabling TCP_NODELAY
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


@pytest.mark.parametrize(
    "side",
    [
        pytest.param("worker", id="simulated worker connections have TCP_NODELAY"),
        pytest.param("gateway", id="gateway client connections have TCP_NODELAY"),
    ],
)
def test_accepted_connections_have_nodelay(side: str) -> None:
    async def run() -> list[int]:
        worker = await start_worker_server(WorkerConfig(time_scale=1e6))
        try:
            if side == "worker":
                return await _connect_and_check(worker.port, worker._server)
            cfg = validate_config(
                {
                    "pools": [
                        {
                            "name": "p",
                            "model": "llama-3-8b",
                            "gpu": "H100",
                            "role": "mixed",
                            "endpoints": {"static": [worker.url]},
                        }
                    ],
                    "health": {"interval_s": 60},
                    "scrape": {"interval_s": 60},
                },
                "test",
            )
            gw = await start_gateway_server(cfg, "127.0.0.1", 0)
            try:
                return await _connect_and_check(gw.port, gw.server)
            finally:
                await gw.stop()
        finally:
            await worker.stop()

    flags = asyncio.run(run())
    assert flags and all(f != 0 for f in flags)
