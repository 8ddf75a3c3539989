"""Which profile serves a target SLO: one per (model, GPU, tp, role), the loosest measured within it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from placement.binpacking import PlacementError
from placement.catalog import Catalog, load_catalog
from placement.offers import canonical_gpu, canonical_model
from placement.profiles import Role, Slo, ThroughputProfile

Mode = Literal["auto", "mixed", "pd"]


def _relevant(target: Slo, role: Role) -> Slo:
    """The limits that bind an instance of this role: prefill → TTFT, decode → TPOT, mixed → all."""
    if role is Role.PREFILL:
        return Slo(ttft_ms=target.ttft_ms, e2e_ms=None)
    if role is Role.DECODE:
        return Slo(tpot_ms=target.tpot_ms)
    return target


def select_profiles(
    profiles: Sequence[ThroughputProfile],
    target: Slo | None,
    mode: Mode = "auto",
    catalog: Catalog | None = None,
) -> tuple[list[ThroughputProfile], list[str]]:
    """One profile per (model, GPU, tp, role): the loosest one measured at or under the target SLO.

    Model and GPU are compared by their catalog names: `gpu: a100` and `gpu: A100-80GB` are one GPU (two
    options of one key were counted twice). With no target every profile is used as given, and two for
    the same key is an error (which SLO?); so are two at the loosest fitting SLO (which measurement?).
    `mode` keeps mixed only, P/D only, or both ("auto": the solver picks per bucket).
    """
    catalog = catalog or load_catalog()
    keep = {"auto": set(Role), "mixed": {Role.MIXED}, "pd": {Role.PREFILL, Role.DECODE}}[mode]
    by_key: dict[tuple[str, str, int, Role], list[ThroughputProfile]] = {}
    for p in profiles:
        if p.role in keep:
            key = (canonical_model(p.model, catalog), canonical_gpu(p.gpu, catalog), p.tp, p.role)
            by_key.setdefault(key, []).append(p)
    chosen: list[ThroughputProfile] = []
    notes: list[str] = []
    for key, group in by_key.items():
        label = (
            f"{key[0]}/{key[1]}"
            + (f"/tp{key[2]}" if key[2] > 1 else "")
            + ("" if key[3] is Role.MIXED else f"/{key[3].value}")
        )
        if target is None:
            if len(group) > 1:
                raise PlacementError(
                    f"{len(group)} profiles for {label} (SLOs {[_slo_text(p.slo) for p in group]}): give the SLO to choose"
                )
            chosen.append(group[0])
            continue
        need = _relevant(target, key[3])
        fit = [p for p in group if p.slo.within(need)]
        if not fit:
            notes.append(
                f"{label}: no profile at or under {_slo_text(need)} (have {', '.join(_slo_text(p.slo) for p in group)}); not used"
            )
            continue
        # loosest in the limits that bind this role only: a prefill profile measured with no TPOT limit is
        # not looser for prefill than one at the target's TTFT (it would win on TPOT = ∞ first)
        best = max(fit, key=lambda p: _looseness(_relevant(p.slo, key[3])))
        loosest = _looseness(_relevant(best.slo, key[3]))
        tables = {
            (p.input_edges, p.output_edges, p.max_rate)
            for p in fit
            if _looseness(_relevant(p.slo, key[3])) == loosest
        }
        if len(tables) > 1:  # two different measurements of one thing: the answer followed --profile order
            raise PlacementError(
                f"{len(tables)} different profiles for {label} at one SLO ({_slo_text(_relevant(best.slo, key[3]))}): "
                "give one of them"
            )
        if _relevant(best.slo, key[3]) != need:
            notes.append(
                f"{label}: profile measured at {_slo_text(best.slo)} used for {_slo_text(need)} (conservative)"
            )
        chosen.append(best)
    return chosen, notes


def one_slo_per_role(used: Sequence[ThroughputProfile]) -> str:
    """Without a target the plan holds at the profiles' own SLO: the ones a plan uses (offered GPUs, models
    of the workload) must share one per role, in the limits that bind it, or a fleet of 120 ms profiles
    beside 40 ms ones would be planned, and shown, as if it held at either. Returns the note naming it."""
    slos: dict[Role, set[str]] = {}
    for p in used:
        slos.setdefault(p.role, set()).add(_slo_text(_relevant(p.slo, p.role)))
    mixed = {role: sorted(texts) for role, texts in slos.items() if len(texts) > 1}
    if mixed:
        role, texts = next(iter(mixed.items()))
        raise PlacementError(
            f"the {role.value} profiles were measured at different SLOs ({'; '.join(texts)}): give the target"
            " SLO (--slo-tpot-ms, --slo-ttft-ms) to choose the ones that meet it"
        )
    held = "; ".join(f"{role.value} {next(iter(texts))}" for role, texts in sorted(slos.items()))
    return f"no target SLO given: the plan holds at the profiles' SLO ({held})"


def _looseness(slo: Slo) -> tuple[float, float, float]:
    """Order of profiles by their limits, TPOT then TTFT then E2E; an unset limit is the loosest."""
    return tuple(math.inf if v is None else v for v in (slo.tpot_ms, slo.ttft_ms, slo.e2e_ms))  # type: ignore[return-value]


def _slo_text(slo: Slo) -> str:
    parts = [
        f"{n} {v:g} ms"
        for n, v in (("TPOT", slo.tpot_ms), ("TTFT", slo.ttft_ms), ("E2E", slo.e2e_ms))
        if v is not None
    ]
    return ", ".join(parts) or "no SLO"
