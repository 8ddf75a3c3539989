"""`gateway.peers`: the gateway's own replicas, counted at run time, set each one's 1/N share of the workers' KV.

DESIGN's "Scaling the gateway out": each gateway process owns 1/N of every worker's KV, N "from config or
the Deployment's replica count". A fixed N is wrong whenever the number of running gateways differs from
it: a rolling update runs one pod more than the Deployment's replicas (Kubernetes' default surge), every
pod of them owning 1/N, so the fleet is over-committed for the rollout; and with the HPA, N had to be its
maxReplicas, so the pods usually running could never reserve more than current/max of the KV (2 of 6: a
third), and a request needing more than a worker's 1/6 was refused for good.

With `gateway.peers` each gateway lists its replicas through the Kubernetes API every `resync_s` (the
EndpointSlices of the gateway Service: every pod with an address, ready or not, and terminating ones while
they drain — they still hold reservations) and sets its share to 1/N_eff, where

    N_eff = the largest count listed within the last `grow_back_after_s` (at least 1)

so a new replica shrinks every share at the next listing, and a departed one gives its part back only
after the count has stayed lower for `grow_back_after_s` (listings that flap, a pod between its
deletion and its drain). A smaller share never takes back what is reserved: new reservations wait until
the process's own fall below it. A listing that fails, or that does not list any replica (this one must be
among them), changes nothing: the share stays as it was (`gateway.replicas` until the first listing, which
`start` makes before the gateway serves). A listing without this replica's pod (`HOSTNAME`, which Kubernetes sets to the
pod's name: an EndpointSlice not yet updated for a pod that just started) counts it too. `kv.share` (a fixed
share) and `gateway.peers` exclude each other.

Metrics: `mosaic_gateway_peers` (replicas in the last good listing), `mosaic_kv_share` (the share in effect).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Gauge

from server.config import GatewayPeersConfig
from server.discovery import Endpoint, KubernetesDiscovery

log = logging.getLogger("mosaic.gateway.peers")
# A request fitting the share of the fewest replicas listed within this long is not refused for good while
# more are listed (a rollout's surge replica): it waits in the admission queue instead.
CEILING_WINDOW_S = 600.0


class PeerWindow:
    """N_eff: the largest replica count observed within the last `window_s` (pure: time comes in); with
    `pick=min`, the smallest (the share ceiling's N)."""

    def __init__(self, window_s: float, initial: int, pick: Callable[[Iterable[int]], int] = max) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, int]] = deque()
        self._initial = max(1, initial)
        self._pick = pick

    def observe(self, count: int, now: float) -> int:
        self._seen.append((now, max(1, count)))
        while len(self._seen) > 1 and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()
        return self.current

    @property
    def current(self) -> int:
        return self._pick((n for _, n in self._seen), default=self._initial)  # type: ignore[call-arg]


class ShareTarget(Protocol):
    def set_share(self, share: float, ceiling: float | None = None) -> None: ...


class Lister(Protocol):
    async def start(self) -> None: ...

    async def list(self) -> list[Endpoint]: ...


class GatewayPeers:
    """Lists the replicas every `resync_s` and sets the ledger's share (module docstring)."""

    def __init__(
        self,
        cfg: GatewayPeersConfig,
        ledger: ShareTarget,
        initial_replicas: int,
        registry: CollectorRegistry,
        clock: Callable[[], float],
        lister: Lister | None = None,
        own_name: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.clock = clock
        self.window = PeerWindow(cfg.grow_back_after_s, initial_replicas)
        # the fewest replicas listed lately: what a request is measured against before it is refused for good
        self.fewest = PeerWindow(CEILING_WINDOW_S, initial_replicas, pick=min)
        self.lister: Lister = lister if lister is not None else KubernetesDiscovery(cfg.kubernetes)
        self.listed: int | None = None  # replicas in the last good listing
        # this replica's pod name (Kubernetes sets HOSTNAME to it): a listing that misses it (the EndpointSlice
        # not updated yet for a pod that just started) counts it anyway, or its first share would be too big
        self.own_name = own_name if own_name is not None else os.environ.get("HOSTNAME")
        self._failing = False  # a failing listing is logged once per run of failures
        self._started = False
        self._task: asyncio.Task[Any] | None = None
        self._peers = Gauge(
            "mosaic_gateway_peers",
            "Gateway replicas in the last good listing (gateway.peers)",
            registry=registry,
        )
        self._share = Gauge(
            "mosaic_kv_share", "This gateway's share of every worker's KV (1/N_eff)", registry=registry
        )
        self._share.set(1.0 / self.window.current)

    async def start(self) -> None:
        """List once (before the gateway serves), then every `resync_s`."""
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="gateway-peers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.kubernetes.resync_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            if not self._started:  # e.g. no cluster config yet: serve with the share in effect, keep trying
                await self.lister.start()
                self._started = True
            endpoints = await self.lister.list()
        except Exception as exc:
            self._failed(exc)
            return
        if not endpoints:  # this replica at least must be listed: an empty listing is a wrong one
            self._failed(RuntimeError("the listing holds no gateway replica (not even this one)"))
            return
        if self._failing:
            log.info("listing gateway replicas works again")
            self._failing = False
        names = {e.name for e in endpoints}
        self.listed = len(names) + (1 if self.own_name and self.own_name not in names else 0)
        now = self.clock()
        n = self.window.observe(self.listed, now)
        fewest = self.fewest.observe(self.listed, now)
        self._peers.set(self.listed)
        self._share.set(1.0 / n)
        self.ledger.set_share(1.0 / n, 1.0 / fewest)

    def _failed(self, exc: BaseException) -> None:
        if not self._failing:
            log.warning("listing gateway replicas failed (KV share stays 1/%d): %s", self.window.current, exc)
            self._failing = True
