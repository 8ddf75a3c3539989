"""Kubernetes actuator: each pool is a Deployment, or one Deployment per network domain; scaling patches the
`scale` subresource.

RBAC it needs, in the release namespace only (the Helm chart's controller Role):
`apps/deployments/scale: get, patch` (and `pods`, `discovery.k8s.io/endpointslices: list` for discovery).
Scale-in is soft because the gateway stops routing to terminating endpoints at once and the chart gives
vLLM pods a preStop drain, a termination grace period and vLLM's `--shutdown-timeout` for the rest of it
(without that flag vLLM aborts running requests on SIGTERM), so in-flight streams finish.

**A pool with one Deployment per domain** (`domains`: pool → {domain → Deployment}; the chart's
`pools[].domains` renders them, each pinned by `nodeSelector` to its domain's nodes) is scaled as the sum
of its Deployments, and the actuator decides which Deployment changes:

- *scale-up*: with a node inventory (`placer`, the controller's `TopologyPlacer`) the actuator *places*
  (`places(pool)`): the controller hands it the (node, domain) the topology solver chose for each new
  instance (`assign_nodes`), and each new replica is added to the Deployment of its node's domain, so the
  prefill and decode instances of one decision land in one domain's Deployments. Instances without a
  handed-over node are placed alone (`TopologyPlacer.place`), and refused when the inventory has no room
  (the action says so). Without an inventory, each new replica goes to the domain with the fewest
  replicas (ties: domain name order).
- *scale-in*: one replica at a time from the domain of the instance `TopologyPlacer.removal_order` ranks
  first (most cross-domain P/D pairs first, then the node whose fragmentation improves most), re-ranked
  after each; replicas the inventory could not hold (`unplaced`) go first. Without an inventory, from the
  domain with the most replicas (ties: the last by name).
- The placer's record of the pool is reconciled with the Deployments' replica counts at every read
  (`replicas`), so a Deployment scaled by hand, or the replicas running at startup, are placed on their
  domain's nodes (best fit: the fullest node of the pool's GPU type with room). Instances are slots
  `pool@domain#n`; Kubernetes chooses the node inside the domain, so the node is the model's, the domain
  is the cluster's.

The result is a `PlacedScaleAction`: `ScaleAction`'s fields for the pool's total, plus one `DomainScale`
per Deployment patched. A failed read or patch is reported (`applied=False`, `error`), never raised; the
next cycle reads the counts again and retries.

Pools with one Deployment: the scale subresource sets a count and cannot choose nodes, so the controller
keeps the placement it computed as advice (docs/autoscaling-live.md).

**Another scaler on the same Deployment** (an HPA, KEDA, `kubectl scale`): the patch is an absolute
merge-patch of `spec.replicas`, so it silently overwrites whatever the other one set, and the two undo
each other. The actuator cannot prevent that; it logs a warning (logger `mosaic.autoscaler`) when a
freshly read count differs from what the decision was based on (the count `replicas` returned this cycle)
or from what it last set. Do not point an HPA at a Deployment this actuator manages.

The `kubernetes` client is an optional extra (`pip install mosaic-serve[k8s]`); the API object is injected
so tests can record the exact calls against canned API responses. No other I/O here. Every call carries
`_request_timeout=(connect, read)` (`request_timeout`, default 5 s / 20 s): a hung API connection fails the
read or patch, which is reported like any API error, instead of blocking the controller's cycle forever.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.actuators.base import ActuatorCallFailed, ScaleAction, api_error_text
from scheduler.topology import TopologyPlacer

REQUEST_TIMEOUT_S = (5.0, 20.0)  # (connect, read) seconds per API call
FIELD_MANAGER = "mosaic-autoscaler"  # the managedFields entry of the replicas it sets
log = logging.getLogger("mosaic.autoscaler")


@dataclass(frozen=True, slots=True)
class DomainScale:
    """One Deployment of a pool with per-domain Deployments, as one scale call changed it."""

    domain: str
    deployment: str
    before: int
    after: int  # = before when the patch failed
    error: str | None = None


@dataclass(frozen=True, slots=True)
class PlacedScaleAction(ScaleAction):
    """A per-domain pool's scale: `before`/`after` are the pool's totals; `domains` the Deployments patched."""

    domains: tuple[DomainScale, ...] = ()


class KubernetesActuator:
    def __init__(
        self,
        apps_api: Any,
        namespace: str,
        deployments: Mapping[str, str],
        domains: Mapping[str, Mapping[str, str]] | None = None,
        placer: TopologyPlacer | None = None,
        request_timeout: tuple[float, float] = REQUEST_TIMEOUT_S,
    ) -> None:
        """`apps_api` is a `kubernetes.client.AppsV1Api`; `deployments` maps pool name → Deployment name;
        `domains` maps pool → {domain → Deployment} (module docstring); `placer` the controller's, with
        `autoscaler.nodes`; `request_timeout` the (connect, read) deadline of each API call."""
        self._api = apps_api
        self._timeout = request_timeout
        self._namespace = namespace
        self._deployments = dict(deployments)
        self._domains = {pool: dict(sorted(by.items())) for pool, by in (domains or {}).items()}
        both = sorted(set(self._deployments) & set(self._domains))
        if both:
            raise ValueError(f"pools {both} have both one Deployment and per-domain Deployments")
        self._placer = placer
        self._next: dict[str, deque[tuple[str, str]]] = {pool: deque() for pool in self._domains}
        self._seq = 0
        self.unplaced: dict[str, int] = {}  # pool → replicas the inventory has no room for (last read)
        self._based_on: dict[str, int] = {}  # pool → the count `replicas` returned (the decision's basis)
        self._set: dict[str, int] = {}  # pool → the count this actuator last set

    def _deployment(self, pool: str) -> str:
        try:
            return self._deployments[pool]
        except KeyError:
            raise KeyError(f"pool {pool!r} has no Deployment configured") from None

    def _failed(self, verb: str, name: str, exc: Exception, to: str = "") -> ActuatorCallFailed:
        return ActuatorCallFailed(
            f"{verb} deployments/{name}/scale in namespace {self._namespace}{to}: {api_error_text(exc)}"
        )

    def _read(self, name: str) -> int:
        try:
            scale = self._api.read_namespaced_deployment_scale(
                name, self._namespace, _request_timeout=self._timeout
            )
        except Exception as exc:  # ApiException, transport errors: say which Deployment, and the API's why
            raise self._failed("reading", name, exc) from exc
        return int(scale.spec.replicas or 0)

    def _patch(self, name: str, replicas: int) -> None:
        # Our own field manager: GitOps tools can then leave exactly the replicas we own alone (Argo CD's
        # ignoreDifferences.managedFieldsManagers), and `kubectl get -o yaml --show-managed-fields` says who set them.
        try:
            self._api.patch_namespaced_deployment_scale(
                name,
                self._namespace,
                {"spec": {"replicas": replicas}},
                field_manager=FIELD_MANAGER,
                _request_timeout=self._timeout,
            )
        except Exception as exc:
            raise self._failed("patching", name, exc, f" to {replicas} replicas") from exc

    # ------------------------------------------------------------------ the Actuator shape
    def replicas(self, pool: str) -> int:
        if pool in self._domains:
            counts = {d: self._read(name) for d, name in self._domains[pool].items()}
            self._sync(pool, counts)
            total = sum(counts.values())
        else:
            total = self._read(self._deployment(pool))
        last = self._set.get(pool)
        if last is not None and total != last:
            log.warning(
                "autoscaler: pool %s: its Deployment holds %d replicas, the autoscaler last set %d: something "
                "else scales it (an HPA, kubectl scale?); the next patch overwrites it",
                pool,
                total,
                last,
            )
        self._set.pop(pool, None)  # warned once per change
        self._based_on[pool] = total
        return total

    def _drift(self, pool: str, fresh: int, replicas: int) -> None:
        """Warn when the count read just before patching is not the one the decision was based on."""
        based = self._based_on.pop(pool, None)
        if based is not None and fresh != based:
            log.warning(
                "autoscaler: pool %s: its Deployment changed from %d to %d since this cycle's read (another "
                "scaler on it?); patching it to %d overwrites that",
                pool,
                based,
                fresh,
                replicas,
            )

    def scale(self, pool: str, replicas: int, now: float) -> ScaleAction:
        if replicas < 0:
            raise ValueError(f"replicas must be ≥ 0, got {replicas}")
        if pool in self._domains:
            return self._scale_domains(pool, replicas, now)
        name = self._deployment(pool)
        before = -1
        try:
            before = self._read(name)
            self._drift(pool, before, replicas)
            if before != replicas:
                self._patch(name, replicas)
        except Exception as exc:  # ApiException and transport errors: report, the next cycle retries
            return ScaleAction(now, pool, before, before, applied=False, error=api_error_text(exc))
        self._set[pool] = replicas
        return ScaleAction(now, pool, before, replicas, applied=True)

    # ------------------------------------------------------------------ topology (placing actuator)
    def places(self, pool: str) -> bool:
        """Whether the controller hands this actuator the nodes of `pool`'s new instances."""
        return self._placer is not None and pool in self._domains

    def assign_nodes(self, pool: str, nodes: Sequence[tuple[str, str]]) -> None:
        """The next replicas `pool` adds go to these (node, domain)s, in order (used by the next `scale`)."""
        self._next[pool].extend(nodes)

    # ------------------------------------------------------------------ per-domain Deployments
    def _scale_domains(self, pool: str, replicas: int, now: float) -> PlacedScaleAction:
        handed, self._next[pool] = list(self._next[pool]), deque()  # used by this call only
        by_domain = self._domains[pool]
        try:
            counts = {d: self._read(name) for d, name in by_domain.items()}
        except Exception as exc:
            return PlacedScaleAction(now, pool, -1, -1, applied=False, error=api_error_text(exc))
        self._sync(pool, counts)
        before = sum(counts.values())
        self._drift(pool, before, replicas)
        want = dict(counts)
        # what to undo per domain if its patch fails: slots placed for new replicas, (slot, node)s released
        adds: dict[str, list[str | None]] = {d: [] for d in by_domain}
        drops: dict[str, list[tuple[str, str] | None]] = {d: [] for d in by_domain}
        refused = None
        if replicas > before:
            picks, refused = self._up(pool, counts, replicas - before, handed)
            for domain, slot in picks:
                want[domain] += 1
                adds[domain].append(slot)
        elif replicas < before:
            for domain, slot in self._down(pool, counts, before - replicas):
                want[domain] -= 1
                drops[domain].append(slot)
        steps, error = [], refused
        for domain, name in by_domain.items():
            if want[domain] == counts[domain]:
                continue
            try:
                self._patch(name, want[domain])
            except Exception as exc:
                steps.append(DomainScale(domain, name, counts[domain], counts[domain], api_error_text(exc)))
                error = error or api_error_text(exc)
                self._undo(pool, adds[domain], drops[domain])
                continue
            steps.append(DomainScale(domain, name, counts[domain], want[domain]))
        after = before + sum(s.after - s.before for s in steps)
        failed = any(s.error for s in steps) or (refused is not None and after == before)
        self._set[pool] = after
        return PlacedScaleAction(now, pool, before, after, not failed, error, tuple(steps))

    def _up(
        self, pool: str, counts: Mapping[str, int], n: int, handed: Sequence[tuple[str, str]]
    ) -> tuple[list[tuple[str, str | None]], str | None]:
        """(domain, slot placed or None) for up to `n` new replicas; and why some were refused (no room).
        Slots are placed now, so replicas placed alone see the handed ones; `_undo` if the patch fails."""
        placer = self._placer
        picks: list[tuple[str, str | None]] = []
        if placer is None:  # no inventory: balance, the fewest replicas first (ties by name)
            load = dict(counts)
            for _ in range(n):
                domain = min(load, key=lambda d: (load[d], d))
                load[domain] += 1
                picks.append((domain, None))
            return picks, None
        for node, domain in handed:
            if len(picks) == n or domain not in counts:
                continue
            slot = self._slot(pool, domain)
            try:
                placer.assign(slot, pool, node)
            except ValueError:  # the node filled up since the decision: this one is placed alone below
                continue
            picks.append((domain, slot))
        missing = n - len(picks)
        if missing <= 0:
            return picks, None
        placed = placer.place({pool: missing})
        for node, domain in placed.nodes.get(pool, ()):
            if domain in counts:  # the solver may use any domain with the GPUs: only mapped ones count
                slot = self._slot(pool, domain)
                placer.assign(slot, pool, node)
                picks.append((domain, slot))
        short = n - len(picks)
        why = placed.explanation or "no node in the pool's domains"
        return picks, f"the node inventory has no room for {short} of {n} replicas: {why}" if short else None

    def _down(self, pool: str, counts: Mapping[str, int], n: int) -> list[tuple[str, tuple[str, str] | None]]:
        """(domain, (slot, node) released or None) for `n` replicas to remove (module docstring)."""
        placer = self._placer
        left = dict(counts)
        out: list[tuple[str, tuple[str, str] | None]] = []
        overflow = dict(self._overflow(pool, counts)) if placer is not None else {}
        for _ in range(n):
            spill = [d for d, k in overflow.items() if k > 0]
            if placer is not None and spill:  # replicas the inventory could not hold go first
                domain = max(spill, key=lambda d: (overflow[d], d))
                overflow[domain] -= 1
                out.append((domain, None))
            elif placer is not None:
                slots = [i for i in placer.instances(pool) if placer.domain_of(i) in left]
                if not slots:
                    break
                slot = placer.removal_order(slots)[0]
                node = placer.node_of(slot)
                domain = placer.domain_of(slot)
                assert node is not None and domain is not None
                placer.release(slot)  # re-ranked with it gone; put back if the patch fails
                out.append((domain, (slot, node)))
            else:
                domain = max((d for d in left if left[d] > 0), key=lambda d: (left[d], d))
                out.append((domain, None))
            left[out[-1][0]] -= 1
        return out

    def _undo(self, pool: str, adds: Sequence[str | None], drops: Sequence[tuple[str, str] | None]) -> None:
        """A domain's patch failed: free the slots placed for its new replicas, put its removed ones back."""
        if self._placer is None:
            return
        for slot in adds:
            if slot is not None:
                self._placer.release(slot)
        for dropped in drops:
            if dropped is not None:
                self._placer.assign(dropped[0], pool, dropped[1])

    def _slot(self, pool: str, domain: str) -> str:
        self._seq += 1
        return f"{pool}@{domain}#{self._seq}"

    def _overflow(self, pool: str, counts: Mapping[str, int]) -> dict[str, int]:
        """Per domain: replicas beyond the slots placed there (the inventory had no room for them)."""
        assert self._placer is not None
        placed = dict.fromkeys(counts, 0)
        for slot in self._placer.instances(pool):
            domain = self._placer.domain_of(slot)
            if domain in placed:
                placed[domain] += 1
        return {d: max(0, counts[d] - placed[d]) for d in counts}

    def _sync(self, pool: str, counts: Mapping[str, int]) -> None:
        """Make the placer's slots of `pool` match the Deployments' counts, domain by domain."""
        placer = self._placer
        if placer is None:
            return
        kind = placer.kinds[pool]
        for domain, count in counts.items():
            slots = [i for i in placer.instances(pool) if placer.domain_of(i) == domain]
            for slot in placer.removal_order(slots)[: max(0, len(slots) - count)]:
                placer.release(slot)
            for _ in range(count - len(slots)):
                fits = [
                    n
                    for n in placer.free_nodes()
                    if n.domain == domain and n.gpu == kind.gpu and n.free >= kind.gpus
                ]
                if not fits:
                    break
                node = min(fits, key=lambda n: n.free)  # best fit; min keeps inventory order on ties
                placer.assign(self._slot(pool, domain), pool, node.name)
        self.unplaced[pool] = sum(self._overflow(pool, counts).values())
