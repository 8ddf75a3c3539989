"""The cluster driver's engine loop: a step in which the engine preempted everything it ran (it did no work,
so it is "idle") is followed by another at once, as vLLM's engine loop, `run_offline` and the simulated
worker's runtime do; and what that step reported (remote KV that landed) is applied, so the prefill side
learns its transfer landed."""

from __future__ import annotations

import heapq

from scheduler.autoscaler.factory import build_policy
from simulator.cluster import ClusterSimulator, _Ev
from simulator.cluster_config import parse_fleet, pool_specs
from tests.simulator.test_engine_review_fixes import preempted_as_remote_kv_lands

FLEET = {
    "model": "llama-3-8b",
    "pools": [{"name": "mixed-h100", "gpu": "H100", "role": "mixed", "replicas": 1}],
}


def test_a_step_that_preempted_everything_is_followed_by_another_at_once() -> None:
    """A decodes alone and needs a block in the step R's remote KV lands, R holding the rest of the pool: A
    is preempted, no admission in that step (vLLM's rule), so the step ran nothing. R could run in the
    next step; the driver stopped stepping the instance instead, until something else kicked it (here
    nothing would: A and R never finished)."""
    engine = preempted_as_remote_kv_lands()

    fleet = parse_fleet(FLEET)
    sim = ClusterSimulator(fleet, build_policy("fixed", pool_specs(fleet), fleet.autoscaler_config(), {}))
    sim.topology.place_initial()
    inst = sim._start_instance("mixed-h100", 0.0, cold=False)
    unit = inst.ranks[0]
    unit.engine = engine
    sim._kick(unit, 0.0)
    preempting = []
    step = engine.step

    def recording_step(now: float):  # type: ignore[no-untyped-def]
        result = step(now)
        if result.idle and result.preempted:
            preempting.append((now, result.kv_received))
        return result

    engine.step = recording_step  # type: ignore[method-assign]
    applied: list[tuple[str, ...]] = []
    apply = sim._apply

    def recording_apply(inst, result, now):  # type: ignore[no-untyped-def]
        applied.append(result.kv_received)
        apply(inst, result, now)

    sim._apply = recording_apply  # type: ignore[method-assign]
    while sim._heap:  # the engine's own events only: no arrivals, scrapes or decisions were scheduled
        t, _, _, kind, obj = heapq.heappop(sim._heap)
        assert kind is _Ev.STEP
        sim._on_step(obj, t)
    assert preempting == [(preempting[0][0], ("R",))]  # the scenario: one step preempted A as R landed
    assert (
        not engine.has_work() and engine.kv.used == 0
    )  # both ran to the end, with nothing else to wake them
    assert engine.counters.generation_tokens == 200 + 50
    # R's landing, reported by the step that ran nothing, reached the driver (on P/D it frees the prefill
    # side's held copy of R's KV); before, idle results were dropped and the hold lasted to its timeout
    assert applied.count(("R",)) == 1
