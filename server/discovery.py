"""Where a pool's workers are: static URLs, simulated in-process workers, or Kubernetes.

Each source lists `Endpoint`s (name, url, ready, terminating); the registry re-lists every `resync_s`
and reconciles (new → added, gone → removed, terminating → draining, not ready → starting).

Kubernetes (`endpoints.kubernetes`, optional dependency `kubernetes`, extra `mosaic-serve[k8s]`):

- `resource: endpointslices` (default) lists `discovery.k8s.io/v1` EndpointSlices matching the label
  selector (e.g. `kubernetes.io/service-name=vllm-decode`). Per endpoint, conditions follow the API's
  contract: `ready` nil → ready; `terminating` nil → not terminating; a terminating endpoint is listed as
  draining (its in-flight streams finish; nothing new is routed to it) whether or not still `serving`.
- `resource: pods` lists pods by label selector: ready = the pod's `Ready` condition is `True` and it has
  an IP; terminating = `metadata.deletionTimestamp` is set; pods in phase Succeeded/Failed are skipped.

`port` is a number, or a port name looked up in the slice's `ports` (or the pod's container ports).

Network domain (`Endpoint.domain`, for the router's `pd-domain-affinity`): the value of the node label
`domain_label` (default `topology.kubernetes.io/zone`) on the worker's node. An EndpointSlice endpoint
carries that default label's value as its `zone` field, so the default needs no extra API call; another
label, or `resource: pods` (a pod has only `spec.nodeName`), lists the nodes (`list nodes` RBAC) and reads
the label from the endpoint's `nodeName`. A node listing that fails leaves those domains unknown (None).
Node listings are shared by every pool of the process (`NodeLabelCache`): only the nodes carrying the label
(a label selector), from the API server's watch cache (`resourceVersion=0`), at most once per
`NODE_LABELS_TTL_S`, plus once when a worker sits on a node the last listing did not show (a node just
added); with one listing per pool per resync, a GPU cluster's full node objects were fetched every few
seconds.
A static pool's domains come from the config (`static: [{url, domain}]`, else the pool's `domain:`).
The parsers take the API's JSON (camelCase, as `kubectl get -o json` prints it), so they are unit-tested
against recorded objects in `tests/gateway/fixtures/`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

from server.config import KubernetesSource

log = logging.getLogger("mosaic.discovery")
ZONE_LABEL = "topology.kubernetes.io/zone"  # the label EndpointSlice endpoints copy into `zone`
NodeLabels = Mapping[str, Mapping[str, str]]  # node name → its labels
NODE_LABELS_TTL_S = 300.0  # node labels (zone, rack) change rarely; new nodes are caught by the miss rule


class NodeLabelCache:
    """Labels of the nodes carrying a domain label, shared by the pools of one process (module docstring).

    `get(label, nodes, fetch)`: the cached listing while it is younger than `ttl_s` and shows every node in
    `nodes` (or the node was already missing from it: a node without the label stays unknown); else one
    `fetch()` (concurrent callers share it). A failed fetch falls back to the last listing, else raises; it
    is logged once per run of failures, and not retried for `retry_s` (every pool's resync would otherwise
    ask the API server again, as often as before the cache)."""

    def __init__(
        self,
        ttl_s: float = NODE_LABELS_TTL_S,
        retry_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._clock = clock
        self._listed: dict[str, tuple[float, dict[str, dict[str, str]], set[str]]] = {}  # at, labels, absent
        self._fetching: dict[str, asyncio.Future[dict[str, dict[str, str]]]] = {}
        self._failed: dict[str, tuple[float, Exception]] = {}  # label → (when, why) its last listing failed

    async def get(
        self, label: str, nodes: Iterable[str], fetch: Callable[[], Awaitable[dict[str, Any]]]
    ) -> NodeLabels:
        entry = self._listed.get(label)
        now = self._clock()
        if entry is not None:
            at, labels, absent = entry
            unseen = {n for n in nodes if n not in labels and n not in absent}
            if now - at < self.ttl_s and not unseen:
                return labels
        failed = self._failed.get(label)
        if failed is not None and now - failed[0] < self.retry_s:
            if entry is None:
                raise RuntimeError(f"listing nodes failed {now - failed[0]:.0f} s ago: {failed[1]}")
            return entry[1]
        pending = self._fetching.get(label)
        if pending is None:
            pending = self._fetching[label] = asyncio.ensure_future(self._list(label, fetch))
            pending.add_done_callback(lambda _: self._fetching.pop(label, None))
            pending.add_done_callback(_consume)  # retrieved even if every waiter was cancelled
        try:
            labels = await asyncio.shield(pending)
        except Exception:
            if entry is None:
                raise
            return entry[1]  # the last listing; `_list` logged the failure
        at, labels, absent = self._listed[label]
        absent.update(n for n in nodes if n not in labels)
        return labels

    async def _list(
        self, label: str, fetch: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, dict[str, str]]:
        try:
            labels = node_labels_from_list(await fetch())
        except Exception as exc:
            if label not in self._failed and label in self._listed:
                log.warning(
                    "listing nodes for domain label %s failed (%s): using the last listing", label, exc
                )
            self._failed[label] = (self._clock(), exc)
            raise
        if self._failed.pop(label, None) is not None and label in self._listed:
            log.info("listing nodes for domain label %s works again", label)
        self._listed[label] = (self._clock(), labels, set())
        return labels


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # stable within its pool: host:port, pod name, or replica index
    url: str
    ready: bool = True
    terminating: bool = False
    domain: str | None = None  # network domain of its node (rack / zone); None when unknown


class Source(Protocol):
    """A pool's endpoint source. `resync_s` None → listed once at start."""

    resync_s: float | None

    async def start(self) -> None: ...

    async def list(self) -> list[Endpoint]: ...

    async def stop(self) -> None: ...


class StaticSource:
    """Fixed URLs from the config; always listed as ready (health checks decide the rest)."""

    resync_s: float | None = None

    def __init__(self, urls: list[str], domains: Mapping[str, str] | None = None) -> None:
        self._endpoints = [Endpoint(_host_port(u), u, domain=(domains or {}).get(u)) for u in urls]

    async def start(self) -> None:
        return None

    async def list(self) -> list[Endpoint]:
        return list(self._endpoints)

    async def stop(self) -> None:
        return None


class TrackedSource:
    """A source that remembers whether it has ever listed successfully (the gateway's readiness: a gateway
    whose discovery never answered knows no workers, so it stays out of the Service until it has)."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.synced = False  # one successful list() so far
        self.last_error: str | None = None  # the latest list() failure, cleared by a success

    @property
    def resync_s(self) -> float | None:
        return self.inner.resync_s

    async def start(self) -> None:
        await self.inner.start()

    async def list(self) -> list[Endpoint]:
        try:
            endpoints = await self.inner.list()
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise
        self.synced, self.last_error = True, None
        return endpoints

    async def stop(self) -> None:
        await self.inner.stop()


def _host_port(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or url


# ---------------------------------------------------------------------------------------------- kubernetes


def node_labels_from_list(nodes: dict[str, Any]) -> dict[str, dict[str, str]]:
    """NodeList JSON → node name → labels."""
    out: dict[str, dict[str, str]] = {}
    for node in nodes.get("items") or []:
        meta = node.get("metadata") or {}
        if meta.get("name"):
            out[meta["name"]] = dict(meta.get("labels") or {})
    return out


def endpoint_domain(
    node_name: str | None, zone: str | None, domain_label: str | None, node_labels: NodeLabels | None
) -> str | None:
    """The `domain_label` value of the endpoint's node (module docstring): from the node's labels when
    listed, else the slice's `zone` when the label is the zone label, else None."""
    if domain_label is None:
        return None
    if node_labels is not None and node_name is not None and node_name in node_labels:
        return node_labels[node_name].get(domain_label)
    return zone if domain_label == ZONE_LABEL else None


def endpoints_from_slices(
    slices: dict[str, Any],
    port: int | str,
    scheme: str = "http",
    domain_label: str | None = ZONE_LABEL,
    node_labels: NodeLabels | None = None,
) -> list[Endpoint]:
    """EndpointSliceList JSON → endpoints, one per address (deduplicated across slices by address), and one
    per pod: a pod behind a dual-stack Service sits in an IPv4 and an IPv6 slice under one name, and is one
    worker (at its IPv4 address; terminating if either slice says so). Two endpoints of one name with two
    URLs made the registry rebuild that worker at every listing (state, in-flight counts, breaker lost)."""
    found: dict[str, Endpoint] = {}
    for item in slices.get("items") or []:
        if item.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue  # FQDN slices name hosts we cannot health-check reliably
        number = _slice_port(item.get("ports") or [], port)
        if number is None:
            continue
        for ep in item.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            ready = cond.get("ready") is not False  # nil → ready (API contract)
            terminating = cond.get("terminating") is True  # nil → not terminating
            ref = ep.get("targetRef") or {}
            domain = endpoint_domain(ep.get("nodeName"), ep.get("zone"), domain_label, node_labels)
            for addr in ep.get("addresses") or []:
                host = f"[{addr}]" if ":" in addr else addr
                name = ref.get("name") or addr
                key = f"{addr}:{number}"
                prev = found.get(key)
                endpoint = Endpoint(
                    name, f"{scheme}://{host}:{number}", ready and not terminating, terminating, domain
                )
                # The same address can sit in two slices during an update: prefer the terminating view.
                if prev is None or (terminating and not prev.terminating):
                    found[key] = endpoint
    by_name: dict[str, Endpoint] = {}
    for endpoint in sorted(found.values(), key=lambda e: ("[" in e.url, e.url)):  # IPv4 first
        prev = by_name.get(endpoint.name)
        if prev is None:
            by_name[endpoint.name] = endpoint
        elif endpoint.terminating and not prev.terminating:
            by_name[endpoint.name] = replace(prev, ready=False, terminating=True)
    return sorted(by_name.values(), key=lambda e: e.name)


def _slice_port(ports: list[dict[str, Any]], port: int | str) -> int | None:
    if isinstance(port, int):
        return port
    for p in ports:
        if p.get("name") == port and p.get("port") is not None:
            return int(p["port"])
    return None


def endpoints_from_pods(
    pods: dict[str, Any],
    port: int | str,
    scheme: str = "http",
    domain_label: str | None = ZONE_LABEL,
    node_labels: NodeLabels | None = None,
) -> list[Endpoint]:
    """PodList JSON → endpoints; see the module docstring for the ready / terminating and domain rules."""
    out: list[Endpoint] = []
    for pod in pods.get("items") or []:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            continue
        ip = status.get("podIP")
        number = port if isinstance(port, int) else _container_port(pod, port)
        if not ip or number is None:
            continue
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        terminating = meta.get("deletionTimestamp") is not None
        ready = conditions.get("Ready") == "True" and not terminating
        host = f"[{ip}]" if ":" in ip else ip
        node = (pod.get("spec") or {}).get("nodeName")
        domain = endpoint_domain(node, None, domain_label, node_labels)
        out.append(
            Endpoint(meta.get("name") or ip, f"{scheme}://{host}:{number}", ready, terminating, domain)
        )
    return sorted(out, key=lambda e: e.name)


def _container_port(pod: dict[str, Any], name: str) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == name and p.get("containerPort") is not None:
                return int(p["containerPort"])
    return None


# Kubernetes API deadlines. Every client call carries `_request_timeout=(connect, read)`, so a hung connection
# (an API server that accepted the socket and never answers, a dead NAT entry) raises in the client's thread
# instead of blocking it; the event loop's wait is bounded too (`call_timeout_s`), so a listing that hangs
# counts as a failed re-list: the registry keeps the last good view, logs, and tries again next resync.
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 20.0
_MARGIN_S = 5.0  # the loop waits this much longer than the client's own deadlines before giving up


class KubernetesDiscovery:
    """Lists EndpointSlices or pods through the official client (in a thread: the client is blocking).

    `lister` is injectable for tests: a callable (resource, namespace, label_selector) → API JSON dict.
    `request_timeout` is the client's (connect, read) deadline per API call; `call_timeout_s` bounds the
    loop's wait on the client thread (default: connect + read + 5 s). A listing that runs past it raises
    `TimeoutError`, and while that thread is still blocked no second one is started (the next listing fails
    at once), so a hung API server costs one thread, not one per resync.
    """

    def __init__(
        self,
        cfg: KubernetesSource,
        lister: Any | None = None,
        *,
        request_timeout: tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        call_timeout_s: float | None = None,
        nodes: NodeLabelCache | None = None,
    ) -> None:
        self._cfg = cfg
        self.resync_s: float | None = cfg.resync_s
        self._lister = lister
        self._nodes = nodes if nodes is not None else NodeLabelCache()  # the gateway passes its shared one
        self._nodes_warned = False  # a failing node listing is logged once, not every resync
        self.request_timeout = request_timeout
        self.call_timeout_s = (
            call_timeout_s if call_timeout_s is not None else sum(request_timeout) + _MARGIN_S
        )
        self._blocked: dict[
            str, asyncio.Future[Any]
        ] = {}  # resource → a client call that outlived call_timeout_s

    async def start(self) -> None:
        if self._lister is None:  # loading the config can run an exec credential plugin: bounded as well
            self._lister = await self._in_thread(
                "config", _official_lister, self._cfg.in_cluster, self.request_timeout
            )

    async def _in_thread(self, what: str, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in the default executor, waited on for at most `call_timeout_s` (class docstring)."""
        blocked = self._blocked.get(what)
        if blocked is not None and not blocked.done():
            raise TimeoutError(f"listing {what}: the previous Kubernetes API call is still blocked")
        future = asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args))
        try:
            # shield: on timeout the thread cannot be stopped; keep its future to know when it has ended.
            return await asyncio.wait_for(asyncio.shield(future), self.call_timeout_s)
        except TimeoutError:
            self._blocked[what] = future
            future.add_done_callback(_consume)  # a late result or error of an abandoned call: nobody waits
            raise TimeoutError(
                f"listing {what}: Kubernetes API call timed out after {self.call_timeout_s:g} s"
            ) from None

    async def list(self) -> list[Endpoint]:
        assert self._lister is not None, "start() first"
        cfg = self._cfg
        data = await self._in_thread(
            cfg.resource, self._lister, cfg.resource, cfg.namespace, cfg.label_selector
        )
        labels = await self._node_labels(_node_names(data, cfg.resource))
        if cfg.resource == "pods":
            return endpoints_from_pods(data, cfg.port, cfg.scheme, cfg.domain_label, labels)
        return endpoints_from_slices(data, cfg.port, cfg.scheme, cfg.domain_label, labels)

    async def _node_labels(self, nodes: set[str]) -> NodeLabels | None:
        """Node labels when the domain needs them (module docstring), else None; a failure → None, logged."""
        cfg = self._cfg
        label = cfg.domain_label
        if label is None or (cfg.resource == "endpointslices" and label == ZONE_LABEL):
            return None
        lister = self._lister
        assert lister is not None, "start() first"
        try:
            return await self._nodes.get(
                label, nodes, lambda: self._in_thread("nodes", lister, "nodes", "", label)
            )
        except (
            Exception
        ) as exc:  # e.g. 403 without `list nodes`: route without domains rather than not at all
            if not self._nodes_warned:
                log.warning(
                    "listing nodes for domain label %s failed (domains unknown): %s", cfg.domain_label, exc
                )
                self._nodes_warned = True
            return None

    async def stop(self) -> None:
        return None


def _node_names(data: dict[str, Any], resource: str) -> set[str]:
    """The nodes a listing's workers run on (EndpointSlice endpoints' or pods' `nodeName`)."""
    if resource == "pods":
        return {n for pod in data.get("items") or [] if (n := (pod.get("spec") or {}).get("nodeName"))}
    return {
        n for sl in data.get("items") or [] for ep in sl.get("endpoints") or [] if (n := ep.get("nodeName"))
    }


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: no "exception was never retrieved" warning for an abandoned call


class KubernetesUnavailable(RuntimeError):
    """The `kubernetes` package is missing or no cluster config could be loaded."""


def load_kubernetes_config(in_cluster: bool | None, needed_by: str = "kubernetes endpoints") -> Any:
    """Load the cluster config into the `kubernetes` client (in-cluster, ~/.kube/config, or in-cluster
    when available else ~/.kube/config for None) and return the client's `client` module;
    `KubernetesUnavailable` (one line) when the package is missing or no config loads."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubernetesUnavailable(
            f"{needed_by}: the 'kubernetes' package is not installed: pip install 'mosaic-serve[k8s]'"
        ) from None
    try:
        if in_cluster is True:
            config.load_incluster_config()
        elif in_cluster is False:
            config.load_kube_config()
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
    except Exception as exc:  # the client raises several unrelated types for a missing/bad kubeconfig
        raise KubernetesUnavailable(f"cannot load Kubernetes config for {needed_by}: {exc}") from None
    # No urllib3 retries: its default Retry(3) re-sent a call whose read timed out three more times, so one
    # call on a hung API server took 4 × its `_request_timeout` (80 s, not 20), blocking the controller's
    # cycle and the discovery thread that long. Every caller already retries at its own pace (the next
    # cycle, the next resync).
    configuration = client.Configuration.get_default_copy()
    configuration.retries = 0
    client.Configuration.set_default(configuration)
    return client


def _official_lister(
    in_cluster: bool | None, request_timeout: tuple[float, float] = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
) -> Any:
    client = load_kubernetes_config(in_cluster)
    api_client = client.ApiClient()
    return api_lister(client.CoreV1Api(api_client), client.DiscoveryV1Api(api_client), request_timeout)


def api_lister(core: Any, discovery: Any, request_timeout: tuple[float, float]) -> Any:
    """The lister over a `CoreV1Api` and a `DiscoveryV1Api` (tests hand it recording fakes)."""

    def lister(resource: str, namespace: str, selector: str) -> dict[str, Any]:
        # _preload_content=False: the raw API JSON, the same shape the recorded fixtures have.
        # _request_timeout: (connect, read) seconds, so a hung connection raises instead of blocking forever.
        opts: dict[str, Any] = {"_preload_content": False, "_request_timeout": request_timeout}
        resp: Any
        if resource == "nodes":  # cluster-scoped: the nodes carrying the domain label, from the API cache
            resp = core.list_node(label_selector=selector, resource_version="0", **opts)
        elif resource == "pods":
            resp = core.list_namespaced_pod(namespace, label_selector=selector, **opts)
        else:
            resp = discovery.list_namespaced_endpoint_slice(namespace, label_selector=selector, **opts)
        data: dict[str, Any] = json.loads(resp.data)  # a urllib3 response when _preload_content=False
        return data

    return lister
