"""Run a real gateway (uvicorn on 127.0.0.1, a free port) in a background thread with its own event loop,
so synchronous clients (the `openai` SDK) can talk to it over real sockets."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from server.config import MosaicConfig
from server.gateway import Gateway
from server.runner import RunningGateway, start_gateway_server

T = TypeVar("T")


class GatewayThread:
    def __init__(self, config: MosaicConfig, **app_kwargs: Any) -> None:
        self.config = config
        self.app_kwargs = app_kwargs
        self.loop = asyncio.new_event_loop()
        self.running: RunningGateway | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        self.running = self.call(start_gateway_server(self.config, "127.0.0.1", 0, **self.app_kwargs))
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.running is not None:
                self.call(self.running.stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        """Run `coro` on the gateway's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        assert self.running is not None
        return self.running.url

    @property
    def gateway(self) -> Gateway:
        assert self.running is not None
        return self.running.gateway

    def metric(self, name: str, **labels: str) -> float:
        return self.gateway.metrics.registry.get_sample_value(name, labels) or 0.0

    def metric_reaches(self, name: str, value: float, timeout: float = 3.0, **labels: str) -> float:
        """The metric once it reaches `value` (a stream is accounted just after its last byte was sent)."""
        deadline = time.monotonic() + timeout
        while (current := self.metric(name, **labels)) < value and time.monotonic() < deadline:
            time.sleep(0.01)
        return current
