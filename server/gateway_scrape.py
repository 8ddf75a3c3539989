"""`mosaic autoscale` scraping the gateways' `/metrics` (`autoscaler.gateways`) for the gateway-side signals.

The controller serves no traffic, so the admission queue, gateway-measured TTFT/TPOT, arrival rate and
request lengths exist only in the gateway replicas. `GatewayScraper` lists them — static URLs, or the
gateway pods through Kubernetes discovery (`server.discovery.KubernetesDiscovery`, e.g. `resource: pods`
and the gateway Deployment's pod labels; every listed pod with an address is scraped, ready or not: a
gateway whose workers are all gone reports not-ready and is exactly the one whose queue matters; re-listed
every `resync_s`) — and every `interval_s` GETs each one's `path` (with `Authorization: Bearer <$bearer_token_env>` when
set: the first of a comma-separated list, so the admin-keys variable works as is). A body is parsed with
`prometheus_client.parser` into a `server.gateway_signals.Snapshot`; `snapshots()` is the controller's
`GatewaySource`: each listed gateway's last good snapshot, None when older than `stale_after_s`.

An unreachable gateway (connect error, timeout, non-200, unparsable body) keeps its last good snapshot
until it goes stale, is logged once when it goes down (and again when it is back), and counts in:

| metric | type | labels |
|---|---|---|
| mosaic_autoscaler_gateway_scrape_errors_total | counter | gateway |
| mosaic_autoscaler_gateways | gauge | state: up (last scrape good), down |
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from server.config import AutoscalerGatewaysConfig
from server.discovery import Endpoint, KubernetesDiscovery, Source, StaticSource
from server.gateway_signals import Snapshot, samples_from_text

log = logging.getLogger("mosaic.autoscaler.gateways")
DEFAULT_INTERVAL_S = 5.0


def scrape_interval(cfg: AutoscalerGatewaysConfig, decision_interval_s: float) -> float:
    """The configured period, else min(5 s, half the decision interval): a fresh snapshot every cycle."""
    return cfg.interval_s if cfg.interval_s is not None else min(DEFAULT_INTERVAL_S, decision_interval_s / 2)


def bearer_token(env: str | None) -> str | None:
    if not env:
        return None
    first = os.environ.get(env, "").split(",")[0].strip()
    return first or None


class GatewayScraper:
    """Scrapes the configured gateways (module docstring). `start()` lists and scrapes once, then loops."""

    def __init__(
        self,
        cfg: AutoscalerGatewaysConfig,
        interval_s: float,
        metrics_registry: CollectorRegistry,
        *,
        client: httpx.AsyncClient | None = None,
        lister: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.interval_s = interval_s
        self.clock = clock
        self.source: Source
        if cfg.kubernetes is not None:  # domains mean nothing for gateways: never list nodes for them
            self.source = KubernetesDiscovery(
                cfg.kubernetes.model_copy(update={"domain_label": None}), lister
            )
        else:
            self.source = StaticSource(list(cfg.static or []))
        token = bearer_token(cfg.bearer_token_env)
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._client = client
        self._own_client = client is None
        self.endpoints: list[Endpoint] = []
        self.latest: dict[str, Snapshot] = {}
        self.down: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._listed_at: float | None = None
        self.errors = Counter(
            "mosaic_autoscaler_gateway_scrape_errors",
            "Failed scrapes of a gateway's /metrics by the autoscaler",
            ["gateway"],
            registry=metrics_registry,
        )
        self.gauge = Gauge(
            "mosaic_autoscaler_gateways",
            "Gateways the autoscaler scrapes, by state",
            ["state"],
            registry=metrics_registry,
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.timeout_s)
        await self.source.start()
        await self.scrape_once()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.source.stop()
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.scrape_once()
            except Exception:  # the loop must outlive a bad round (API server down, ...)
                log.exception("scraping the gateways failed")

    # ------------------------------------------------------------------ one round
    async def scrape_once(self) -> None:
        """Re-list the gateways when due (first round, then every `resync_s` of a Kubernetes source), then
        scrape each one."""
        now = self.clock()
        resync = self.source.resync_s
        if self._listed_at is None or (resync is not None and now - self._listed_at >= resync):
            try:
                self.endpoints = await self.source.list()
                self._listed_at = now
            except Exception as exc:  # keep the last listing: the gateways are likely still there
                log.warning("listing the gateways failed (keeping the last %d): %s", len(self.endpoints), exc)
        names = {e.name for e in self.endpoints}
        for gone in set(self.latest) - names:
            del self.latest[gone]
        self.down &= names
        await asyncio.gather(*(self._scrape(e) for e in self.endpoints))
        self.gauge.labels("up").set(len(names - self.down))
        self.gauge.labels("down").set(len(names & self.down))

    async def _scrape(self, endpoint: Endpoint) -> None:
        assert self._client is not None
        url = endpoint.url.rstrip("/") + self.cfg.path
        try:
            resp = await self._client.get(url, headers=self._headers, timeout=self.cfg.timeout_s)
            if resp.status_code != 200:
                raise ValueError(f"HTTP {resp.status_code}")
            samples = samples_from_text(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.errors.labels(endpoint.name).inc()
            if endpoint.name not in self.down:
                self.down.add(endpoint.name)
                log.warning(
                    "gateway %s (%s) not scraped, skipped while stale: %s",
                    endpoint.name,
                    url,
                    exc or type(exc).__name__,
                )
            return
        if endpoint.name in self.down:
            self.down.discard(endpoint.name)
            log.info("gateway %s scraped again", endpoint.name)
        self.latest[endpoint.name] = Snapshot(self.clock(), samples)

    def snapshots(self) -> dict[str, Snapshot | None]:
        """Each listed gateway's last good snapshot; None when missing or older than `stale_after_s`."""
        now = self.clock()
        out: dict[str, Snapshot | None] = {}
        for e in self.endpoints:
            snap = self.latest.get(e.name)
            out[e.name] = snap if snap is not None and now - snap.at <= self.cfg.stale_after_s else None
        return out
