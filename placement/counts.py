"""Numeric fields of the files users hand the planner (GPU offers, Mélange inputs, node inventories).

`whole_number` is the one check every count goes through: a finite whole number (2 and 2.0 both read as 2)
at or above a minimum, never a bool, a string, 1.9 truncated to 1, nor .inf/.nan passed to `int()` (an
OverflowError/ValueError traceback). A bad value raises the caller's error type, naming file and field.
"""

from __future__ import annotations

import math
from typing import Any

# The most instances a plan may need even on the fastest option per bucket, and the most GPUs or instances
# any count in an input may name (min, max, tp, a node's GPUs). The largest fleets are ~1e5 GPUs; past this
# a rate is in the wrong unit, and past ~1e18 the solvers' integer domains overflow (float LP bounds lose
# whole units much earlier: a min of 1e23 came back as a plan below it).
MAX_PLAN_INSTANCES = 10_000_000
# The dearest a GPU-hour may be, in $. Prices past ~1e50 made SCIP's objective infinite ("no solution
# within the time limit"); no GPU costs a million dollars an hour.
MAX_COST_PER_HOUR = 1e6


def whole_number(
    value: Any, where: str, minimum: int, error: type[ValueError], maximum: int | None = None
) -> int:
    """`value` as an int; `error("{where} must be a whole number ≥ {minimum}, got {value!r}")` otherwise,
    and `error("{where} must be ≤ {maximum} ...")` above `maximum` (when given).

    `where` names the file and field, e.g. "gpus.yaml: GPU A10G: max"."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and isinstance(value, float):
        ok = math.isfinite(value) and value.is_integer()
    if not ok or value < minimum:
        raise error(f"{where} must be a whole number ≥ {minimum}, got {value!r}")
    _at_most(value, maximum, where, error)
    return int(value)


def finite_number(
    value: Any, where: str, minimum: float, error: type[ValueError], maximum: float | None = None
) -> float:
    """`value` as a float; `error("{where} must be a finite number ≥ {minimum}, got {value!r}")` otherwise,
    and `error("{where} must be ≤ {maximum} ...")` above `maximum` (when given).

    YAML's `yes` and `"3"` are a bool and a string, not numbers, and `.inf` is no price; an integer too
    large for a float (10**400) is not finite either."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and _finite(value)
    if not ok or value < minimum:
        raise error(f"{where} must be a finite number ≥ {minimum:g}, got {_short(value)}")
    _at_most(value, maximum, where, error)
    return float(value)


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past float range
        return False


def _short(value: Any) -> str:
    """`repr(value)`, with an integer of more than 20 digits written as a float (1e+400), or its digit count."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        try:
            return f"{float(value):g}"
        except OverflowError:
            return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _at_most(value: float, maximum: float | None, where: str, error: type[ValueError]) -> None:
    """Values past what the solvers handle exactly (their float bounds and integer domains): refused."""
    if maximum is not None and value > maximum:
        limit = f"{int(maximum):,}" if float(maximum).is_integer() else f"{maximum:g}"
        raise error(f"{where} must be ≤ {limit} (the planner's limit), got {_short(value)}")
