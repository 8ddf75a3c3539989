"""The gateway's Prometheus metrics (`mosaic_` namespace), in a registry of its own per app.

Measured at the gateway, so they are what a client sees (P/D TTFT includes the prefill hop and the KV
transfer). Request-path metrics are updated as events happen; per-worker and queue gauges are read from
the live objects when `/metrics` is scraped (a custom collector), so they are never stale and cost
nothing per request.

| metric | type | labels |
|---|---|---|
| mosaic_requests_total | counter | model, pool, status (HTTP status sent to the client; pool `none` when never routed) |
| mosaic_requests_received_total | counter | model (at arrival, past auth, validation and rate limits: the autoscaler's arrival rate) |
| mosaic_request_outcomes_total | counter | model, outcome (completed, failed_before_first_byte, client_disconnected, worker_error, timed_out, shut_down, worker_rejected, internal_error, backgrounded, ...) |
| mosaic_time_to_first_token_seconds | histogram | model, pool (arrival → first streamed event relayed, unless an error event) |
| mosaic_inter_token_latency_seconds | histogram | model, pool (gap between relayed stream events carrying tokens: not `[DONE]`, not the usage-only event; streams of one sequence) |
| mosaic_time_per_output_token_seconds | histogram | model, pool (per completed stream of one sequence and n ≥ 2 tokens: (e2e − TTFT) / (n − 1), as vLLM and the load generator) |
| mosaic_e2e_request_latency_seconds | histogram | model, pool (arrival → last byte, completed requests only) |
| mosaic_prompt_tokens_total, mosaic_generation_tokens_total | counter | model (from upstream `usage`) |
| mosaic_lora_requests_total | counter | model (the base), adapter, status: requests naming a LoRA adapter (also counted in mosaic_requests_total under their base model); adapter "(unlisted)" for one no worker lists |
| mosaic_lora_tokens_total | counter | model, adapter, kind (prompt, generation; from upstream `usage`) |
| mosaic_lora_admin_calls_total | counter | operation (load, unload, reconcile; forget: an adapter unloaded elsewhere), outcome (ok, failed): run-time LoRA calls to workers, one per worker |
| mosaic_rejections_total | counter | reason (auth, rate limit, queue full/timeout, no worker, ...) |
| mosaic_retries_total | counter | model, reason (connect, timeout, status_429, status_503, ...) |
| mosaic_pd_fallbacks_total | counter | model, reason (prefill hop failed → decode-only: timeout, pool_timeout, worker_error, busy, refused, bad_response, no_params, removed; `server.prefill_hop`) |
| mosaic_upstream_errors_total | counter | worker, kind |
| mosaic_scrape_errors_total | counter | worker |
| mosaic_breaker_ejections_overflow_total | counter | worker (failures, of requests or a health check among them, that would have opened its breaker, held back by `health.max_ejection_percent`) |
| mosaic_worker_inflight_requests, mosaic_worker_inflight_prefill_tokens | gauge | worker, pool |
| mosaic_worker_state | gauge (1) | worker, pool, state |
| mosaic_worker_breaker_open | gauge | worker, pool |
| mosaic_worker_engine_stuck | gauge | worker, pool: 1 while its last health check judged its engine stuck (requests running, or sent there and not taken up, and no step: `health.stuck_engine_s`) |
| mosaic_worker_scrape_age_seconds | gauge | worker, pool (absent until first scrape) |
| mosaic_worker_cost_per_hour | gauge | worker, pool ($/h from the worker's capacity; sum it for the fleet's $/h) |
| mosaic_autoscaler_* | | when the autoscaler runs in-process: see `server.autoscaling` |
| mosaic_admission_queue_depth | gauge | model |
| mosaic_kv_total_units, mosaic_kv_reserved_units, mosaic_kv_shrink_units, mosaic_kv_active_reservations | gauge | worker (KV ledger, when `kv.enabled`) |
| mosaic_kv_estimate_error | gauge | worker: (reported − reserved) / total at the last reconcile |
| mosaic_kv_reservations_total, mosaic_kv_reservations_refused_total, mosaic_kv_grows_total, mosaic_kv_grows_refused_total, mosaic_kv_double_releases_total | counter | — (the ledger's own counts) |
| mosaic_kv_reservations_released_total | counter | outcome |
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets span a zero-compute simulator (sub-ms) to long-context requests on real GPUs (minutes).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 6.0, 12.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5)
# Per-request TPOT: finer where TPOT SLOs sit (20–100 ms), down to the simulator's sub-ms steps.
_TPOT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
)
_E2E_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 600.0)


@dataclass(frozen=True, slots=True)
class WorkerGaugeRow:
    worker: str
    pool: str
    state: str
    inflight_requests: int
    inflight_prefill_tokens: int
    breaker_open: bool
    scrape_age_s: float | None
    cost_per_hour: float | None = None  # WorkerCapacity.cost_per_hour (the whole TP group)
    engine_stuck: bool = False  # its last health check judged its engine stuck


class _LiveCollector(Collector):
    """Reads worker rows and queue depths from callables at scrape time."""

    def __init__(
        self,
        workers: Callable[[], Iterable[WorkerGaugeRow]],
        queues: Callable[[], dict[str, int]],
        kv: Callable[[], Mapping[str, Mapping[str, float | int | None]]] | None = None,
    ) -> None:
        self._workers = workers
        self._queues = queues
        self._kv = kv

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "mosaic_worker_inflight_requests",
            "Requests in flight per worker (gateway-side)",
            labels=["worker", "pool"],
        )
        prefill = GaugeMetricFamily(
            "mosaic_worker_inflight_prefill_tokens",
            "Prompt tokens dispatched and not yet past first token",
            labels=["worker", "pool"],
        )
        state = GaugeMetricFamily(
            "mosaic_worker_state",
            "Worker state (1 for the current state)",
            labels=["worker", "pool", "state"],
        )
        breaker = GaugeMetricFamily(
            "mosaic_worker_breaker_open",
            "1 when the worker's circuit breaker is open",
            labels=["worker", "pool"],
        )
        age = GaugeMetricFamily(
            "mosaic_worker_scrape_age_seconds",
            "Seconds since the worker's last successful /metrics scrape",
            labels=["worker", "pool"],
        )
        stuck = GaugeMetricFamily(
            "mosaic_worker_engine_stuck",
            "1 while the worker's last health check judged its engine stuck (requests running or not taken up, no step)",
            labels=["worker", "pool"],
        )
        cost = GaugeMetricFamily(
            "mosaic_worker_cost_per_hour",
            "$/h of the worker (its GPU type and TP degree)",
            labels=["worker", "pool"],
        )
        for row in self._workers():
            labels = [row.worker, row.pool]
            inflight.add_metric(labels, row.inflight_requests)
            prefill.add_metric(labels, row.inflight_prefill_tokens)
            state.add_metric([*labels, row.state], 1)
            breaker.add_metric(labels, 1 if row.breaker_open else 0)
            stuck.add_metric(labels, 1 if row.engine_stuck else 0)
            if row.scrape_age_s is not None:
                age.add_metric(labels, row.scrape_age_s)
            if row.cost_per_hour is not None:
                cost.add_metric(labels, row.cost_per_hour)
        depth = GaugeMetricFamily(
            "mosaic_admission_queue_depth", "Requests waiting in the admission queue", labels=["model"]
        )
        for model, n in self._queues().items():
            depth.add_metric([model], n)
        yield from (inflight, prefill, state, breaker, stuck, age, cost, depth)
        if self._kv is not None:
            yield from _kv_families(self._kv())


class KvQueueCounts(Protocol):
    """What the KV admission queue counts (`server.kv_admission.KvQueueStats`)."""

    holds: int
    holds_dropped: int
    ticks: int
    planned: int
    admitted: int
    methods: Mapping[str, int]
    last_solve_ms: float


_KV_QUEUE_COUNTERS = (
    ("holds", "mosaic_kv_queue_holds", "Ledger holds placed for aged admission-queue heads"),
    ("holds_dropped", "mosaic_kv_queue_holds_dropped", "Holds removed when their waiter left the queue"),
    ("ticks", "mosaic_kv_batch_ticks", "Batch-admission ticks run over the queue head"),
    ("planned", "mosaic_kv_batch_planned", "Assignments in batch-admission plans"),
    ("admitted", "mosaic_kv_batch_admitted", "Planned assignments the router admitted on the planned worker"),
)


def _count_families(
    st: object, counters: Sequence[tuple[str, str, str]], by: tuple[str, str, str, str]
) -> Iterator[Metric]:
    """A stats object's plain counts (attribute, metric name, help), then one of its mappings as a counter
    labelled by key (attribute, metric name, help, label)."""
    for key, name, doc in counters:
        yield CounterMetricFamily(name, doc, value=getattr(st, key))
    attr, name, doc, label = by
    fam = CounterMetricFamily(name, doc, labels=[label])
    for value, n in sorted(getattr(st, attr).items()):
        fam.add_metric([value], n)
    yield fam


class _KvQueueCollector(Collector):
    def __init__(self, stats: Callable[[], KvQueueCounts]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        plans = (
            "methods",
            "mosaic_kv_batch_plans",
            "Batch-admission plans by the method that made them",
            "solver",
        )
        yield from _count_families(st, _KV_QUEUE_COUNTERS, plans)
        yield GaugeMetricFamily(
            "mosaic_kv_batch_last_solve_seconds",
            "Wall time of the last batch-admission solve",
            value=st.last_solve_ms / 1000.0,
        )


class KvLedgerCounts(Protocol):
    """What the KV ledger counts (`scheduler.kv.ledger.LedgerStats`)."""

    reserved: int
    refused: int
    released: Mapping[str, int]
    double_releases: int
    grows: int
    grow_refused: int


_KV_LEDGER_COUNTERS = (
    ("reserved", "mosaic_kv_reservations", "KV reservations made"),
    ("refused", "mosaic_kv_reservations_refused", "KV reservations refused: no room on the chosen worker"),
    ("grows", "mosaic_kv_grows", "Predicted-mode reservations grown as their output passed the prediction"),
    (
        "grow_refused",
        "mosaic_kv_grows_refused",
        "Predicted-mode growths refused for want of room: the worker may preempt (overbooking's cost)",
    ),
    ("double_releases", "mosaic_kv_double_releases", "Releases of a reservation already released (ignored)"),
)


class _KvLedgerCollector(Collector):
    def __init__(self, stats: Callable[[], KvLedgerCounts]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        released = (
            "released",
            "mosaic_kv_reservations_released",
            "KV reservations released, by outcome",
            "outcome",
        )
        yield from _count_families(self._stats(), _KV_LEDGER_COUNTERS, released)


_KV_GAUGES = (
    (
        "total_units",
        "mosaic_kv_total_units",
        "KV units (blocks or head-pages) per worker, as the ledger sees it",
    ),
    ("reserved_units", "mosaic_kv_reserved_units", "KV units reserved by this gateway's in-flight requests"),
    (
        "shrink_units",
        "mosaic_kv_shrink_units",
        "KV units withheld because reported usage exceeds reservations",
    ),
    ("active", "mosaic_kv_active_reservations", "Open KV reservations per worker"),
    ("estimate_error", "mosaic_kv_estimate_error", "(reported − reserved) / total KV at the last reconcile"),
)


def _kv_families(snapshot: Mapping[str, Mapping[str, float | int | None]]) -> Iterator[Metric]:
    for key, name, doc in _KV_GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=["worker"])
        for worker, row in snapshot.items():
            value = row.get(key)
            if value is not None:
                fam.add_metric([worker], float(value))
        yield fam


class Counter:
    """A labelled counter kept as plain Python numbers: `labels(*values).inc(amount)`.

    What `prometheus_client.Counter` exposes (`<name>_total` and `<name>_created` per label set), at a
    fraction of the cost per update: prometheus_client's children validate and take a lock on every
    `inc()` (≈ 0.8 µs; a relayed stream updates its metrics per chunk), which a single event loop does
    not need. Exported by `LeanCollector` at scrape time, in prometheus_client's own metric families."""

    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[tuple(str(v) for v in values)] = CounterChild()
        return child

    def remove_where(self, label: str, value: str) -> None:
        """Drop every child whose `label` is `value` (a worker that left the fleet: its series would
        otherwise be exported forever, one per pod an autoscaled fleet ever had)."""
        at = self.labelnames.index(label)
        for values in [v for v in self._children if v[at] == value]:
            del self._children[values]

    def family(self) -> Metric:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            fam.add_metric(values, child.value, created=child.created)
        return fam


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class Histogram:
    """A labelled histogram kept as plain Python numbers: `labels(*values).observe(amount)` finds the bucket
    by bisection (prometheus_client scans the bounds in Python: ≈ 1.7 µs per observation here). Exposes
    what `prometheus_client.Histogram` does: cumulative `_bucket{le=...}` (with `+Inf`), `_count`, `_sum`,
    `_created`."""

    kind = "histogram"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.bounds = (*sorted(float(b) for b in buckets), float("inf"))
        self._le = [floatToGoString(b) for b in self.bounds]
        self._children: dict[tuple[str, ...], HistogramChild] = {}

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[tuple(str(v) for v in values)] = HistogramChild(self.bounds)
        return child

    def family(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            counts, total, running = list(child.counts), child.sum, 0.0
            buckets = []
            for le, n in zip(self._le, counts, strict=True):
                running += n
                buckets.append((le, running))
            fam.add_metric(values, buckets, total)
            fam.samples.append(
                Sample(self.name + "_created", dict(zip(self.labelnames, values, strict=True)), child.created)
            )
        return fam


class HistogramChild:
    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(
            bounds
        )  # per bucket, not cumulative; bucket i holds bounds[i-1] < v ≤ bounds[i]
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount


class LeanCollector(Collector):
    """Exports `Counter`/`Histogram` objects as prometheus_client metric families."""

    def __init__(self, metrics: Sequence[Counter | Histogram]) -> None:
        self._metrics = tuple(metrics)

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield metric.family()

    def describe(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield (CounterMetricFamily if metric.kind == "counter" else HistogramMetricFamily)(
                metric.name, metric.documentation, labels=metric.labelnames
            )


class GatewayMetrics:
    """All gateway metrics in one `CollectorRegistry` owned by this object (one per app, no globals).
    Request-path counters and histograms are this module's lean `Counter`/`Histogram` (same exposition
    as prometheus_client's, cheaper updates); worker and queue gauges are read live at scrape time."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "mosaic_requests", "Requests answered, by HTTP status", ["model", "pool", "status"]
        )
        self.received = Counter(
            "mosaic_requests_received", "Requests accepted for dispatch, counted at arrival", ["model"]
        )
        self.outcomes = Counter(
            "mosaic_request_outcomes", "Terminal outcome of each accepted request", ["model", "outcome"]
        )
        self.ttft = Histogram(
            "mosaic_time_to_first_token_seconds",
            "Arrival to first streamed event, at the gateway",
            ["model", "pool"],
            buckets=_TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "mosaic_inter_token_latency_seconds",
            "Gap between relayed stream events carrying tokens",
            ["model", "pool"],
            buckets=_ITL_BUCKETS,
        )
        self.tpot = Histogram(
            "mosaic_time_per_output_token_seconds",
            "Per streamed request: (e2e - TTFT) / (output tokens - 1)",
            ["model", "pool"],
            buckets=_TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "mosaic_e2e_request_latency_seconds",
            "Arrival to last byte, at the gateway",
            ["model", "pool"],
            buckets=_E2E_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "mosaic_prompt_tokens", "Prompt tokens reported by workers' usage", ["model"]
        )
        self.generation_tokens = Counter(
            "mosaic_generation_tokens", "Generated tokens reported by workers' usage", ["model"]
        )
        self.rejections = Counter(
            "mosaic_rejections", "Requests refused by the gateway, by reason", ["reason"]
        )
        self.retries = Counter("mosaic_retries", "Dispatches retried on another worker", ["model", "reason"])
        self.pd_fallbacks = Counter(
            "mosaic_pd_fallbacks",
            "P/D requests served decode-only after the prefill hop failed, by reason",
            ["model", "reason"],
        )
        self.upstream_errors = Counter(
            "mosaic_upstream_errors", "Errors talking to workers", ["worker", "kind"]
        )
        self.scrape_errors = Counter("mosaic_scrape_errors", "Failed /metrics scrapes", ["worker"])
        self.ejections_overflow = Counter(
            "mosaic_breaker_ejections_overflow",
            "Failures that would have opened the worker's breaker, held back by health.max_ejection_percent",
            ["worker"],
        )
        # per LoRA adapter (names the workers list in /v1/models; any other is "(unlisted)": a client cannot add one)
        self.lora_requests = Counter(
            "mosaic_lora_requests",
            "Requests naming a LoRA adapter, by HTTP status",
            ["model", "adapter", "status"],
        )
        self.lora_tokens = Counter(
            "mosaic_lora_tokens",
            "Tokens of requests naming a LoRA adapter (workers' usage)",
            ["model", "adapter", "kind"],
        )
        self.lora_admin_calls = Counter(
            "mosaic_lora_admin_calls",
            "Run-time LoRA load/unload calls to workers (server.lora_admin), one per worker",
            ["operation", "outcome"],
        )
        self.tokenizer_requests = Counter(
            "mosaic_tokenizer_requests",
            "POST /tokenize and /detokenize, forwarded to a worker (server.tokenize_proxy), by answer status",
            ["path", "model", "status"],
        )
        self._per_worker = (self.upstream_errors, self.scrape_errors, self.ejections_overflow)
        r.register(
            LeanCollector(
                [
                    self.requests,
                    self.received,
                    self.outcomes,
                    self.ttft,
                    self.itl,
                    self.tpot,
                    self.e2e,
                    self.prompt_tokens,
                    self.generation_tokens,
                    self.rejections,
                    self.retries,
                    self.pd_fallbacks,
                    self.upstream_errors,
                    self.scrape_errors,
                    self.ejections_overflow,
                    self.tokenizer_requests,
                    self.lora_requests,
                    self.lora_tokens,
                    self.lora_admin_calls,
                ]
            )
        )

    def forget_worker(self, worker: str) -> None:
        """A worker left the fleet: its per-worker counter series go (a returning pod starts new ones,
        which `_created` tells apart from a reset)."""
        for counter in self._per_worker:
            counter.remove_where("worker", worker)

    def attach_live(
        self,
        workers: Callable[[], Iterable[WorkerGaugeRow]],
        queues: Callable[[], dict[str, int]],
        kv: Callable[[], Mapping[str, Mapping[str, float | int | None]]] | None = None,
    ) -> None:
        self.registry.register(_LiveCollector(workers, queues, kv))

    def attach_kv_ledger(self, stats: Callable[[], KvLedgerCounts]) -> None:
        """Export the KV ledger's counters (`scheduler.kv.ledger.LedgerStats`) at scrape time."""
        self.registry.register(_KvLedgerCollector(stats))

    def attach_kv_queue(self, stats: Callable[[], KvQueueCounts]) -> None:
        """Export the KV admission queue's counters (`server.kv_admission.KvQueueStats`) at scrape time."""
        self.registry.register(_KvQueueCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
