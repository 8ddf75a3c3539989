"""Cost-aware bin-packing of request-size buckets onto GPU types: Mélange's ILP, without its symmetry.

Problem (Mélange, arXiv 2404.14527, generalised). Instance options o (a model on `tp` GPUs of one type in
one role), each with a per-bucket max rate r_ob (req/s one instance sustains within the SLO; 0 = cannot).
Demand λ_wmb (req/s of model m in bucket b during window w). Integer instance counts N_o.

    minimise   Σ_o tp_o · cost_gpu(o) · N_o
    shares     s_wmbo ∈ [0, U]     integers ("sliced": U = k slices per bucket) or reals (U = 1, "continuous")
    serve      Σ_{o mixed} s_wmbo + Σ_{o prefill} s_wmbo = U              every bucket fully served
    P/D        Σ_{o decode} s_wmbo = Σ_{o prefill} s_wmbo               what is prefilled is decoded
    load       Σ_{m,b} s_wmbo · λ_wmb / (U · r_ob) ≤ N_o   for every w   (one static fleet serves every window)
    GPUs       min_g ≤ Σ_{o on g} tp_o · N_o ≤ max_g                    availability per GPU type

Mélange writes the sliced case with one binary per (slice, type): k interchangeable slices per bucket
make k! symmetric copies of every solution, which is why CBC cannot close the gap at 36 buckets × 4
types × k = 4. Counting slices per (bucket, option) is the same model without that symmetry: any binary
assignment maps to counts and back. The continuous variant only relaxes the shares, so it is never more
expensive. No variable exists for r_ob = 0; a bucket with demand and no serving path is reported.

Exactness: every solution is re-checked in floating point (`verify`) — loads within `LOAD_TOL` relative of
N_o count as fitting, since 0.2 · 30 = 6.000000000000001 in binary and the user meant 6.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from placement.counts import MAX_COST_PER_HOUR, MAX_PLAN_INSTANCES
from placement.profiles import Role

LOAD_TOL = 1e-9  # relative tolerance of the load check (float noise in decimal inputs)
# MAX_PLAN_INSTANCES and MAX_COST_PER_HOUR (placement.counts) bound what a problem may ask for


class PlacementError(ValueError):
    """Bad or unsatisfiable placement input; the message says what is wrong or short."""


class Variant(StrEnum):
    SLICED = "sliced"  # Mélange: each bucket cut into k equal slices, each served by one option
    CONTINUOUS = "continuous"  # any split of a bucket across options (only instance counts integer)


class Status(StrEnum):
    OPTIMAL = "optimal"  # proven optimal (gap 0 within the solver's tolerance)
    FEASIBLE = "feasible"  # time limit reached; the incumbent is returned with its gap
    INFEASIBLE = "infeasible"  # proven: no fleet within the caps serves the demand
    UNKNOWN = "unknown"  # time limit reached before any solution


@dataclass(frozen=True, slots=True)
class GpuOffer:
    """A GPU type one may rent: $/GPU-hour and how many GPUs (min, max = availability) of it."""

    name: str
    cost_per_hour: float
    min_gpus: int = 0
    max_gpus: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.cost_per_hour) or self.cost_per_hour < 0:
            raise PlacementError(
                f"GPU {self.name}: cost_per_hour must be a finite number ≥ 0, got {self.cost_per_hour}"
            )
        if self.cost_per_hour > MAX_COST_PER_HOUR:
            raise PlacementError(
                f"GPU {self.name}: cost_per_hour must be ≤ {MAX_COST_PER_HOUR:,.0f} $/h, got {self.cost_per_hour:g}"
            )
        if self.min_gpus < 0 or (self.max_gpus is not None and self.max_gpus < self.min_gpus):
            raise PlacementError(
                f"GPU {self.name}: need 0 ≤ min_gpus ≤ max_gpus, got {self.min_gpus}, {self.max_gpus}"
            )
        for label, n in (("min_gpus", self.min_gpus), ("max_gpus", self.max_gpus)):
            if n is not None and n > MAX_PLAN_INSTANCES:  # the loaders refuse these first, naming the file
                raise PlacementError(f"GPU {self.name}: {label} must be ≤ {MAX_PLAN_INSTANCES:,}, got {n}")


@dataclass(frozen=True, slots=True)
class InstanceOption:
    """One way to run an instance: `model` on `tp` GPUs of type `gpu`, in `role`, with per-bucket rates."""

    model: str
    gpu: str
    rates: tuple[float, ...]  # req/s one instance sustains, per bucket of the model's grid; 0 = cannot
    tp: int = 1
    role: Role = Role.MIXED
    min_instances: int = 0
    max_instances: int | None = None

    @property
    def key(self) -> str:
        """Stable name in outputs: `model/GPU`, `/tpN` when tp > 1, `/role` unless mixed."""
        tp = f"/tp{self.tp}" if self.tp > 1 else ""
        role = "" if self.role is Role.MIXED else f"/{self.role.value}"
        return f"{self.model}/{self.gpu}{tp}{role}"


@dataclass(frozen=True, slots=True)
class Demand:
    """Request rate of one model, per bucket (same bucket order as its options' rates), in req/s."""

    model: str
    rates: tuple[float, ...]

    @property
    def total(self) -> float:
        return sum(self.rates)


@dataclass(frozen=True, slots=True)
class MixProblem:
    """GPU offers, instance options and one or more windows of demand that one static fleet must serve."""

    gpus: Mapping[str, GpuOffer]
    options: tuple[InstanceOption, ...]
    windows: tuple[tuple[Demand, ...], ...]

    def option_cost(self, o: InstanceOption) -> float:
        return o.tp * self.gpus[o.gpu].cost_per_hour


@dataclass(frozen=True, slots=True)
class Path:
    """The options that can serve one (window, model, bucket): mixed ones, or a prefill + decode pair."""

    window: int
    model: str
    bucket: int
    rate: float
    mixed: tuple[int, ...]
    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    @property
    def servable(self) -> bool:
        return bool(self.mixed) or (bool(self.prefill) and bool(self.decode))

    @property
    def options(self) -> tuple[int, ...]:
        return self.mixed + self.prefill + self.decode if self.prefill and self.decode else self.mixed


@dataclass(frozen=True, slots=True)
class Unservable:
    model: str
    bucket: int
    rate: float  # req/s (the largest over windows) no option can serve within the SLO


def check_problem(problem: MixProblem) -> None:
    """Reject malformed input with one clear line (unknown GPU, rate vector length, negative rate)."""
    if not problem.options:
        raise PlacementError("no instance options: give at least one GPU type with a profile")
    lengths: dict[str, int] = {}
    for o in problem.options:
        if o.gpu not in problem.gpus:
            raise PlacementError(
                f"option {o.key}: GPU {o.gpu!r} is not among the offered GPUs {sorted(problem.gpus)}"
            )
        if any(not math.isfinite(r) or r < 0 for r in o.rates):
            raise PlacementError(f"option {o.key}: rates must be finite and ≥ 0")
        if lengths.setdefault(o.model, len(o.rates)) != len(o.rates):
            raise PlacementError(f"options of model {o.model} disagree on the number of buckets")
    for name, offer in problem.gpus.items():
        # a floor is paid for whatever serves: with no option on its GPU the solver would drop it, cost and all
        if offer.min_gpus > 0 and not any(o.gpu == name for o in problem.options):
            raise PlacementError(
                f"{name}: min {offer.min_gpus} GPU(s) must be paid for, but no instance option uses it: "
                "give it one (a profile, or a capacity of 0) or drop its min"
            )
    for window in problem.windows:
        for d in window:
            if d.model not in lengths:
                raise PlacementError(f"demand for model {d.model!r} but no option (profile) serves it")
            if len(d.rates) != lengths[d.model]:
                raise PlacementError(
                    f"demand for {d.model} has {len(d.rates)} buckets, its profiles {lengths[d.model]}"
                )
            if any(not math.isfinite(r) or r < 0 for r in d.rates):
                raise PlacementError(f"demand for {d.model}: rates must be finite and ≥ 0")
        least = _least_instances(problem, window)
        if least > MAX_PLAN_INSTANCES:
            raise PlacementError(
                f"the demand needs at least {least:.3g} instances even all on the fastest GPU type "
                f"(the planner stops at {MAX_PLAN_INSTANCES:,}): check the request rate's unit (req/s)"
            )


def _least_instances(problem: MixProblem, window: Sequence[Demand]) -> float:
    """A lower bound on one window's instance count: every bucket on its fastest option (no bucket shares)."""
    total = 0.0
    for d in window:
        for b, rate in enumerate(d.rates):
            fastest = max((o.rates[b] for o in problem.options if o.model == d.model), default=0.0)
            if rate > 0 and fastest > 0:  # unservable buckets are reported by serving_paths
                total += rate / fastest
    return total


def serving_paths(problem: MixProblem) -> tuple[list[Path], list[Unservable]]:
    """One Path per (window, model, bucket) with demand; buckets nobody can serve are listed apart."""
    paths: list[Path] = []
    worst: dict[tuple[str, int], float] = {}
    for w, window in enumerate(problem.windows):
        for d in window:
            for b, rate in enumerate(d.rates):
                if rate <= 0:
                    continue
                by_role: dict[Role, list[int]] = {r: [] for r in Role}
                for idx, o in enumerate(problem.options):
                    if o.model == d.model and o.rates[b] > 0:
                        by_role[o.role].append(idx)
                path = Path(
                    w, d.model, b, rate, *(tuple(by_role[r]) for r in (Role.MIXED, Role.PREFILL, Role.DECODE))
                )
                if path.servable:
                    paths.append(path)
                else:
                    worst[(d.model, b)] = max(rate, worst.get((d.model, b), 0.0))
    return paths, [Unservable(m, b, r) for (m, b), r in sorted(worst.items())]


@dataclass(frozen=True, slots=True)
class EngineResult:
    """What an engine returns: integer counts per option and share values per (path, option)."""

    status: Status
    counts: tuple[int, ...]
    shares: tuple[Mapping[int, float], ...]  # per path: option index → share in [0, U]
    objective: float | None  # $/h as the engine saw it
    bound: float | None  # best proven lower bound on the $/h
    wall_s: float
    engine: str
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MixSolution:
    """A verified fleet. `fractions[w][(model, bucket)]` maps option key → share of that bucket's rate."""

    status: Status
    variant: Variant
    slice_factor: int
    engine: str
    counts: Mapping[str, int]  # option key → instances
    gpus: Mapping[str, int]  # GPU type → GPUs (instances · tp)
    cost_per_hour: float
    gap: float  # (cost − bound) / cost, 0 when optimal
    bound: float
    wall_s: float
    fractions: tuple[Mapping[tuple[str, int], Mapping[str, float]], ...]
    loads: Mapping[str, float]  # option key → peak (over windows) load in instances
    unservable: tuple[Unservable, ...] = ()
    notes: tuple[str, ...] = field(default=())


def load_coefficients(problem: MixProblem, paths: Sequence[Path], units: int) -> list[dict[int, float]]:
    """a[p][o] = λ_p / (U · r_ob): instances of option o one unit of share of path p occupies."""
    coefs: list[dict[int, float]] = []
    for p in paths:
        coefs.append({o: p.rate / (units * problem.options[o].rates[p.bucket]) for o in p.options})
    return coefs


def window_loads(
    problem: MixProblem,
    paths: Sequence[Path],
    coefs: Sequence[Mapping[int, float]],
    shares: Sequence[Mapping[int, float]],
) -> dict[tuple[int, int], float]:
    """(window, option) → load in instances, from shares."""
    loads: dict[tuple[int, int], float] = {}
    for p, a, s in zip(paths, coefs, shares, strict=True):
        for o, value in s.items():
            if value:
                loads[(p.window, o)] = loads.get((p.window, o), 0.0) + a[o] * value
    return loads


def fits(load: float, count: int) -> bool:
    """load ≤ count, forgiving float noise of LOAD_TOL relative (see module docstring)."""
    return load <= count + LOAD_TOL * max(1.0, count)


def needed_instances(load: float) -> int:
    """The fewest instances carrying `load`: ⌈load⌉, except loads a hair above an integer (float noise)."""
    n = max(0, math.ceil(load))
    return n - 1 if n >= 1 and fits(load, n - 1) else n
