"""Numeric fields of the files users hand the planner (GPU offers, Mélange inputs, node inventories).

`whole_number` is the one check every count goes through: a finite whole number (2 and 2.0 both read as 2)
at or above a minimum, never a bool, a string, 1.9 truncated to 1, nor .inf/.nan passed to `int()` (an
OverflowError/ValueError traceback). A bad value raises the caller's error type, naming file and field.
"""

from __future__ import annotations

import math
from typing import Any


def whole_number(value: Any, where: str, minimum: int, error: type[ValueError]) -> int:
    """`value` as an int; `error("{where} must be a whole number ≥ {minimum}, got {value!r}")` otherwise.

    `where` names the file and field, e.g. "gpus.yaml: GPU A10G: max"."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and isinstance(value, float):
        ok = math.isfinite(value) and value.is_integer()
    if not ok or value < minimum:
        raise error(f"{where} must be a whole number ≥ {minimum}, got {value!r}")
    return int(value)


def finite_number(value: Any, where: str, minimum: float, error: type[ValueError]) -> float:
    """`value` as a float; `error("{where} must be a finite number ≥ {minimum}, got {value!r}")` otherwise.

    YAML's `yes` and `"3"` are a bool and a string, not numbers, and `.inf` is no price."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum:
        raise error(f"{where} must be a finite number ≥ {minimum:g}, got {value!r}")
    return float(value)
