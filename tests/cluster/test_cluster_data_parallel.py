"""Data-parallel instances in the cluster simulator: a pool's `dp` (engines per instance, vLLM's
`--data-parallel-size`), each engine with the pool's engine settings and its own KV cache.

- billing and sizing: an instance is dp engines on tp × dp GPUs (GPU-hours, $, the autoscaler's per-instance
  capacity, topology placement);
- placement of requests: each hop runs on one engine, the one the KV ledger booked it on, else the one
  vLLM's API-server balancer picks (`simulator.data_parallel`), and the instance's engines all serve;
- the KV ledger books each engine on its own: the burst of `tests/gateway/test_sim_data_parallel.py` (ten
  1,000 + 600-token requests on two 467-block engines) runs without preemption per engine (4 + 4 at once,
  each pinned where it was booked) and preempts when the instance is booked as one pool (9 at once, 5 of
  them balanced onto one engine: 5 · 100 blocks > 467);
- determinism for a seed and conservation (every request completes or is counted failed, nothing left in
  any engine) with the autoscaler, P/D and scale-in around data-parallel instances.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from scheduler.autoscaler.factory import build_policy
from scheduler.kv.ledger import KvLedger, LedgerSettings
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import FleetConfigError, parse_fleet, pool_specs
from simulator.cluster_report import build_report

MODEL = "llama-3-8b"
BLOCKS = 467  # per engine: Llama-3-8B on an L4 at gpu_memory_utilization 0.75, as the gateway test's pool
BURST = 10
OUTPUT = 600


def mixed(dp: int, **pool: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "engine": {"num_gpu_blocks": BLOCKS},
        "pools": [{"name": "l4", "gpu": "L4", "dp": dp, "replicas": 1, **pool}],
    }


PD = {
    "model": MODEL,
    "slo": {"ttft_ms": 3000, "tpot_ms": 100},
    "cold_start_s": 20,
    "decision_interval_s": 5,
    "autoscaler": {"pd_ratio": 1.0, "scale_down_window_s": 20},
    "engine": {"max_num_seqs": 32, "num_gpu_blocks": 400},
    "pools": [
        {"name": "prefill", "gpu": "H100", "role": "prefill", "dp": 2, "replicas": 1, "max_replicas": 4},
        {
            "name": "decode",
            "gpu": "A100-80GB",
            "role": "decode",
            "dp": 2,
            "replicas": 1,
            "min_replicas": 1,
            "max_replicas": 4,
        },
    ],
}


def poisson(n: int, rate: float, seed: int, start: float = 0.0) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = start, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, rng.randint(100, 2000), rng.randint(10, 300)))
    return out


def simulator(fleet_data: dict[str, Any], policy_name: str = "fixed", **kw: Any) -> ClusterSimulator:
    fleet = parse_fleet(fleet_data)
    policy = build_policy(
        policy_name, pool_specs(fleet), fleet.autoscaler_config(), {p.name: p.replicas for p in fleet.pools}
    )
    return ClusterSimulator(fleet, policy, policy_name, **kw)


def record_engines(sim: ClusterSimulator) -> dict[str, dict[str, int]]:
    """instance id → {request id: the rank of the engine it was added to}, filled as the run goes. A
    request added to two engines of one instance, or twice to one, fails the run."""
    ran: dict[str, dict[str, int]] = {}
    start = sim._start_instance

    def starting(pool: str, now: float, cold: bool) -> Any:
        inst = start(pool, now, cold)
        placed = ran.setdefault(inst.id, {})
        for unit in inst.ranks:
            add = unit.engine.add_request

            def adding(
                req: Any, now: float, *a: Any, _add: Any = add, _rank: int = unit.index, **k: Any
            ) -> None:
                assert req.request_id not in placed, (inst.id, req.request_id, placed[req.request_id], _rank)
                placed[req.request_id] = _rank
                _add(req, now, *a, **k)

            unit.engine.add_request = adding  # type: ignore[method-assign]
        return inst

    sim._start_instance = starting  # type: ignore[method-assign]
    return ran


def record_bookings(ledger: KvLedger) -> dict[str, int | None]:
    """request id → the engine the ledger booked it on (the last reservation made for it)."""
    booked: dict[str, int | None] = {}
    reserve = ledger.reserve

    def reserving(req: Any, worker: Any, now: float) -> Any:
        res = reserve(req, worker, now)
        if res is not None:
            booked[res.request_id] = res.engine
        return res

    ledger.reserve = reserving  # type: ignore[method-assign]
    return booked


def stable(report: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in report.items() if k not in ("wall_s", "sim_requests_per_wall_s")})


# ---------------------------------------------------------------------------------------------------
# billing, sizing, placement on nodes


def test_a_dp2_instance_is_billed_twice_the_gpu_hours_and_dollars_of_a_dp1_instance() -> None:
    """One request on one instance of tp 2: it runs on one engine either way, so both runs last as long
    (the same instance-seconds), and the dp 2 instance is billed for 4 GPUs, the dp 1 one for 2."""
    results = {}
    for dp in (1, 2):
        data = {"model": MODEL, "pools": [{"name": "h100", "gpu": "H100", "tp": 2, "dp": dp, "replicas": 1}]}
        results[dp] = ClusterSimulator(parse_fleet(data), None, "fixed").run([SimRequest(0.0, 500, 40)])
    one, two = results[1], results[2]
    assert len(one.completed) == len(two.completed) == 1
    assert one.end_s == two.end_s > 0 and one.billed_seconds == two.billed_seconds == one.end_s
    assert one.instance_seconds == {"H100-SXM": 2 * one.billed_seconds}  # the catalog's name
    assert two.instance_seconds == {"H100-SXM": 4 * two.billed_seconds}
    assert two.cost_usd["H100-SXM"] == 2 * one.cost_usd["H100-SXM"] > 0


def test_the_autoscaler_sizes_and_prices_an_instance_as_dp_engines() -> None:
    """`pool_specs`: one engine's capacity within the SLO (its sequences, its KV) times dp
    (`InstanceCapacity.times`, as the gateway's `pool_spec`), and the catalog price × tp × dp."""
    one, two = (pool_specs(parse_fleet({**PD, "pools": [{**PD["pools"][1], "dp": dp}]}))[0] for dp in (1, 2))
    assert two.decode_tps_capacity == 2 * one.decode_tps_capacity > 0
    assert two.prefill_tps_capacity == 2 * one.prefill_tps_capacity > 0
    assert two.decode_tps_by_context == tuple((c, 2 * r) for c, r in one.decode_tps_by_context)
    assert two.cost_per_hour == 2 * one.cost_per_hour


def test_an_instance_takes_tp_times_dp_gpus_of_one_node() -> None:
    nodes = {"nodes": [{"name": f"n{i}", "gpu": "H100", "gpus": 4, "domain": "rack"} for i in range(2)]}
    pool = {"name": "h100", "gpu": "H100", "tp": 2, "dp": 2, "replicas": 2, "max_replicas": 3}
    sim = ClusterSimulator(parse_fleet({"model": MODEL, "nodes": nodes, "pools": [pool]}), None, "fixed")
    sim.run([SimRequest(0.0, 100, 4)])
    report = sim.topology.report()
    assert report is not None
    assert report["samples"][0]["used_gpus"] == 8 and report["samples"][0]["fragmented_nodes"] == 0
    with pytest.raises(
        FleetConfigError, match="do not fit"
    ):  # a third instance needs 4 more GPUs of one node
        sim = ClusterSimulator(
            parse_fleet({"model": MODEL, "nodes": nodes, "pools": [{**pool, "replicas": 3}]}), None, "fixed"
        )
        sim.run([SimRequest(0.0, 100, 4)])


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
def test_dp_is_validated_as_tp_is(bad: Any) -> None:
    """A bad `dp` is refused with the words a bad `tp` gets (both counts of at least 1, strict integers)."""
    errors = {}
    for key in ("tp", "dp"):
        with pytest.raises(FleetConfigError) as err:
            parse_fleet({"model": MODEL, "pools": [{"name": "l4", "gpu": "L4", key: bad}]})
        errors[key] = str(err.value)
    assert errors["dp"] == errors["tp"].replace("pools.0.tp", "pools.0.dp")


# ---------------------------------------------------------------------------------------------------
# where requests run


def test_requests_of_dp2_instances_run_on_both_engines_each_on_one() -> None:
    """P/D over a prefill and a decode instance of two engines each: every hop ran on one engine of its
    instance (`record_engines` refuses a second), both engines of each instance served."""
    reqs = poisson(200, 8, seed=5)
    sim = simulator(PD)
    ran = record_engines(sim)
    result = sim.run(reqs)
    assert len(result.completed) == len(reqs)
    prefill, decode = (next(i for i in sim._instances.values() if i.pool == p) for p in ("prefill", "decode"))
    for inst in (prefill, decode):
        assert set(ran[inst.id].values()) == {0, 1}, inst.id
    # every request decoded on the decode instance, the long prompts prefilled first on the prefill one
    assert set(ran[decode.id]) == {f"r{i}" for i in range(len(reqs))} > set(ran[prefill.id])
    assert min(r.engine.counters.prompt_tokens for r in prefill.ranks) > 0
    served = [r.engine.counters.generation_tokens for r in decode.ranks]
    assert min(served) > 0 and sum(served) == sum(r.output_tokens for r in reqs)


@pytest.mark.parametrize(("kv", "ranks"), [(False, [0, 1]), (True, [0, 0])])
def test_an_unbooked_request_goes_where_vllms_balancer_puts_it(kv: bool, ranks: list[int]) -> None:
    """Two requests one after the other on idle engines: vLLM's balancer, left to itself, moves its scan
    start on after each pick (the second goes to engine 1); the KV ledger books both on engine 0 (ties →
    the lower rank) and each runs where it was booked, as the gateway pins it (the gateway test's opening)."""
    ledger = KvLedger()
    sim = simulator(mixed(2), reserve=[ledger] if kv else [])
    ran = record_engines(sim)
    result = sim.run([SimRequest(0.0, 4, 2), SimRequest(5.0, 4, 2)])
    assert len(result.completed) == 2
    (placed,) = ran.values()
    assert list(placed.values()) == ranks


@pytest.mark.parametrize(
    ("per_engine", "preempts"),
    [
        pytest.param(True, False, id="booked per engine and pinned → no preemption, both engines serve"),
        pytest.param(False, True, id="booked as one pool, balanced by vLLM's rule → an engine preempts"),
    ],
)
def test_a_burst_on_a_dp2_instance_with_the_kv_ledger(per_engine: bool, preempts: bool) -> None:
    ledger = KvLedger(LedgerSettings(per_engine=per_engine))
    booked = record_bookings(ledger)
    sim = simulator(mixed(2), reserve=[ledger])
    ran = record_engines(sim)
    result = sim.run([SimRequest(0.0, 1000, OUTPUT) for _ in range(BURST)])
    assert len(result.completed) == BURST and not result.failed
    (inst,) = sim._instances.values()
    assert [(e.rank, e.num_gpu_blocks) for e in sim._worker_view(inst).engines] == [(0, BLOCKS), (1, BLOCKS)]
    (placed,) = ran.values()
    if per_engine:
        assert placed == booked  # each ran on the engine it was booked on
    else:
        assert set(booked.values()) == {None} and len(booked) == BURST
    assert (result.preemptions > 0) is preempts
    served = [r.engine.counters.generation_tokens for r in inst.ranks]
    assert sum(served) == BURST * OUTPUT and min(served) >= OUTPUT, served
    assert ledger.stats.released == {"completed": BURST} and ledger.stats.double_releases == 0
    assert not ledger.active()


# ---------------------------------------------------------------------------------------------------
# determinism and conservation


def autoscaled_run(
    seed: int, drain_timeout_s: float | None = None
) -> tuple[dict[str, Any], ClusterSimulator]:
    """A burst then a lighter load under the Mosaic policy and the KV ledger: instances of two engines are
    added, then drained and removed (with a drain time-out, what they still run is aborted)."""
    reqs = poisson(900, 30, seed=seed) + poisson(200, 3, seed=seed + 1, start=50)
    fleet = {**PD, "seed": seed, "drain_timeout_s": drain_timeout_s}
    sim = simulator(fleet, "mosaic", reserve=[KvLedger()])
    return build_report(sim.run(reqs), wall_s=1.0), sim


def test_a_seed_replays_exactly() -> None:
    a, _ = autoscaled_run(seed=3)
    b, _ = autoscaled_run(seed=3)
    assert a["scale_events"] and stable(a) == stable(b)


@pytest.mark.parametrize("drain_timeout_s", [None, 0.5])
def test_every_request_completes_or_is_counted_failed(drain_timeout_s: float | None) -> None:
    report, sim = autoscaled_run(seed=7, drain_timeout_s=drain_timeout_s)
    req = report["requests"]
    assert req["completed"] + req["failed"] == report["trace_requests"] == 1100
    assert sum(req["failed_by_reason"].values()) == req["failed"]
    assert any(e["after"] < e["before"] for e in report["scale_events"])  # instances of two engines drained
    if drain_timeout_s is None:
        assert req["aborted_by_scale_in"] == 0 and req["completed"] == 1100
    else:  # this seed's drains time out under a request: it is aborted on the engine running it, and failed
        assert req["aborted_by_scale_in"] == req["failed_by_reason"]["aborted_by_scale_in"] > 0
    assert sim._open_requests == 0 and not sim._reqs and not sim._queue
    for inst in sim._instances.values():
        assert len(inst.ranks) == 2 and inst.removed is not None
        assert (inst.inflight, inst.awaiting_kv, inst.inflight_prefill_tokens, inst.inflight_decode) == (
            0,
        ) * 4
        if drain_timeout_s is None:  # soft scale-in: every engine of every instance left empty
            assert inst.idle(), inst.id
