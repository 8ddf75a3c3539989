"""Workloads for the planner: request rate and a histogram over (input, output) length buckets, per model.

File (YAML or JSON):

```yaml
schema: mosaic.workload/v1
models:
  - model: llama-3-8b
    input_edges: [1, 256, 1024, 4096, 8193]   # the same edges as the model's profiles
    output_edges: [1, 64, 256, 1024, 2049]
    rate: 30                                   # req/s
    histogram: [[...], ...]                    # weights per (input i, output j); normalised, counts are fine
    # or, instead of rate + histogram, a time-varying workload:
    windows:
      - {duration_s: 3600, rate: 12, histogram: [[...]]}
      - {duration_s: 3600, rate: 30, histogram: [[...]]}
```
A single model may be written without the `models:` list (its keys at the top level).

`histogram_from_requests` turns a trace (any iterable of (arrival_s | None, input_tokens, output_tokens),
e.g. the load generator's readers) into windows on given edges, streaming: memory is one count matrix
per window. Requests outside the edges are counted apart (`out_of_range`), never silently dropped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from placement.profiles import bucket_index, read_structured

SCHEMA = "mosaic.workload/v1"


class WorkloadError(ValueError):
    """A malformed workload; the message names the file and the field."""


def _check_weights(rows: tuple[tuple[float, ...], ...] | None) -> None:
    if rows is not None and any(not math.isfinite(v) or v < 0 for row in rows for v in row):
        raise ValueError("weights must be finite and ≥ 0")


MAX_WINDOW_S = 1e9  # ~32 years: past it a duration is in the wrong unit (and sums of them overflow to inf)


class _Window(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    duration_s: float = Field(default=3600.0, gt=0, le=MAX_WINDOW_S, allow_inf_nan=False)
    rate: float = Field(ge=0, allow_inf_nan=False)
    histogram: tuple[tuple[float, ...], ...]

    @field_validator("histogram")
    @classmethod
    def _weights(cls, rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        _check_weights(rows)
        return rows


class _ModelWorkload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1)
    input_edges: tuple[int, ...]
    output_edges: tuple[int, ...]
    rate: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    histogram: tuple[tuple[float, ...], ...] | None = None
    windows: tuple[_Window, ...] | None = None

    @field_validator("histogram")
    @classmethod
    def _weights(cls, rows: tuple[tuple[float, ...], ...] | None) -> tuple[tuple[float, ...], ...] | None:
        _check_weights(rows)
        return rows

    @model_validator(mode="after")
    def _one_form(self) -> _ModelWorkload:
        if (self.windows is None) == (self.rate is None or self.histogram is None):
            if self.windows is None:
                raise ValueError(f"model {self.model}: give rate and histogram, or windows")
            raise ValueError(f"model {self.model}: give windows or rate + histogram, not both")
        return self


class _WorkloadFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_: str = Field(alias="schema")
    models: tuple[_ModelWorkload, ...] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class Window:
    """One stretch of time: `rates[b]` req/s in bucket b = i · n_out + j."""

    duration_s: float
    rates: tuple[float, ...]
    out_of_range: float = 0.0  # req/s of requests whose lengths fall outside the edges

    @property
    def total(self) -> float:
        return sum(self.rates) + self.out_of_range


@dataclass(frozen=True, slots=True)
class ModelWorkload:
    model: str
    input_edges: tuple[int, ...]
    output_edges: tuple[int, ...]
    windows: tuple[Window, ...]

    @property
    def n_buckets(self) -> int:
        return (len(self.input_edges) - 1) * (len(self.output_edges) - 1)

    def scaled(self, factor: float) -> ModelWorkload:
        return ModelWorkload(
            self.model,
            self.input_edges,
            self.output_edges,
            tuple(
                Window(w.duration_s, tuple(r * factor for r in w.rates), w.out_of_range * factor)
                for w in self.windows
            ),
        )


def normalised_rates(rate: float, histogram: Sequence[Sequence[float]], where: str) -> tuple[float, ...]:
    """rate · weight / Σ weights per bucket, in bucket order."""
    flat = [float(v) for row in histogram for v in row]
    total = sum(flat)
    if total <= 0:
        raise WorkloadError(f"{where}: histogram is all zeros: no request to place")
    return tuple(rate * v / total for v in flat)


def _model_from(raw: _ModelWorkload, where: str) -> ModelWorkload:
    n_in, n_out = len(raw.input_edges) - 1, len(raw.output_edges) - 1
    if n_in < 1 or n_out < 1:
        raise WorkloadError(f"{where}: input_edges and output_edges need at least two edges each")
    for name, edges in (("input_edges", raw.input_edges), ("output_edges", raw.output_edges)):
        if edges[0] < 0 or any(b <= a for a, b in itertools.pairwise(edges)):
            raise WorkloadError(
                f"{where}: field {name}: must be ≥ 0 and strictly increasing, got {list(edges)}"
            )
    windows = raw.windows or (
        _Window(duration_s=3600.0, rate=raw.rate or 0.0, histogram=raw.histogram or ()),
    )
    out = []
    for k, w in enumerate(windows):
        field = f"windows[{k}]" if raw.windows else "histogram"
        hist = w.histogram
        if len(hist) != n_in or any(len(row) != n_out for row in hist):
            raise WorkloadError(
                f"{where}: field {field}: shape must be {n_in}×{n_out} (input × output buckets)"
            )
        out.append(Window(w.duration_s, normalised_rates(w.rate, hist, f"{where}: {field}")))
    if all(w.total <= 0 for w in out):
        raise WorkloadError(f"{where}: model {raw.model}: request rate is 0 req/s: nothing to place")
    return ModelWorkload(raw.model, raw.input_edges, raw.output_edges, tuple(out))


def workload_from_dict(data: Any, origin: str = "<workload>") -> tuple[ModelWorkload, ...]:
    if not isinstance(data, dict):
        raise WorkloadError(f"{origin}: a workload must be a mapping")
    if "models" not in data:  # single-model shorthand
        data = {"schema": data.get("schema"), "models": [{k: v for k, v in data.items() if k != "schema"}]}
    if data.get("schema") != SCHEMA:
        raise WorkloadError(f"{origin}: field schema: expected {SCHEMA!r}, got {data.get('schema')!r}")
    try:
        parsed = _WorkloadFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise WorkloadError(f"{origin}: field {loc or '(root)'}: {msg}") from None
    models = tuple(_model_from(m, origin) for m in parsed.models)
    names = [m.model for m in models]
    if len(set(names)) != len(names):
        raise WorkloadError(f"{origin}: a model appears twice in models: {names}")
    return models


def load_workload(path: str) -> tuple[ModelWorkload, ...]:
    return workload_from_dict(read_structured(path, WorkloadError), path)


MAX_WINDOWS = 1_000  # a day in 90 s windows; the plan is one fleet for all, so finer adds rows, not insight


def histogram_from_requests(
    requests: Iterable[tuple[float | None, int, int]],
    model: str,
    input_edges: Sequence[int],
    output_edges: Sequence[int],
    *,
    window_s: float | None = None,
    rate: float | None = None,
    end_s: float | None = None,
    start_s: float | None = None,
) -> ModelWorkload:
    """Bin a trace into windows of `window_s` seconds of arrival time (None: one window, the whole trace).

    Timed traces: window k spans [k · window_s, (k + 1) · window_s) and its rate is its count / window_s,
    except the last one, which the trace may cover only in part: its rate is its count / the time the trace
    covers of it, from its start to the trace's end (`end_s` when known, e.g. a synthetic trace's duration;
    else the last arrival), at least 1 s, at most `window_s`. A `--window-s` longer than the trace thus gives
    the trace's own rate, not a diluted one. A single window spans first arrival → end (at least 1 s), or
    `start_s` → end when the trace's start is known (a synthetic trace starts at 0, its first arrival one
    gap later).
    Traces without arrival times need `rate` (req/s): one window whose histogram is their length
    distribution at that rate. `rate` given for a timed trace rescales every window so that the busiest
    has that total rate.
    """
    if window_s is not None and not (math.isfinite(window_s) and window_s > 0):
        raise WorkloadError(f"window must be a finite number of seconds > 0, got {window_s}")
    if rate is not None and not (math.isfinite(rate) and rate >= 0):
        raise WorkloadError(f"rate must be a finite number of requests/s ≥ 0, got {rate}")
    n_buckets = (len(input_edges) - 1) * (len(output_edges) - 1)
    n_out = len(output_edges) - 1
    counts: dict[int, list[float]] = {}
    outside: dict[int, float] = {}
    span = [math.inf, -math.inf]
    timed = True
    for arrival, inp, out in requests:
        if arrival is None:
            timed = False
        else:
            span = [min(span[0], arrival), max(span[1], arrival)]
        k = int(arrival // window_s) if (window_s and arrival is not None) else 0
        row = counts.setdefault(k, [0.0] * n_buckets)
        i, j = bucket_index(input_edges, inp), bucket_index(output_edges, out)
        if i is None or j is None:
            outside[k] = outside.get(k, 0.0) + 1
        else:
            row[i * n_out + j] += 1
    if not counts:
        raise WorkloadError("the trace has no requests")
    if not timed and rate is None:
        raise WorkloadError("this trace has no arrival times: give a request rate")
    if not timed:
        window_s = None
        counts, outside = (
            {0: [sum(c[b] for c in counts.values()) for b in range(n_buckets)]},
            {0: sum(outside.values())},
        )
    end = max(span[1], end_s if end_s is not None and math.isfinite(end_s) else -math.inf)
    last = max(counts)
    if last >= MAX_WINDOWS:  # one solver row per window and option: past this the plan takes hours
        raise WorkloadError(
            f"windows of {window_s:g} s cut the trace ({end:g} s) into {last + 1:,} windows, more than "
            f"{MAX_WINDOWS:,}: use windows of at least {math.ceil(end / MAX_WINDOWS):g} s"
        )
    tail_s = 0.0  # the covered part of a trailing sliver merged into the window before it
    if timed and window_s and last > 0 and end - last * window_s < window_s / 2:
        # A trace that runs a little past a window boundary leaves a window whose rate rests on a handful of
        # requests (7 in 1 s read as a 7 req/s peak, and `rate` then scaled every window to that): it joins
        # the window before it, over its whole span
        tail_s = max(end - last * window_s, 0.0)
        sliver, before = counts.pop(last, [0.0] * n_buckets), counts.setdefault(last - 1, [0.0] * n_buckets)
        counts[last - 1] = [a + b for a, b in zip(before, sliver, strict=True)]
        outside[last - 1] = outside.get(last - 1, 0.0) + outside.pop(last, 0.0)
        last -= 1
    windows = []
    for k in range(last + 1):
        if not timed:
            duration = 1.0
        elif not window_s:
            start = span[0] if start_s is None else min(start_s, span[0])
            duration = max(end - start, 1.0)
        elif tail_s:
            duration = window_s + tail_s if k == last else window_s
        elif k < last:
            duration = window_s
        else:  # the trace's last window: only the part of it the trace covers
            duration = min(window_s, max(end - k * window_s, 1.0))
        row = counts.get(k, [0.0] * n_buckets)
        windows.append(Window(duration, tuple(c / duration for c in row), outside.get(k, 0.0) / duration))
    if rate is not None:
        peak = max(w.total for w in windows)
        scale = rate / peak if peak else 0.0
        windows = [
            Window(w.duration_s, tuple(r * scale for r in w.rates), w.out_of_range * scale) for w in windows
        ]
    return ModelWorkload(model, tuple(input_edges), tuple(output_edges), tuple(windows))
