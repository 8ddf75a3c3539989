"""Mélange's input JSON, read as is, so Mélange users can switch and compare (`mosaic plan --melange F`).

```json
{"gpu_info": {"A10G": {"cost": 1.01, "tputs": [[2, 1], [5, 2]]},
              "A100-80GB": {"cost": 3.67, "tputs": [[20, 20], [40, 20]]}},
 "workload_distribution": [[0.2, 0.1], [0.5, 0.2]],
 "total_request_rate": 30.0,
 "slice_factor": 1}
```
`tputs[i][j]` is the max req/s one GPU sustains for input bucket i, output bucket j; bucket (i, j) receives
`workload_distribution[i][j] · total_request_rate` req/s. As in Mélange, the distribution is used as
written (not renormalised; a sum other than 1 is reported in `notes`). Additions others made to the format
are accepted: `max_count`/`min_count` per GPU (AIBrix's Mélange fork); keys starting with `_` are comments.
A throughput of 0 means "cannot serve within the SLO" (Mélange itself would divide by zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from placement.binpacking import Demand, GpuOffer, InstanceOption, MixProblem, MixSolution, PlacementError
from placement.counts import MAX_COST_PER_HOUR, MAX_PLAN_INSTANCES, finite_number, whole_number
from placement.profiles import read_structured

MELANGE_MODEL = "melange"  # Mélange inputs describe one model; its options are keyed melange/<GPU>


class MelangeFormatError(PlacementError):
    """A Mélange input that does not follow its schema; the message names the file and key."""


@dataclass(frozen=True, slots=True)
class MelangeInput:
    problem: MixProblem
    slice_factor: int
    shape: tuple[int, int]  # (input buckets, output buckets)
    total_rate: float
    notes: tuple[str, ...] = ()


def _matrix(value: Any, where: str, shape: tuple[int, int] | None = None) -> list[list[float]]:
    if not isinstance(value, list) or not value or not all(isinstance(r, list) and r for r in value):
        raise MelangeFormatError(f"{where}: must be a non-empty list of non-empty lists")
    try:
        rows = [[float(v) for v in row] for row in value]
    except (TypeError, ValueError):
        raise MelangeFormatError(f"{where}: every cell must be a number") from None
    except OverflowError:  # an integer past float range (10**400)
        raise MelangeFormatError(f"{where}: cells must be finite and ≥ 0") from None
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise MelangeFormatError(f"{where}: rows have different lengths")
    if shape is not None and (len(rows), width) != shape:
        raise MelangeFormatError(
            f"{where}: shape {len(rows)}×{width} differs from workload_distribution's {shape[0]}×{shape[1]}"
        )
    if any(not math.isfinite(v) or v < 0 for r in rows for v in r):
        raise MelangeFormatError(f"{where}: cells must be finite and ≥ 0")
    return rows


def melange_from_dict(data: Any, origin: str = "<melange>") -> MelangeInput:
    if not isinstance(data, dict):
        raise MelangeFormatError(f"{origin}: a Mélange input is a JSON object")
    known = {"gpu_info", "workload_distribution", "total_request_rate", "slice_factor"}
    unknown = sorted(k for k in data if k not in known and not str(k).startswith("_"))
    if unknown:
        raise MelangeFormatError(f"{origin}: unknown key(s) {unknown}; Mélange's keys are {sorted(known)}")
    for key in ("gpu_info", "workload_distribution", "total_request_rate"):
        if key not in data:
            raise MelangeFormatError(f"{origin}: missing key {key!r}")
    dist = _matrix(data["workload_distribution"], f"{origin}: workload_distribution")
    shape = (len(dist), len(dist[0]))
    rate = finite_number(data["total_request_rate"], f"{origin}: total_request_rate", 0, MelangeFormatError)
    if rate == 0 or sum(map(sum, dist)) == 0:
        raise MelangeFormatError(f"{origin}: total request rate is 0 req/s: nothing to place")
    k = whole_number(
        data.get("slice_factor", 1), f"{origin}: slice_factor", 1, MelangeFormatError, MAX_PLAN_INSTANCES
    )
    gpu_info = data["gpu_info"]
    if not isinstance(gpu_info, dict) or not gpu_info:
        raise MelangeFormatError(f"{origin}: gpu_info must map GPU names to {{cost, tputs}}")
    offers: dict[str, GpuOffer] = {}
    options = []
    for name, info in gpu_info.items():
        where = f"{origin}: gpu_info.{name}"
        if not isinstance(info, dict) or "cost" not in info or "tputs" not in info:
            raise MelangeFormatError(f"{where}: needs 'cost' and 'tputs'")
        extra = sorted(set(info) - {"cost", "tputs", "max_count", "min_count"})
        if extra:
            raise MelangeFormatError(f"{where}: unknown key(s) {extra}")
        tputs = _matrix(info["tputs"], f"{where}.tputs", shape)
        cost = finite_number(info["cost"], f"{where}.cost", 0, MelangeFormatError, MAX_COST_PER_HOUR)
        low = whole_number(
            info.get("min_count", 0), f"{where}.min_count", 0, MelangeFormatError, MAX_PLAN_INSTANCES
        )
        cap = info.get("max_count")
        high = (
            None
            if cap is None
            else whole_number(cap, f"{where}.max_count", 0, MelangeFormatError, MAX_PLAN_INSTANCES)
        )
        try:
            offers[name] = GpuOffer(name, cost, low, high)
        except (TypeError, ValueError) as exc:
            raise MelangeFormatError(f"{where}: {exc}") from None
        options.append(InstanceOption(MELANGE_MODEL, name, tuple(v for row in tputs for v in row)))
    demand = Demand(MELANGE_MODEL, tuple(f * rate for row in dist for f in row))
    total = sum(map(sum, dist))
    notes = (
        ()
        if math.isclose(total, 1.0, rel_tol=1e-9)
        else (f"workload_distribution sums to {total:g}, used as written (as Mélange does)",)
    )
    return MelangeInput(MixProblem(offers, tuple(options), ((demand,),)), k, shape, rate, notes)


def load_melange(path: str | Path) -> MelangeInput:
    return melange_from_dict(read_structured(path, MelangeFormatError), str(path))


def melange_output(solution: MixSolution) -> dict[str, float]:
    """Mélange's own result dict: GPUs per type (every offered type, 0 when unused) and `cost` in $/h."""
    out: dict[str, float] = {k.split("/", 1)[1]: float(n) for k, n in solution.counts.items()}
    out["cost"] = solution.cost_per_hour
    return out
