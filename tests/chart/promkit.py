"""What the chart's Prometheus queries (the Grafana dashboard, the alerting rules) are checked against: the
sample names and label names Mosaic's gateway, its controller and the simulated worker (vLLM's names,
REFERENCE.md) expose, and a reader for the PromQL subset those queries use (no PromQL parser is among the
dependencies: functions and aggregations, `by`/`on` label lists, label matchers, range vectors).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

# Sample names a metric family exposes, by type (Prometheus text format 0.0.4, prometheus_client's naming).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "unknown": ("",),
}
# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
# Labels Prometheus puts on every scraped series (the operator's monitors: namespace, pod, service, ...).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "container", "endpoint"})

_STRING = r'"(?:[^"\\]|\\.)*"'
# Number and duration literals (`0.05`, `1e-05`, `5m`, `1h30m`): not names. A digit inside a name (`e2e`) is not
# one's start.
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:.])(?:(?:[0-9]+(?:ms|[smhdwy]))+|[0-9][0-9.]*(?:[eE][-+]?[0-9]+)?)")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(" + _STRING + r")\s*,?")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects."""
    return {s.name for s in selectors(expr)}


@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        """Whether a sample is selected: its name, and every matcher (regexes anchored, as Prometheus's)."""
        if name != self.name:
            return False
        for label, op, value in self.matchers:
            got = labels.get(label, "")
            hit = re.fullmatch(value, got) is not None if op in ("=~", "!~") else got == value
            if hit != (op in ("=", "=~")):
                return False
        return True


def selectors(expr: str) -> list[Selector]:
    """Each `name{matchers}` of the expression, in order."""
    masked = re.sub(_STRING, lambda m: " " * len(m.group()), expr)  # strings cannot look like names
    masked = _NUMBER.sub(lambda m: " " * len(m.group()), masked)
    masked = re.sub(r"\[[^\]]*\]", lambda m: " " * len(m.group()), masked)  # range selectors
    masked = _LABEL_LIST.sub(lambda m: " " * len(m.group()), masked)  # label lists
    masked = re.sub(r"\{[^}]*\}", lambda m: "{" + " " * (len(m.group()) - 2) + "}", masked)  # matchers
    found: list[Selector] = []
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", masked):
        rest = masked[m.end() :]
        if rest.lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        matchers: list[tuple[str, str, str]] = []
        if rest.startswith("{"):
            body = expr[m.end() + 1 : m.end() + rest.index("}")]
            pos = 0
            while pos < len(body.strip()):
                mm = _MATCHER.match(body, pos)
                assert mm is not None, f"unreadable matchers {{{body}}} in {expr!r}"
                matchers.append((mm.group(1), mm.group(2), _unquote(mm.group(3))))
                pos = mm.end()
        found.append(Selector(m.group(), tuple(matchers)))
    return found


def _unquote(literal: str) -> str:
    return re.sub(r"\\(.)", r"\1", literal[1:-1])


def label_lists(expr: str) -> list[tuple[str, list[str]]]:
    """Each `by (...)`, `on (...)`, ... of the expression: (keyword, labels)."""
    masked = re.sub(_STRING, '""', expr)
    return [
        (m.group(1), [x.strip() for x in m.group(2).split(",") if x.strip()])
        for m in _LABEL_LIST.finditer(masked)
    ]


def family_samples(name: str, kind: str) -> set[str]:
    base = name.removesuffix("_total") if kind == "counter" else name
    return {base + suffix for suffix in _SUFFIXES.get(kind, ("",))}


def _gateway_metrics() -> Any:
    """The gateway's registry with every collector a gateway can attach (KV reservation's included)."""
    from scheduler.kv.ledger import LedgerStats
    from server.kv_admission import KvQueueStats
    from server.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.attach_live(lambda: [], dict, dict)
    metrics.attach_kv_ledger(LedgerStats)
    metrics.attach_kv_queue(KvQueueStats)
    return metrics


def _controller_registry() -> CollectorRegistry:
    """The autoscaler's metrics (`mosaic autoscale --metrics-port`, or a gateway with the autoscaler on)."""
    from server.autoscale_placement import PlacementMetrics
    from server.autoscaling import AutoscalerMetrics

    registry = CollectorRegistry()
    AutoscalerMetrics(registry)
    PlacementMetrics(registry)
    return registry


def gateway_exports() -> set[str]:
    """Every sample name the gateway's and the controller's registries can expose (families exist before any
    label is used)."""
    registries = (_gateway_metrics().registry, _controller_registry())
    return {s for r in registries for fam in r.collect() for s in family_samples(fam.name, fam.type)}


def _labels_by_sample(registry: CollectorRegistry) -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for fam in registry.collect():
        for s in fam.samples:
            seen.setdefault(s.name, set()).update(s.labels)
    return seen


def gateway_labels() -> dict[str, set[str]]:
    """Sample name → its label names, from the gateway's registry with one series of every metric."""
    from scheduler.kv.ledger import LedgerStats
    from server.kv_admission import KvQueueStats
    from server.metrics import Counter, GatewayMetrics, Histogram, WorkerGaugeRow

    metrics = GatewayMetrics()
    row = WorkerGaugeRow("w", "p", "ready", 0, 0, False, 0.5, 1.0)
    kv = {"w": {"total_units": 1, "reserved_units": 0, "shrink_units": 0, "active": 0, "estimate_error": 0.0}}
    metrics.attach_live(lambda: [row], lambda: {"m": 1}, lambda: kv)
    metrics.attach_kv_ledger(LedgerStats)
    metrics.attach_kv_queue(KvQueueStats)
    for m in vars(metrics).values():
        if isinstance(m, Counter | Histogram):
            m.labels(*("x",) * len(m.labelnames))
    return _labels_by_sample(metrics.registry)


def controller_labels() -> dict[str, set[str]]:
    """Sample name → label names for the controller's own /metrics (`mosaic autoscale --metrics-port`)."""
    from server.autoscale_placement import PlacementMetrics
    from server.autoscaling import AutoscalerMetrics

    registry = CollectorRegistry()
    for group in (AutoscalerMetrics(registry), PlacementMetrics(registry)):
        for m in vars(group).values():
            names = m._labelnames  # prometheus_client keeps no public accessor for a metric's label names
            if names:
                m.labels(*("x",) * len(names))
    return _labels_by_sample(registry)


def simulated_worker_text() -> str:
    """The simulated worker's /metrics, read over HTTP in-process (ASGI)."""
    worker_app = pytest.importorskip(
        "simulator.worker_app", reason="simulator/worker_app.py is not written yet"
    )
    import httpx

    app = worker_app.create_worker_app(worker_app.WorkerConfig(gpu="A100-80GB", model="llama-3-8b"))

    async def scrape() -> str:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://worker"
        ) as client:
            response = await client.get("/metrics")
            response.raise_for_status()
            return response.text

    return asyncio.run(scrape())


def simulated_worker_exports() -> set[str]:
    names: set[str] = set()
    for fam in text_string_to_metric_families(simulated_worker_text()):
        names |= family_samples(fam.name, fam.type) | {s.name for s in fam.samples}
    return names


def simulated_worker_labels() -> dict[str, set[str]]:
    seen: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(simulated_worker_text()):
        for s in fam.samples:
            seen.setdefault(s.name, set()).update(s.labels)
    return seen


def samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a /metrics exposition."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            yield s.name, s.labels, s.value
