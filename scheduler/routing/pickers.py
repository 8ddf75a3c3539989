"""Picker plugins: order the scored candidates best first; the framework reserves down that order.

| type | order | ties |
|---|---|---|
| `max-score` | highest weighted total Σ wᵢ·sᵢ first | a random key per candidate from the cycle's rng |
| `round-robin` | candidates sorted by id, starting after the one picked last | none (ids are unique) |
| `least-loaded` | fewest requests first (demand = max(in-flight, running + waiting)), raw counts | rng |

`least-loaded` deliberately ignores GPU capacity (Envoy's LEAST_REQUEST): the baseline `mosaic` beats.
Totals within 1e-9 of each other count as ties, so float noise in a weighted sum does not decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from scheduler.fleet import WorkerView
from scheduler.routing.framework import Cycle, PluginParams, Scored

_TIE = 1e-9


class NoParams(PluginParams):
    """No parameters: any key is refused."""


class MaxScorePicker:
    type: ClassVar[str] = "max-score"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def pick(self, cycle: Cycle, scored: Sequence[Scored]) -> list[WorkerView]:
        # One rng draw per candidate, always, so the number of draws (and the replay) does not depend on
        # whether there happened to be a tie.
        if len(scored) == 1:  # the gateway's common case with one candidate left: same draw, no sort
            cycle.rng.random()
            return [scored[0].worker]
        draws = [cycle.rng.random() for _ in scored]
        order = sorted(range(len(scored)), key=lambda i: -scored[i].total)
        # Ties: totals within _TIE of their group's best, whatever their digits (rounding to multiples of
        # _TIE split two totals 2e-10 apart across a boundary), each group ordered by its draws.
        out: list[WorkerView] = []
        group = [order[0]]
        for i in order[1:]:
            if scored[group[0]].total - scored[i].total > _TIE:
                group.sort(key=draws.__getitem__)
                out.extend(scored[j].worker for j in group)
                group = []
            group.append(i)
        group.sort(key=draws.__getitem__)
        out.extend(scored[j].worker for j in group)
        return out


class RoundRobinPicker:
    """Rotates over candidate ids. The cursor is the picker's only state: the id it put first last time."""

    type: ClassVar[str] = "round-robin"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()
        self.last: str | None = None

    def pick(self, cycle: Cycle, scored: Sequence[Scored]) -> list[WorkerView]:
        workers = sorted((s.worker for s in scored), key=lambda w: w.id)
        start = 0
        if self.last is not None:
            start = next((i for i, w in enumerate(workers) if w.id > self.last), 0)
        ordered = workers[start:] + workers[:start]
        self.last = ordered[0].id
        return ordered


class LeastLoadedPicker:
    type: ClassVar[str] = "least-loaded"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def pick(self, cycle: Cycle, scored: Sequence[Scored]) -> list[WorkerView]:
        keyed = [(s.worker.demand, cycle.rng.random(), i) for i, s in enumerate(scored)]
        keyed.sort()
        return [scored[i].worker for _, _, i in keyed]
