"""The autoscaler's gateway-side signals from one or several gateways' metrics: one code path for both drivers.

A **source** gives, per gateway, a `Snapshot` (when it was taken, the samples of the families below):
`mosaic serve` reads its own registry (`RegistrySource`, one gateway), `mosaic autoscale` the text of each
gateway replica's `/metrics` (`server.gateway_scrape.GatewayScraper`, parsed by `samples_from_text` with
`prometheus_client.parser`). Both go through `GatewayWindow.step` and `gateway_signals`.

**Interval and merge** (`GatewayWindow.step`, once per cycle):

- per gateway, the increment of every counter sample (`_total`, histogram `_bucket`) since the snapshot
  it used at the previous cycle, over that gateway's own Δt (snapshot to snapshot);
- a **restarted gateway** (any counter sample lower than before, or a series' `_created` changed): its
  baseline is zero, so the increment is the current value — what the new process counted since it
  started, as Prometheus' `rate()` treats a counter reset;
- a gateway seen for the first time is a baseline (no increments this cycle); one with no newer snapshot
  than last cycle contributes no increments and keeps its baseline; one without a snapshot (unreachable,
  or its last good scrape stale) is skipped and its baseline dropped;
- merged over gateways: increments summed (a histogram's cumulative bucket increments summed per bound,
  so the merged buckets are the histogram of every request any gateway saw), rates Σ increment / Δt,
  gauges (admission queue depth) summed over the gateways with a snapshot.

**Signals** (`gateway_signals`), the `Observation` fields:

| field | from the merged interval |
|---|---|
| admission_queue | Σ `mosaic_admission_queue_depth` per model (a non-finite value is skipped) |
| ttft_p90_s | p90 of `mosaic_time_to_first_token_seconds` bucket increments (`quantile`, as `histogram_quantile`) |
| tpot_p90_s | p90 of `mosaic_time_per_output_token_seconds` (per request: (e2e − TTFT)/(n − 1)); with no such sample in the interval, of `mosaic_inter_token_latency_seconds` (older gateways) |
| request_rate | Σ Δ`mosaic_requests_received_total` / Δt (arrivals: a backlog clearing does not read as a surge) |
| mean_input_tokens, mean_output_tokens | Δ`mosaic_prompt_tokens_total`, Δ`mosaic_generation_tokens_total` ÷ Δ completed requests |
| models | the four above (and the p90s) per `model` label, so one model's arrivals and latencies do not size another's pools (`Observation.for_model`); every configured model has an entry (zero arrivals without a series); fleet-wide only for a single-model fleet without labelled series |

Latency bounds are multiplied by the pool's time scale and rates divided by the model's (simulated pools,
`server.autoscale_signals`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from scheduler.autoscaler.signals import ModelObservation

TTFT_FAMILY = "mosaic_time_to_first_token_seconds"
TPOT_FAMILY = "mosaic_time_per_output_token_seconds"
ITL_FAMILY = "mosaic_inter_token_latency_seconds"
RECEIVED = "mosaic_requests_received_total"
OUTCOMES = "mosaic_request_outcomes_total"
PROMPT = "mosaic_prompt_tokens_total"
GENERATED = "mosaic_generation_tokens_total"
QUEUE = "mosaic_admission_queue_depth"
_COUNTERS = frozenset({RECEIVED, OUTCOMES, PROMPT, GENERATED}) | {
    f + "_bucket" for f in (TTFT_FAMILY, TPOT_FAMILY, ITL_FAMILY)
}
_CREATED = frozenset(
    {n.removesuffix("_total") + "_created" for n in (RECEIVED, OUTCOMES, PROMPT, GENERATED)}
    | {f + "_created" for f in (TTFT_FAMILY, TPOT_FAMILY, ITL_FAMILY)}
)
WANTED = _COUNTERS | _CREATED | {QUEUE}

Labels = tuple[tuple[str, str], ...]
SampleKey = tuple[str, Labels]  # (sample name, sorted labels)
Samples = dict[SampleKey, float]
Bucket = tuple[float, float, float]  # (lower bound, upper bound, count); upper may be inf


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float  # on the controller's clock
    samples: Samples


# a source: gateway name → its latest snapshot, or None when it has none fresh (skipped this cycle)
GatewaySource = Callable[[], Mapping[str, Snapshot | None]]


def _keep(name: str, labels: Mapping[str, str], out: Samples, value: float) -> None:
    if name in WANTED:
        out[(name, tuple(sorted(labels.items())))] = value


def samples_from_registry(registry: CollectorRegistry) -> Samples:
    out: Samples = {}
    for family in registry.collect():
        for s in family.samples:
            _keep(s.name, s.labels, out, s.value)
    return out


def samples_from_text(text: str) -> Samples:
    """The wanted samples of a Prometheus text exposition; ValueError when it does not parse."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            _keep(s.name, s.labels, out, s.value)
    return out


@dataclass(slots=True)
class RegistrySource:
    """`mosaic serve`: this process's own gateway metrics, one gateway, read when the cycle asks."""

    registry: CollectorRegistry
    clock: Callable[[], float] = time.monotonic
    name: str = "local"

    def __call__(self) -> dict[str, Snapshot | None]:
        return {self.name: Snapshot(self.clock(), samples_from_registry(self.registry))}


@dataclass(frozen=True, slots=True)
class Merged:
    increments: Samples  # Σ over gateways of counter increments over each one's interval
    per_s: Samples  # Σ over gateways of increment / Δt
    gauges: Samples  # Σ over gateways with a snapshot
    gateways: int  # with a snapshot this cycle
    counted: int  # whose increments counted (a baseline and a newer snapshot)


def restarted(prev: Samples, cur: Samples) -> bool:
    """A counter went down or a series was re-created: the gateway process restarted (module docstring)."""
    for key, value in cur.items():
        before = prev.get(key)
        if before is None:
            continue
        if key[0] in _COUNTERS and value < before:
            return True
        if key[0] in _CREATED and value != before:
            return True
    return False


@dataclass(slots=True)
class GatewayWindow:
    """Per-gateway baselines between cycles; `step` merges one cycle's snapshots (module docstring)."""

    _prev: dict[str, Snapshot] = field(default_factory=dict)

    def step(self, snapshots: Mapping[str, Snapshot | None]) -> Merged:
        inc: Samples = {}
        per_s: Samples = {}
        gauges: Samples = {}
        present = counted = 0
        for gateway, snap in sorted(snapshots.items()):
            if snap is None:
                self._prev.pop(gateway, None)
                continue
            present += 1
            for key, value in snap.samples.items():
                if key[0] == QUEUE and math.isfinite(value):  # a NaN/Inf gauge is no depth: skipped
                    gauges[key] = gauges.get(key, 0.0) + value
            prev = self._prev.get(gateway)
            if prev is not None and snap.at <= prev.at:
                continue  # nothing newer than last cycle's: no increments, same baseline
            self._prev[gateway] = snap
            if prev is None:
                continue  # first sight: a baseline
            counted += 1
            dt = snap.at - prev.at
            base = {} if restarted(prev.samples, snap.samples) else prev.samples
            for key, value in snap.samples.items():
                if key[0] not in _COUNTERS:
                    continue
                d = max(0.0, value - base.get(key, 0.0))  # zeros kept: a bucket's bounds need its neighbours
                inc[key] = inc.get(key, 0.0) + d
                per_s[key] = per_s.get(key, 0.0) + d / dt
        for gone in set(self._prev) - set(snapshots):
            del self._prev[gone]
        return Merged(inc, per_s, gauges, present, counted)


def quantile(q: float, buckets: Iterable[Bucket]) -> float | None:
    """q-quantile of a mixture of histogram buckets, each uniform on [lower, upper].

    For one histogram with lower bounds 0, previous `le` this is Prometheus' `histogram_quantile`; for
    buckets of several histograms with rescaled bounds it is exact for the mixture. A quantile that
    falls in a +Inf bucket is the largest finite bound (as Prometheus answers). None without samples.
    """
    items = [b for b in buckets if b[2] > 0]
    total = sum(c for _, _, c in items)
    if total <= 0:
        return None
    target = q * total
    finite = [b for b in items if math.isfinite(b[1])]
    points = sorted({p for lo, hi, _ in finite for p in (lo, hi)})
    if not points:
        return max((b[0] for b in items), default=None)

    def cdf(x: float) -> float:
        return sum(
            c * min(1.0, max(0.0, (x - lo) / (hi - lo))) if hi > lo else c * (x >= hi) for lo, hi, c in finite
        )

    prev_x, prev_c = points[0], cdf(points[0])
    if prev_c >= target:
        return prev_x
    for x in points[1:]:
        c = cdf(x)
        if c >= target:  # cdf is linear between consecutive breakpoints
            return prev_x + (x - prev_x) * (target - prev_c) / (c - prev_c)
        prev_x, prev_c = x, c
    # in a +Inf bucket: its series' largest finite bound (empty finite buckets below it are not in `points`,
    # and answering the top non-empty one read a p90 of 0.1 s when half the requests took over a minute)
    return max([points[-1], *(lo for lo, hi, _ in items if not math.isfinite(hi))])


def latency_buckets(
    family: str, increments: Samples, pool_scale: Callable[[str], float], model: str | None = None
) -> list[Bucket]:
    """One histogram family's bucket increments per (model, pool) series, bounds × the pool's time scale;
    only `model`'s series when given."""
    series: dict[Labels, list[tuple[float, float]]] = {}
    for (name, labels), value in increments.items():
        if name != family + "_bucket":
            continue
        lab = dict(labels)
        if model is not None and lab.get("model") != model:
            continue
        le = float(lab.pop("le"))
        series.setdefault(tuple(sorted(lab.items())), []).append((le, value))
    buckets: list[Bucket] = []
    for key, cumulative in series.items():
        scale = pool_scale(dict(key).get("pool", ""))
        lower, below = 0.0, 0.0
        for le, count in sorted(cumulative):
            upper = le * scale
            buckets.append((lower, upper, max(0.0, count - below)))
            lower, below = upper, max(below, count)
    return buckets


def gateway_signals(
    merged: Merged,
    pool_scale: Callable[[str], float],
    model_scale: Callable[[str], float],
    configured: Iterable[str] = (),
) -> dict[str, Any]:
    """The `Observation` fields of the merged interval (module docstring's table).

    `configured`: the fleet's models. Each gets an entry in `models`: its own series, or none yet (zero
    arrivals, no latencies), so another model's load never sizes its pools. Only a single-model fleet
    whose model has no labelled series (an older gateway) reads the fleet-wide signals."""
    out: dict[str, Any] = {"admission_queue": {}}
    for (_, lab), v in merged.gauges.items():
        if math.isfinite(v):  # one gateway's NaN/Inf gauge must not fail every cycle
            model = dict(lab).get("model", "")
            out["admission_queue"][model] = out["admission_queue"].get(model, 0) + int(v)
    if not merged.counted:
        return out
    fleet = _model_signals(merged, pool_scale, model_scale, None)
    out.update(fleet)
    seen = {dict(lab)["model"] for (name, lab) in merged.per_s if name == RECEIVED and "model" in dict(lab)}
    wanted = set(configured)
    models = {
        m: ModelObservation(**_model_signals(merged, pool_scale, model_scale, m))
        for m in sorted(seen | wanted)
    }
    if len(wanted) == 1 and not wanted & seen:
        models[next(iter(wanted))] = ModelObservation(**fleet)
    out["models"] = models
    return out


def _model_signals(
    merged: Merged, pool_scale: Callable[[str], float], model_scale: Callable[[str], float], model: str | None
) -> dict[str, Any]:
    """Arrival rate, mean lengths and latency p90s over `model`'s series (None: every model's)."""

    def ours(lab: Labels) -> bool:
        return model is None or dict(lab).get("model") == model

    inc = merged.increments
    out: dict[str, Any] = {"ttft_p90_s": quantile(0.9, latency_buckets(TTFT_FAMILY, inc, pool_scale, model))}
    tpot = quantile(0.9, latency_buckets(TPOT_FAMILY, inc, pool_scale, model))
    out["tpot_p90_s"] = (
        tpot if tpot is not None else quantile(0.9, latency_buckets(ITL_FAMILY, inc, pool_scale, model))
    )
    out["request_rate"] = sum(
        v / model_scale(dict(lab).get("model", ""))
        for (name, lab), v in merged.per_s.items()
        if name == RECEIVED and ours(lab)
    )
    completed = sum(
        v
        for (name, lab), v in inc.items()
        if name == OUTCOMES and ("outcome", "completed") in lab and ours(lab)
    )
    if completed > 0:
        prompt = sum(v for (name, lab), v in inc.items() if name == PROMPT and ours(lab))
        generated = sum(v for (name, lab), v in inc.items() if name == GENERATED and ours(lab))
        out["mean_input_tokens"], out["mean_output_tokens"] = prompt / completed, generated / completed
    return out
