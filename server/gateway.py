"""`Gateway`: every long-lived object of one gateway process, built from a `MosaicConfig` in one place.

Nothing here is global: `create_app(config)` builds one `Gateway`, the app's lifespan starts and stops
it, and tests build as many as they like side by side. Injection points for tests: `transport` (an
`httpx` transport used for every upstream call, e.g. `httpx.MockTransport`), `sources` (a pool's
discovery source by pool name), `reserve` (extra Reserve plugins for the router) and `clock`.

The KV ledger (`scheduler.kv`, built from the `kv:` section unless `kv.enabled: false`) is the first
Reserve plugin: every dispatch reserves the request's KV footprint on its worker(s) and the request's
`Lease` releases it exactly once. After each scrape round the gateway sweeps expired leases and
reconciles reservations with the KV usage workers report. With the ledger, the `mosaic` routing policy
also scores `kv-best-fit` (`server.kv_setup.routing_with_kv`) and the admission queue backfills, ages and
optionally batch-plans its waiters (`server.kv_admission.KvQueuePolicy`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from scheduler.fleet import Role, WorkerState, capacity_for
from scheduler.kv.config import KvConfigError
from scheduler.kv.ledger import KvLedger
from scheduler.length_predictor import LengthPredictor
from scheduler.routing.config import build_router
from scheduler.routing.framework import Decision, ReservePlugin
from scheduler.routing.reasons import FilterReason, Reject
from server.admission import AdmissionQueue, RejectLike
from server.auth import KeyStore, RateLimiter
from server.autoscaler_setup import in_process, in_process_controller
from server.autoscaling import AutoscalerController
from server.config import ConfigError, MosaicConfig, PoolConfig
from server.discovery import KubernetesDiscovery, NodeLabelCache, Source, StaticSource, TrackedSource
from server.dispatch import Dispatcher, worker_auth_headers
from server.embedded_actuator import OpenDecisions
from server.footprint import AdapterResolver
from server.kv_admission import KvQueuePolicy
from server.kv_setup import build_gateway_ledger, routing_with_kv
from server.lora_admin import LoraAdmin
from server.metrics import GatewayMetrics
from server.peers import GatewayPeers
from server.proxy import Upstream
from server.registry import PoolInfo, Registry, WorkerRecord

SHUTDOWN_MARGIN_S = 0.5  # in-flight requests are ended this long before the shutdown grace runs out

log = logging.getLogger("mosaic.gateway")


# a request queued for these waits for a worker that does not exist yet: only a decision can bring it
WAKING_REASONS = frozenset({FilterReason.EMPTY_POOL, FilterReason.NO_WORKERS})


def stays_empty(pool: PoolConfig, config: MosaicConfig) -> bool:
    """The pool has no worker and never will in this process: an empty `static` list, or a simulated or
    launched pool started at zero replicas that no in-process embedded autoscaler manages. A request only
    it could serve is then refused at once (as `max_replicas: 0`, and as the cluster simulator without a
    policy) instead of being held until the queue deadline for a worker that cannot come. Kubernetes pools
    are always waited for: their Deployment may be scaled from outside (`mosaic autoscale`, KEDA, kubectl)."""
    ep = pool.endpoints
    if ep.static is not None:
        return not ep.static
    start = ep.simulated.replicas if ep.simulated is not None else ep.launch.replicas if ep.launch else None
    if start is None or start > 0:
        return False
    return not (config.autoscaler.enabled and config.autoscaler.actuator == "embedded")


class Gateway:
    def __init__(
        self,
        config: MosaicConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        sources: Mapping[str, Source] | None = None,
        reserve: Sequence[ReservePlugin] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.started_at = int(time.time())
        self._shutdown_timer: asyncio.TimerHandle | None = None
        self.metrics = GatewayMetrics()
        self.keys = KeyStore(config.auth)
        self.limiter = RateLimiter(config.limits.rate_limit)
        probe_client = httpx.AsyncClient(transport=transport) if transport is not None else None
        self.registry = Registry(
            config.scrape,
            config.health,
            self.metrics,
            client=probe_client,
            clock=clock,
            auth=worker_auth_headers(config),
        )
        self._node_labels = NodeLabelCache()  # node listings shared by the Kubernetes-discovered pools
        self._own_probe_client = probe_client
        catalog = load_catalog(config.catalog)
        self.max_model_len: dict[str, int] = {}
        self.sources: dict[str, Source] = {}  # by pool name (the embedded autoscaler scales simulated ones)
        self.discovery: dict[
            str, TrackedSource
        ] = {}  # by pool name: has its listing ever succeeded (readiness)
        self._gpu_allocator: Any = None  # server.vllm_pool.GpuAllocator, built when a pool has `launch`
        for pool in config.pools:
            info = self._pool_info(pool, catalog)
            self.max_model_len.setdefault(pool.model, info.capacity.max_model_len or 0)
            source = self.sources[pool.name] = (sources or {}).get(pool.name) or self._source(pool)
            tracked = self.discovery[pool.name] = TrackedSource(source)
            waited_for = pool.max_replicas != 0 and not (
                (sources is None or pool.name not in sources) and stays_empty(pool, config)
            )
            if pool.max_replicas != 0 and not waited_for:
                log.warning(
                    "pool %s starts with no worker and nothing adds one (no autoscaler manages it): "
                    "requests only it could serve are refused at once",
                    pool.name,
                )
            self.registry.add_pool(info, tracked, waited_for=waited_for)
        self.models: tuple[str, ...] = tuple(self.registry.models())
        # models whose pools run vLLM's pooling runner: embeddings, score and rerank only (config: one runner
        # per model)
        self.pooling_models = frozenset(p.model for p in config.pools if p.runner == "pooling")
        self.registry.on_context = self._note_served_context
        # `models[].lora_resolver`: unknown names are adapters of that model (server.footprint.AdapterResolver)
        resolving = config.lora_resolver_model
        self.adapter_resolver = (
            AdapterResolver(resolving, frozenset(self.models)) if resolving is not None else None
        )
        # /v1/load_lora_adapter and /v1/unload_lora_adapter for the whole fleet, and their reconcile
        self.lora_admin = LoraAdmin(
            self.registry,
            config.lora,
            self.models,
            self.metrics,
            clock,
            retry_min_s=config.scrape.models_interval_s,
            max_body_bytes=config.limits.max_body_bytes,
            authenticate_admin=self.keys.authenticate_admin,
            draining=lambda: self.draining,
        )
        self.registry.on_adapters = self.lora_admin.reconcile
        try:
            self.ledger: KvLedger | None = build_gateway_ledger(
                config.kv,
                config.gateway.replicas,
                config.source_dir,
                {p.name: (p.model, p.tp) for p in config.pools},
            )
        except KvConfigError as exc:
            raise ConfigError(str(exc)) from None
        # The output-length predictor the ledger sizes `predicted` reservations with; fed at completion.
        self.predictor: LengthPredictor | None = self.ledger.predictor if self.ledger is not None else None
        plugins: list[ReservePlugin] = [self.ledger] if self.ledger is not None else []
        # The in-process autoscaler's soft scale-in waits for routing decisions still open on a draining worker.
        self.open_decisions = (
            OpenDecisions() if in_process(config) and config.autoscaler.actuator == "embedded" else None
        )
        if self.open_decisions is not None:
            plugins.append(self.open_decisions)
        # With the ledger, the `mosaic` policy also scores best fit on remaining KV (`kv-best-fit`).
        routing = routing_with_kv(config.routing) if self.ledger is not None else config.routing
        self.router = build_router(routing, reserve=[*plugins, *reserve])
        self.kv_queue: KvQueuePolicy | None = None
        if self.ledger is not None:  # backfill + aging holds (+ the batch tick) in the admission queue
            rng = random.Random(config.routing.seed)
            self.kv_queue = KvQueuePolicy(
                config.kv,
                self.ledger,
                self.registry.view,
                lambda req, exclude: self.router.route(req, self.registry.view(), self.clock(), rng, exclude),
                clock,
            )
        self.admission: AdmissionQueue[Decision] = AdmissionQueue(
            config.limits.queue_size,
            config.limits.queue_deadline_s,
            is_reject=lambda r: isinstance(r, Reject),
            clock=clock,
            policy=self.kv_queue,
        )
        self.registry.on_refresh.append(self._kv_tick)
        self.registry.on_refresh.append(self.admission.notify_all)
        self.metrics.attach_live(
            self.registry.gauge_rows,
            self.admission.depths,
            self.ledger.snapshot if self.ledger is not None else None,
        )
        if (kv_queue := self.kv_queue) is not None:
            self.metrics.attach_kv_queue(lambda: kv_queue.stats)
        if (ledger := self.ledger) is not None:
            self.metrics.attach_kv_ledger(lambda: ledger.stats)
        self.upstream = Upstream(config.limits, transport)
        if config.health.sever_silent_requests and transport is None:
            self.registry.on_unhealthy = self._sever_silent
        self.dispatcher = Dispatcher(
            config,
            self.registry,
            self.router,
            self.admission,
            self.upstream,
            self.metrics,
            self.limiter,
            clock,
            self.predictor,
            self.max_model_len,
        )
        # `gateway.peers`: the KV share follows the gateway replicas listed at run time (server.peers)
        self.peers: GatewayPeers | None = None
        if config.gateway.peers is not None and self.ledger is not None:
            self.peers = GatewayPeers(
                config.gateway.peers, self.ledger, config.gateway.replicas, self.metrics.registry, clock
            )
        # `autoscaler.enabled` with the embedded or dry-run actuator: the controller runs in this process.
        if config.autoscaler.enabled and not in_process(config):
            # every gateway replica of the Helm chart with its controller on reads such a config (INFO there);
            # without a Kubernetes pool nothing would ever scale these pools: a mistake worth a WARNING
            on_kubernetes = any(p.endpoints.kubernetes is not None for p in config.pools)
            log.log(
                logging.INFO if on_kubernetes else logging.WARNING,
                "autoscaler.actuator %s runs in `mosaic autoscale` (the Helm chart's controller), not in this "
                "gateway: this process does not scale the pools",
                config.autoscaler.actuator,
            )
        self.autoscaler: AutoscalerController | None = (
            in_process_controller(self) if in_process(config) else None
        )
        if self.autoscaler is not None:
            self.admission.on_queued = self._wake_autoscaler

    def _note_served_context(self, model: str) -> None:
        """A worker's /v1/models gave its context limit (vLLM's --max-model-len): the model's limit is the largest
        one its workers serve, for /v1/models and chat's default output length (the rest of the context),
        instead of the config's or the catalog's (a Llama-3.1 pool is 128k by the catalog, often served at 8k)."""
        served = self.registry.served_context(model)
        if served is not None:
            self.max_model_len[model] = served

    def _wake_autoscaler(self, model: str, reject: RejectLike) -> None:
        """A request waits for a pool with no worker (scaled to zero): decide now, not at the interval's end."""
        if self.autoscaler is not None and getattr(reject, "primary", None) in WAKING_REASONS:
            self.autoscaler.wake()

    def _sever_silent(self, rec: WorkerRecord) -> None:
        """`health.sever_silent_requests`: the unhealthy worker's connections that got no byte for the
        health checks' detection window (`failure_threshold` × `interval_s`) are closed, so their requests end
        now (retried elsewhere before their first byte, an error event after it) instead of at their
        first-token or stall timeouts; ones still receiving bytes are left alone. Not while a scrape within
        the window saw its token counters move (an engine that works, behind a `/health` slow under load: its
        whole answers and queued requests send nothing until they are done), nor when another worker that
        is not unhealthy shares its host:port (pools behind one path-routing address share connections)."""
        health = self.config.health
        window = health.failure_threshold * health.interval_s
        if rec.progress_at is not None and self.clock() - rec.progress_at < window:
            return
        pool = self.upstream.pool
        try:
            origin = pool.origin_key(rec.url)
        except httpx.UnsupportedProtocol:  # no connection of the pool's could be its
            return
        for other in self.registry.records():
            if other is not rec and other.health_ok is not False and pool.origin_key(other.url) == origin:
                return
        severed = pool.sever_silent(
            rec.url,
            window,
            f"worker {rec.id} fails its health checks and sent nothing for {window:g} s",
        )
        if severed:
            log.warning(
                "worker %s fails its health checks: closed %d connection(s) silent for %g s or more",
                rec.id,
                severed,
                window,
            )

    def _kv_tick(self) -> None:
        """After each scrape round: expire lost reservations, then reconcile against reported KV usage."""
        if self.ledger is not None:
            now = self.clock()
            self.ledger.sweep(now)
            self.ledger.reconcile(self.registry.view(), now)

    def _pool_info(self, pool: PoolConfig, catalog: Any) -> PoolInfo:
        model_cfg = self.config.model_config_for(pool.model)
        capacity = capacity_for(
            pool.gpu,
            model_cfg.spec_name,
            pool.tp,
            catalog,
            max_num_seqs=pool.max_num_seqs,
            block_size=pool.block_size,
            gpu_memory_utilization=pool.gpu_memory_utilization,
            max_model_len=model_cfg.max_model_len,
            cost_per_hour=pool.cost_per_hour,
            dp=pool.dp,
        )
        return PoolInfo(
            pool.name,
            pool.model,
            catalog.gpu(pool.gpu).name,
            Role(pool.role),
            capacity,
            pool.domain,
            model_cfg.lora_resolver,
            self._stuck_window(pool, catalog, model_cfg.spec_name),
            pooling=pool.runner == "pooling",
        )

    def _stuck_window(
        self, pool: PoolConfig, catalog: Any, spec_name: str
    ) -> Callable[[int | None], float] | None:
        """`PoolInfo.stuck_window`: for a worker serving a context of n tokens, `health.stuck_engine_s` or
        twice the perf model's prefill of an n-token prompt when that is longer (a step that prefills a whole
        prompt, chunked prefill off, reports only at its end), in wall seconds for a simulated pool slower
        than real time. None when `stuck_engine_s` is off."""
        base = self.config.health.stuck_engine_s
        if base is None:
            return None
        perf = PerfModel(catalog.gpu(pool.gpu), catalog.model(spec_name), pool.tp)
        simulated = pool.endpoints.simulated
        slowdown = 1 / simulated.time_scale if simulated is not None and simulated.time_scale < 1 else 1.0

        @functools.lru_cache(maxsize=16)
        def window(context: int | None) -> float:
            prefill = perf.prefill_time([context]) if context else 0.0
            return max(base, 2 * prefill) * slowdown

        return window

    def _source(self, pool: PoolConfig) -> Source:
        ep = pool.endpoints
        if ep.static is not None:
            return StaticSource(ep.static, ep.static_domains)
        if ep.kubernetes is not None:  # one node listing for all pools (discovery's NodeLabelCache)
            return KubernetesDiscovery(ep.kubernetes, nodes=self._node_labels)
        if ep.launch is not None:
            return self._launched_source(pool)
        from server.embedded import simulated_source  # the simulator is needed only for simulated pools

        return simulated_source(self.config, pool)

    def _launched_source(self, pool: PoolConfig) -> Source:
        """`launch: vllm`: the pool's vLLM processes, started and supervised by `server.vllm_source`. One
        GPU allocator for every launched pool of this gateway, so no two replicas share a GPU; a pool with
        `launch.gpu_ids` draws only from those."""
        import os

        from server.vllm_pool import check_config_files
        from server.vllm_source import LaunchedPoolSource

        launch = pool.endpoints.launch
        assert launch is not None
        try:  # a vLLM config file in extra_args is read where the replicas run: here, not at config load
            check_config_files(launch.extra_args)
        except ValueError as exc:
            raise ConfigError(f"pools[{pool.name}].endpoints.launch.extra_args: {exc}") from None
        if self._gpu_allocator is None:
            self._gpu_allocator = self._launch_allocator()
        model = self.config.model_config_for(pool.model)
        # The gateway's own key variables never reach vLLM (the launcher's allowlist drops most names
        # already; these are dropped even when a name happens to match it).
        auth = self.config.auth
        secrets = {auth.api_keys_env, auth.admin_keys_env, *(p.api_key_env for p in self.config.pools)}
        # vLLM checks VLLM_API_KEY; the gateway sends the pool's `api_key_env` key: make them the same one.
        api_key = None
        if pool.api_key_env:  # unset or empty: the dispatcher refuses the config (one line, exit 2)
            api_key = os.environ.get(pool.api_key_env, "").strip() or None
        return LaunchedPoolSource.for_pool(
            pool.name,
            served_model=model.name,
            role=pool.role,
            runner=pool.runner,
            tp=pool.tp,
            dp=pool.dp,
            max_model_len=model.max_model_len,
            gpu_memory_utilization=pool.gpu_memory_utilization,
            max_num_seqs=pool.max_num_seqs,
            block_size=pool.block_size,
            launch=launch,
            allocator=self._gpu_allocator,
            api_key=api_key,
            drop_env={name for name in secrets if name},
        )

    def _launch_allocator(self) -> Any:
        """The GPUs launched pools share: this machine's (CUDA_VISIBLE_DEVICES, else nvidia-smi), or, when none
        is detected, the union of the pools' `launch.gpu_ids`. A pool's `gpu_ids` must be among the detected
        ones: CUDA_VISIBLE_DEVICES=0,1 excludes GPU 2 for the whole gateway. Every GPU-using launched pool's
        allowed set (None: all) is given to the allocator up front, before any replica starts, so that the
        first pool to start already leaves the others the GPUs only they may use."""
        from server.vllm_launcher import detect_gpu_ids
        from server.vllm_pool import GpuAllocator

        pools = {
            p.name: p.endpoints.launch.gpu_ids or None
            for p in self.config.pools
            if p.endpoints.launch is not None and p.endpoints.launch.use_gpus
        }
        listed = {name: ids for name, ids in pools.items() if ids}
        if not listed:
            return GpuAllocator(detect_gpu_ids(), pools)
        detected = detect_gpu_ids()
        if not detected:
            return GpuAllocator(list(dict.fromkeys(g for ids in listed.values() for g in ids)), pools)
        for name, ids in listed.items():
            unknown = [g for g in ids if g not in detected]
            if unknown:
                raise ConfigError(
                    f"pools[{name}].endpoints.launch.gpu_ids: GPU {', '.join(unknown)} is not among this machine's "
                    f"GPUs ({', '.join(detected)}; CUDA_VISIBLE_DEVICES, else nvidia-smi)"
                )
        return GpuAllocator(detected, pools)

    async def start(self) -> None:
        if self.peers is not None:
            await self.peers.start()
        await self.registry.start()
        if self.autoscaler is not None:
            self.autoscaler.start()
        # warnings once the start succeeded: a start that fails says one line, its error (`mosaic serve`)
        warning = self.keys.open_warning()
        if warning:
            log.warning(warning)
        limits = self.config.limits
        # said of a config that sets either (the defaults, 60 s and 10 s, are documented as not retrying it)
        chosen = {"first_token_timeout_s", "retry_budget_s"} & limits.model_fields_set
        if chosen and limits.max_retries > 0 and limits.first_token_timeout_s >= limits.retry_budget_s:
            log.warning(
                "limits.first_token_timeout_s (%g s) is not below limits.retry_budget_s (%g s): a stream whose "
                "worker sends no first token in time is not retried on another worker; lower the one or raise "
                "the other to retry it",
                limits.first_token_timeout_s,
                limits.retry_budget_s,
            )

    @property
    def draining(self) -> bool:
        """Shutting down: new requests, and any whose body arrives from now on, get 503; `/ready` is 503."""
        return self.dispatcher.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.dispatcher.draining = value

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop taking work (idempotent). New requests get 503 (`draining`); those still waiting in the
        admission queue get 503 now (they were sent nowhere; the client retries on another replica); what
        is still running when `grace_s` (less a margin) has passed is ended by the gateway: 503 before its
        response began, an error event and `[DONE]` after. Without this, uvicorn's graceful-shutdown
        timeout cancelled them into a plain-text 500, or a stream cut without `[DONE]`."""
        self.draining = True
        if self._shutdown_timer is not None:
            return
        queued = self.dispatcher.stop_requests(queued_only=True)
        running = sum(1 for rec in self.dispatcher.open.values() if not rec.finished) - queued
        # an operator watching a pod terminate sees why it takes up to the grace, and what it waits for
        log.info(
            "shutting down: %d request(s) in flight get up to %g s to finish; %d still queued answered 503",
            max(0, running),
            grace_s,
            queued,
        )
        margin = min(SHUTDOWN_MARGIN_S, grace_s / 2)  # uvicorn cancels at ceil(grace_s) + 0.1 s
        self._shutdown_timer = asyncio.get_running_loop().call_later(
            max(0.0, grace_s - margin), self._end_the_rest, grace_s
        )

    def _end_the_rest(self, grace_s: float) -> None:
        """The grace ran out: end what still runs, and say so (the pod's last words; /metrics is gone by the
        time anyone could scrape how many were cut)."""
        cut = self.dispatcher.stop_requests()
        if cut:
            log.warning(
                "shutdown grace of %g s ran out: ended %d request(s) still open (503, or an error event on a"
                " stream not yet ended); raise limits.shutdown_grace_s (and the pod's"
                " terminationGracePeriodSeconds) if requests routinely run longer",
                grace_s,
                cut,
            )

    async def stop(self) -> None:
        if self._shutdown_timer is not None:
            self._shutdown_timer.cancel()
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self.peers is not None:
            await self.peers.stop()
        await self.registry.stop()
        await self.upstream.aclose()
        if self._own_probe_client is not None:
            await self._own_probe_client.aclose()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, the /ready body). Ready = not draining and every pool's discovery has listed successfully
        at least once; with `readiness.require_all_models`, also every configured model has a ready worker.
        A model without a ready worker is reported in the body either way (its requests wait in the admission
        queue for a worker, then get 503 `queue_timeout`; or get 503 at once when nothing can add a worker to
        its pools, `stays_empty`)."""
        ready = dict.fromkeys(self.models, 0)
        now = self.clock()
        for rec in self.registry.records():
            if rec.state() is WorkerState.READY and not rec.breaker.is_open(now):
                ready[rec.pool.model] = ready.get(rec.pool.model, 0) + 1
        unsynced = {name: src.last_error for name, src in self.discovery.items() if not src.synced}
        without = [m for m, n in ready.items() if n == 0]
        strict = self.config.readiness.require_all_models
        ok = not self.draining and not unsynced and not (strict and without)
        body: dict[str, Any] = {
            "ready": ok,
            "draining": self.draining,
            "discovery_synced": not unsynced,
            "unsynced_pools": unsynced,  # pool → its latest listing error (None: not listed yet)
            "require_all_models": strict,
            "ready_workers": ready,  # model → ready workers (breaker closed)
            "models_without_ready_worker": without,
        }
        return ok, body
