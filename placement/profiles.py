"""Throughput profile files: the max request rate one instance sustains per (input, output) length bucket.

The planner's view of a GPU type (INTERFACES.md §5). YAML or JSON, versioned:

```yaml
schema: mosaic.profile/v1
model: llama-3-8b
gpu: A100-80GB
tp: 1                  # GPUs per instance; max_rate is per instance (one GPU when tp = 1)
role: mixed            # mixed | prefill | decode (added to §5; default mixed)
source: sim            # sim | url | manual | aibrix | melange
slo: {tpot_ms: 40, ttft_ms: null}          # e2e_ms also accepted; null = not constrained
input_edges: [1, 256, 1024, 4096, 8193]    # input bucket i = [edges[i], edges[i+1]) tokens
output_edges: [1, 64, 256, 1024, 2049]
max_rate: [[...], ...]                     # req/s within the SLO for (input i, output j); 0 = cannot
measured: [[{rate, ttft_p90_ms, tpot_p90_ms, n}, ...], ...]   # optional (null cells allowed), at max_rate
```

`load_profile(path)` validates with pydantic and raises `ProfileError` naming the file and the field
(`max_rate[2][1]`); `save_profile(profile, path)` writes YAML for `.yaml`/`.yml`, JSON otherwise.
`profile_from_aibrix(path)` imports AIBrix's Mélange-format profile files (see its docstring).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from placement.counts import MAX_PLAN_INSTANCES
from placement.textfiles import parse_json, parse_yaml, read_text

SCHEMA = "mosaic.profile/v1"


class ProfileError(ValueError):
    """A malformed or unreadable profile file; the message names the file and the field."""


class Role(StrEnum):
    """What an instance does: whole requests (mixed), or one phase of disaggregated serving."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class Slo(BaseModel):
    """Latency targets a profile was measured against, in ms; None = not constrained."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tpot_ms: float | None = Field(default=None, gt=0)
    ttft_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)

    def within(self, target: Slo) -> bool:
        """True when a profile measured at this SLO is safe for `target`: every limit at least as tight.

        A rate sustained under a tighter latency limit is sustained under a looser one too, so a profile
        measured at TPOT 40 ms is a (conservative) profile for a 120 ms target, never the reverse.
        """
        for mine, theirs in (
            (self.tpot_ms, target.tpot_ms),
            (self.ttft_ms, target.ttft_ms),
            (self.e2e_ms, target.e2e_ms),
        ):
            if theirs is not None and (mine is None or mine > theirs):
                return False
        return True


class MeasuredPoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    rate: float = Field(ge=0)
    ttft_p90_ms: float | None = Field(default=None, ge=0)
    tpot_p90_ms: float | None = Field(default=None, ge=0)
    n: int = Field(default=0, ge=0)


class ThroughputProfile(BaseModel):
    """One (model, GPU, tp, role) profile. `max_rate[i][j]` is req/s for input bucket i, output bucket j."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_: Literal["mosaic.profile/v1"] = Field(default="mosaic.profile/v1", alias="schema")
    model: str = Field(min_length=1)
    gpu: str = Field(min_length=1)
    tp: int = Field(default=1, ge=1, le=MAX_PLAN_INSTANCES)
    role: Role = Role.MIXED
    source: Literal["sim", "url", "manual", "aibrix", "melange"] = "manual"
    slo: Slo = Slo()
    input_edges: tuple[int, ...]
    output_edges: tuple[int, ...]
    max_rate: tuple[tuple[float, ...], ...]
    measured: tuple[tuple[MeasuredPoint | None, ...], ...] | None = None

    @field_validator("input_edges", "output_edges")
    @classmethod
    def _edges_increase(cls, edges: tuple[int, ...]) -> tuple[int, ...]:
        if len(edges) < 2:
            raise ValueError("needs at least two edges (one bucket)")
        if edges[0] < 0 or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"edges must be ≥ 0 and strictly increasing, got {list(edges)}")
        return edges

    @field_validator("max_rate")
    @classmethod
    def _rates_finite(cls, rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        for i, row in enumerate(rows):
            for j, value in enumerate(row):
                if not math.isfinite(value) or value < 0:
                    raise ValueError(f"[{i}][{j}] must be a finite number ≥ 0, got {value}")
        return rows

    @model_validator(mode="after")
    def _shapes_match(self) -> ThroughputProfile:
        shape = (len(self.input_edges) - 1, len(self.output_edges) - 1)
        _check_shape("max_rate", self.max_rate, shape)
        if self.measured is not None:
            _check_shape("measured", self.measured, shape)
        return self

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.input_edges) - 1, len(self.output_edges) - 1

    @property
    def key(self) -> tuple[str, str, int, Role]:
        return self.model, self.gpu, self.tp, self.role

    def flat_rates(self) -> tuple[float, ...]:
        """Rates in bucket order b = i · n_out + j (the order every solver input uses)."""
        return tuple(v for row in self.max_rate for v in row)

    def rate_for(self, input_tokens: int, output_tokens: int) -> float:
        """Max req/s for a request of these lengths; 0 outside the profiled range."""
        i = bucket_index(self.input_edges, input_tokens)
        j = bucket_index(self.output_edges, output_tokens)
        return 0.0 if i is None or j is None else self.max_rate[i][j]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=False)


def _check_shape(name: str, rows: Sequence[Sequence[Any]], shape: tuple[int, int]) -> None:
    if len(rows) != shape[0]:
        raise ValueError(f"{name} has {len(rows)} rows, but input_edges define {shape[0]} input buckets")
    for i, row in enumerate(rows):
        if len(row) != shape[1]:
            raise ValueError(
                f"{name}[{i}] has {len(row)} cells, but output_edges define {shape[1]} output buckets"
            )


def bucket_index(edges: Sequence[int], value: int) -> int | None:
    """i with edges[i] ≤ value < edges[i+1], or None outside [edges[0], edges[-1])."""
    if value < edges[0] or value >= edges[-1]:
        return None
    return bisect.bisect_right(edges, value) - 1


def bucket_label(edges: Sequence[int], i: int) -> str:
    """`[lo, hi)` of bucket i, as printed in plan tables."""
    return f"[{edges[i]},{edges[i + 1]})"


def _format_loc(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(root)"


def profile_from_dict(data: Any, origin: str = "<profile>") -> ThroughputProfile:
    """Validate parsed YAML/JSON; errors read `origin: field max_rate[2][1]: message`."""
    if not isinstance(data, dict):
        raise ProfileError(f"{origin}: a profile must be a mapping, got {type(data).__name__}")
    if "schema" not in data:
        raise ProfileError(f"{origin}: field schema: missing (expected {SCHEMA!r})")
    try:
        return ThroughputProfile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        field = _format_loc(["schema" if p == "schema_" else p for p in err["loc"]])
        if not err["loc"]:  # model-level check (shapes): the message names the field itself
            raise ProfileError(f"{origin}: {msg}") from None
        if msg.startswith("["):  # a cell check reports its own index: max_rate[2][1]
            field, msg = (
                field + msg[: msg.index("]", msg.index("]") + 1) + 1],
                msg[msg.index("]", msg.index("]") + 1) + 2 :],
            )
        raise ProfileError(f"{origin}: field {field}: {msg}") from None


def read_structured(path: str | Path, error: type[ValueError] = ProfileError) -> Any:
    """Parse a YAML or JSON file (JSON is YAML, but JSON errors read better from `json`)."""
    path = Path(path)
    text = read_text(path, error, f"{path}: cannot read: ")
    if path.suffix.lower() != ".json":
        return parse_yaml(text, error, f"{path}: not valid YAML")
    return parse_json(text, error, f"{path}: not valid JSON")


def load_profile(path: str | Path) -> ThroughputProfile:
    return profile_from_dict(read_structured(path), str(path))


def save_profile(profile: ThroughputProfile, path: str | Path) -> None:
    """Write YAML for .yaml/.yml paths, JSON otherwise; `load_profile` reads it back equal."""
    path = Path(path)
    data = profile.to_dict()
    if path.suffix.lower() in (".yaml", ".yml"):
        path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120))
    else:
        path.write_text(json.dumps(data, indent=2) + "\n")


def profile_from_aibrix(path: str | Path, *, model: str, gpu: str, tp: int = 1) -> ThroughputProfile:
    """Import an AIBrix gpu_optimizer profile (`{"gpu", "cost", "tputs", "indexes", "slos"?}`).

    AIBrix writes `tputs[o][i]` for output length `indexes[0][o]` and input length `indexes[1][i]` (its
    gen_profile.py builds the matrix output-major), each the throughput measured *at* that length. We
    transpose to input-major and turn the profiled points p_0 < p_1 < … into buckets (p_{k-1}, p_k]: edges
    [1, p_0+1, p_1+1, …]. A request is charged the rate of the next profiled length at or above its own,
    which is conservative because rates fall as requests grow. AIBrix's e2e SLO (seconds) becomes e2e_ms.
    """
    data = read_structured(path)
    origin = str(path)
    try:
        outs, ins = (list(map(int, axis)) for axis in data["indexes"])
        tputs = data["tputs"]
        max_rate = [[float(tputs[o][i]) for o in range(len(outs))] for i in range(len(ins))]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ProfileError(
            f"{origin}: not an AIBrix profile (needs tputs[output][input] and indexes): {exc}"
        ) from None
    slos = data.get("slos") or {}
    e2e_s = slos.get("e2e")
    body = {
        "schema": SCHEMA,
        "model": model,
        "gpu": gpu,
        "tp": tp,
        "source": "aibrix",
        "slo": {"e2e_ms": float(e2e_s) * 1000 if e2e_s else None},
        "input_edges": [1, *(p + 1 for p in ins)],
        "output_edges": [1, *(p + 1 for p in outs)],
        "max_rate": max_rate,
    }
    return profile_from_dict(body, origin)
