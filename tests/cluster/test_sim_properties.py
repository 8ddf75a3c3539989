"""Property test of the cluster simulator and every autoscaling policy (`mosaic simulate`'s machinery).

Random small fleets (mixed, P/D, P/D beside a mixed pool; several GPU types; tp 2 and dp 2 pools; min 0
and scale from zero), timing knobs (cold start, scrape and decision intervals, drain time-out, admission
queue), engines small enough to preempt, and traces with bursts, idle gaps, single requests, prompts past
the model's length and zero-length outputs, run under each policy. Checked on every run:

- nothing raises; a config the project refuses raises `FleetConfigError` / `PolicyError` only;
- conservation: every trace request completed or failed with a reason, the report's totals agree, every
  instance's in-flight counts back to zero; no request aborted by scale-in without a drain time-out;
- determinism: the same fleet, policy and trace give the same JSON report (wall time aside);
- replicas: every scale event within its pool's bounds, `before` equal to the replicas series replayed from
  the initial counts, the series within bounds (a pool starting under its minimum excepted) and equal
  to the live instances not draining;
- billing: GPU-hours and $ per GPU type equal each instance's billed lifetime × tp × dp (× price), every
  instance billed within [0, end]; the replicas series' integral never exceeds what was billed;
- SLO: attainment, goodput and latency stats recomputed from per-request TTFT/TPOT as the load generator
  defines them (TPOT = (e2e − TTFT) / (output − 1)); every fraction in [0, 1];
- policies: every observation sane (rates ≥ 0, utilisation in [0, 1], one ready-in estimate per starting
  instance), every target within its pool's bounds, the same decisions from a fresh policy fed the same
  observations (pure), and Mosaic's prefill scale-ups stopping within one instance of its P/D-ratio
  requirement (short of it only at a step limit or a pool's maximum).
Node inventories (`nodes:`), a second model's pool, routing variants and Mosaic's knobs are drawn too.
`test_cli_report_is_identical_across_processes` runs `mosaic simulate --json` under two hash seeds.

200 derandomised examples by default (~20 s); to hunt, SIM_PROPERTY_EXAMPLES=3000 SIM_PROPERTY_RANDOM=1
(fresh random examples each run) with `-o timeout=1500` (pytest-timeout's 120 s cuts a long shrink).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler.autoscaler.factory import PolicyError, build_policy
from scheduler.autoscaler.signals import Observation, ScalingDecision
from scheduler.fleet import WorkerState
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import FleetConfig, FleetConfigError, parse_fleet, pool_specs
from simulator.cluster_report import build_report

REPO = Path(__file__).resolve().parents[2]
GPUS = ("H100", "A100-80GB", "L4", "L40S")
MAX_MODEL_LEN = 8192  # llama-3-8b in the catalog


@st.composite
def pools(draw: st.DrawFn) -> list[dict[str, Any]]:
    layout = draw(st.sampled_from(["mixed", "pd", "pd+mixed", "mixed2", "pd+other-model"]))
    roles = {
        "mixed": ["mixed"],
        "mixed2": ["mixed", "mixed"],
        "pd": ["prefill", "decode"],
        "pd+mixed": ["prefill", "decode", "mixed"],
        "pd+other-model": ["prefill", "decode", "mixed"],  # the mixed pool serves a model nobody asks for
    }[layout]
    if layout == "pd" and draw(st.booleans()):
        roles.append("decode")  # two decode GPU types behind one prefill pool
    out = []
    for i, role in enumerate(roles):
        lo = draw(st.integers(0, 2))
        hi = draw(st.integers(max(lo, 1), 4))
        replicas = draw(st.integers(0, hi))
        pool = {
            "name": f"{role}-{i}",
            "gpu": draw(st.sampled_from(GPUS)),
            "role": role,
            "replicas": replicas,
            "min_replicas": lo,
            "max_replicas": hi,
        }
        if layout == "pd+other-model" and role == "mixed":
            pool["model"] = "mistral-7b"
        extra = draw(st.sampled_from(["", "", "", "tp", "dp", "cost", "domain"]))
        if extra == "tp":
            pool["tp"] = 2
        elif extra == "dp":  # two engines per instance (data parallelism)
            pool["dp"] = 2
        elif extra == "cost":
            pool["cost_per_hour"] = 1.25
        elif extra == "domain":
            pool["domain"] = f"d{i % 2}"
        out.append(pool)
    return out


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, Any]:
    seqs = draw(st.sampled_from([4, 16, 64]))
    fleet: dict[str, Any] = {
        "model": "llama-3-8b",
        "slo": {"ttft_ms": draw(st.sampled_from([200.0, 2000.0])), "tpot_ms": 100.0},
        "cold_start_s": draw(st.sampled_from([0.0, 2.0, 15.0])),
        "decision_interval_s": draw(st.sampled_from([1.0, 3.0, 10.0])),
        "scrape_interval_s": draw(st.sampled_from([0.5, 1.0, 4.0])),
        "kv_link_gbps": draw(st.sampled_from([0.05, 0.5, 25.0])),
        "kv_link_cross_domain_gbps": draw(st.sampled_from([None, 0.1])),
        "admission_queue_size": draw(st.sampled_from([0, 5, 100_000])),
        "admission_deadline_s": draw(st.sampled_from([2.0, 600.0])),
        "drain_timeout_s": draw(st.sampled_from([None, None, 0.05, 1.0, 20.0])),
        "routing": draw(
            st.sampled_from(
                [
                    {},
                    {},
                    {"policy": "round-robin"},
                    {"policy": "least-loaded", "pd_threshold_tokens": 0},
                    {"pd_max_prefill_wait_s": 0.2},
                ]
            )
        ),
        "engine": {
            "max_num_seqs": seqs,
            "max_num_batched_tokens": draw(st.sampled_from([max(seqs, 512), 8192])),
            "num_gpu_blocks": draw(st.sampled_from([None, 64, 600])),
        },
        "autoscaler": {
            "pd_ratio": draw(st.sampled_from([0.5, 1.0])),
            "scale_down_window_s": draw(st.sampled_from([0.0, 10.0, 60.0])),
            **draw(
                st.sampled_from(
                    [
                        {},
                        {"lookahead_s": 15.0, "backlog_lead_s": 15.0},
                        {"observed_context": True, "scale_down_delay_after_add_s": 20.0},
                        {"prefill_mode": "prompt_tokens", "max_scale_down_fraction": 1.0},
                    ]
                )
            ),
        },
        "pools": draw(pools()),
        "seed": draw(st.integers(0, 3)),
    }
    if draw(st.integers(0, 3)) == 0:  # a node inventory: placed topology-aware, scale-ups clipped to it
        gpus = sorted({p["gpu"] for p in fleet["pools"]})
        fleet["nodes"] = {
            "nodes": [
                {"name": f"n{i}-{d}", "gpu": g, "gpus": draw(st.sampled_from([2, 4])), "domain": f"rack-{d}"}
                for i, g in enumerate(gpus)
                for d in "ab"
            ]
        }
        for p in fleet["pools"]:
            p.pop("domain", None)
    return fleet


@st.composite
def traces(draw: st.DrawFn) -> list[SimRequest]:
    n = draw(st.integers(1, 120))
    t = draw(st.sampled_from([0.0, 0.0, 5.0]))
    out = []
    for _ in range(n):
        gap = draw(
            st.one_of(
                st.just(0.0),  # bursts: several at one instant
                st.floats(0.0, 0.5, allow_nan=False),
                st.floats(5.0, 60.0, allow_nan=False),  # idle gaps: scale-in, then arrivals after it
            )
        )
        t += gap
        prompt = draw(
            st.one_of(
                st.integers(1, 600),
                st.integers(600, 4000),
                st.sampled_from([0, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 500]),
            )
        )
        output = draw(st.one_of(st.integers(1, 64), st.integers(64, 300), st.sampled_from([0, 1, 2])))
        prefix = draw(st.sampled_from([(), (), (1, 2), (1, 2, 3, 4)]))
        out.append(SimRequest(round(t, 4), prompt, output, prefix))
    return out


POLICIES = st.sampled_from(
    [
        "mosaic",
        "hpa-util",
        "hpa-util:0.3",
        "hpa-waiting",
        "hpa-waiting:1",
        "dynamo:20",
        "dynamo",
        "static",
        "fixed",
    ]
)


class Recording:
    """A policy wrapped to record what it saw and decided (its targets are applied unchanged)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.seen: list[tuple[Observation, ScalingDecision]] = []

    def decide(self, obs: Observation) -> ScalingDecision:
        decision = self.policy.decide(obs)
        self.seen.append((obs, decision))
        return decision


def build(fleet_data: dict[str, Any], policy_name: str) -> tuple[FleetConfig, Any]:
    fleet = parse_fleet(fleet_data)
    policy = build_policy(
        policy_name,
        pool_specs(fleet),
        fleet.autoscaler_config(),
        {p.name: p.replicas for p in fleet.pools},
        check_bounds=True,
    )
    return fleet, policy


def simulate(
    fleet_data: dict[str, Any], policy_name: str, trace: list[SimRequest]
) -> tuple[dict[str, Any], ClusterSimulator]:
    fleet, policy = build(fleet_data, policy_name)
    sim = ClusterSimulator(fleet, None if policy is None else Recording(policy), policy_name)
    result = sim.run(trace)
    report = build_report(result, wall_s=1.0)
    return report, sim


def check_policy(fleet_data: dict[str, Any], policy_name: str, sim: ClusterSimulator) -> None:
    """Every observation is sane; every pool gets a target in its bounds (the policy's own job: the driver's
    clamp is the last line of defence); a fresh policy fed the same observations decides the same (pure)."""
    if not isinstance(sim.policy, Recording):
        return
    bounds = {p.name: (p.min_replicas, p.max_replicas) for p in sim.fleet.pools}
    _, fresh = build(fleet_data, policy_name)
    last = -1.0
    for obs, decision in sim.policy.seen:
        assert obs.now > last
        last = obs.now
        assert obs.request_rate >= 0 and obs.mean_input_tokens >= 0 and obs.mean_output_tokens >= 0
        assert all(v >= 0 for v in obs.admission_queue.values())
        for name, po in obs.pools.items():
            assert min(po.ready, po.starting, po.draining, po.num_waiting) >= 0, (name, po)
            assert po.decode_tokens_per_s >= 0 and po.prompt_tokens_per_s >= 0, (name, po)
            assert 0.0 <= po.gpu_utilization <= 1.0, (name, po)
            assert len(po.starting_ready_in_s) == po.starting
            assert all(0.0 <= e <= sim.fleet.cold_start_s + 1e-9 for e in po.starting_ready_in_s)
        assert set(decision.targets) == set(bounds), decision
        for name, target in decision.targets.items():
            lo, hi = bounds[name]
            assert target <= hi, (policy_name, name, target, hi)
            # a pool under its minimum is raised to it by the policy (scale from zero included)
            assert target >= lo, (policy_name, name, target, lo)
        again = fresh.decide(obs)
        assert again == decision, (obs.now, decision, again)
        if policy_name == "mosaic":
            check_pd_ratio(sim, obs, decision)


def check_pd_ratio(sim: ClusterSimulator, obs: Observation, decision: ScalingDecision) -> None:
    """Mosaic in `ratio` mode sizes prefill at pd_ratio × the decode instances it needs (with prompt-token
    demand as a floor): a scale-up of prefill stops within one instance of that requirement (unless a
    pool's minimum asks for more), and one short of it is held by a step limit or a pool's maximum."""
    cfg = sim.fleet.autoscaler_config()
    if cfg.prefill_mode != "ratio":
        return
    specs = [s for s in sim.specs.values() if s.role == "prefill"]
    if not specs:
        return
    model = sim.fleet.model
    mean_cap = sum(s.prefill_tps_capacity for s in specs) / len(specs)
    by_ratio = decision.signal[f"{model}/prefill_instances_by_ratio"] * mean_cap
    by_demand = decision.signal[f"{model}/prefill_demand_tps"] / cfg.utilization_target
    required = max(by_ratio, by_demand)
    current = {s.name: obs.pools[s.name].provisioned for s in specs}
    target = {s.name: decision.targets[s.name] for s in specs}
    cap = sum(target[s.name] * s.prefill_tps_capacity for s in specs)
    if not any(target[n] > current[n] for n in target):
        return
    if any(target[s.name] > current[s.name] and target[s.name] == s.min_replicas for s in specs):
        return  # raised to a minimum, whatever the demand
    biggest = max(s.prefill_tps_capacity for s in specs)
    assert cap - biggest < required * (1 + 1e-9), ("prefill bought past the ratio", cap, required)
    if cap < required * (1 - 1e-9):
        limited = [
            s
            for s in specs
            if target[s.name] >= s.max_replicas
            or target[s.name]
            >= max(
                current[s.name] + cfg.max_scale_up_step, math.ceil(current[s.name] * cfg.max_scale_up_factor)
            )
        ]
        assert limited, ("prefill scaled up short of the ratio without a limit", cap, required, target)


def _stable(report: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in report.items() if k not in ("wall_s", "sim_requests_per_wall_s")})


def check_conservation(report: dict[str, Any], sim: ClusterSimulator, n: int) -> None:
    req = report["requests"]
    assert report["trace_requests"] == n
    assert req["completed"] + req["failed"] == n, req
    assert sum(req["failed_by_reason"].values()) == req["failed"]
    assert all(v > 0 for v in req["failed_by_reason"].values())
    assert req["aborted_by_scale_in"] == req["failed_by_reason"].get("aborted_by_scale_in", 0)
    if sim.fleet.drain_timeout_s is None:
        assert req["aborted_by_scale_in"] == 0, "soft scale-in aborted requests"
    assert sim._open_requests == 0
    assert not sim._reqs and not sim._queue
    for inst in sim._instances.values():
        assert inst.removed is not None, inst.id
        assert (inst.inflight, inst.awaiting_kv, inst.inflight_prefill_tokens, inst.inflight_decode) == (
            0,
            0,
            0,
            0,
        ), inst.id
        if sim.fleet.drain_timeout_s is None:
            # soft scale-in: every instance left empty (one removed at its drain time-out keeps in its dead
            # engine what was aborted, e.g. KV held for a transfer whose decode request was failed)
            assert inst.idle(), inst.id  # every engine, of a data-parallel instance too


def replay_replicas(report: dict[str, Any], sim: ClusterSimulator) -> None:
    bounds = {p.name: (p.min_replicas, p.max_replicas) for p in sim.fleet.pools}
    counts = {p.name: p.replicas for p in sim.fleet.pools}
    events = list(report["scale_events"])
    samples = report["replicas"]
    assert samples and samples[0] == {"t": 0.0, **counts}
    reached_min = {p: counts[p] >= bounds[p][0] for p in counts}
    i = 0
    for sample in samples:
        while i < len(events) and events[i]["t"] <= sample["t"]:
            e = events[i]
            lo, hi = bounds[e["pool"]]
            assert e["before"] == counts[e["pool"]], (e, counts)
            assert e["after"] != e["before"]
            assert 0 <= e["after"] <= hi, e
            if e["after"] < e["before"]:
                assert e["after"] >= lo, f"scaled in below min_replicas: {e}"
            counts[e["pool"]] = e["after"]
            i += 1
        for pool, (lo, hi) in bounds.items():
            assert sample[pool] == counts[pool], (sample, counts)
            assert 0 <= sample[pool] <= hi
            reached_min[pool] = reached_min[pool] or sample[pool] >= lo
            if reached_min[pool]:
                assert sample[pool] >= lo, f"{pool} fell under min_replicas: {sample}"
    assert i == len(events), "scale events after the last replicas sample"
    # the instances still up (not draining) when the run ended are what the series says last
    alive: dict[str, int] = dict.fromkeys(counts, 0)
    for inst in sim._instances.values():
        if inst.state is not WorkerState.DRAINING and inst.removed == sim.result.end_s:
            alive[inst.pool] += 1
    assert alive == counts, (alive, counts)


def check_billing(report: dict[str, Any], sim: ClusterSimulator) -> None:
    end = sim.result.end_s
    pools = {p.name: p for p in sim.fleet.pools}
    seconds: dict[str, float] = {}
    cost: dict[str, float] = {}
    for inst in sim._instances.values():
        assert inst.removed is not None
        assert 0.0 <= inst.created <= inst.removed <= end + 1e-9, (inst.id, inst.created, inst.removed, end)
        life = inst.removed - inst.created
        gpu = inst.spec.gpu
        seconds[gpu] = seconds.get(gpu, 0.0) + life * pools[inst.pool].tp * pools[inst.pool].dp
        cost[gpu] = cost.get(gpu, 0.0) + life / 3600 * inst.spec.cost_per_hour
    hours = report["gpu_hours"]["by_gpu"]
    assert set(hours) == set(seconds)
    for gpu, s in seconds.items():
        assert hours[gpu] == pytest.approx(s / 3600, abs=1e-4)
        assert report["cost_usd"]["by_gpu"][gpu] == pytest.approx(cost[gpu], abs=1e-4)
    assert report["gpu_hours"]["total"] == pytest.approx(sum(seconds.values()) / 3600, abs=1e-3)
    assert report["cost_usd"]["total"] == pytest.approx(sum(cost.values()), abs=1e-3)
    # the replicas series counts provisioned instances (ready + starting, draining left out): all billed
    samples = report["replicas"]
    integral = 0.0
    for a, b in zip(samples, [*samples[1:], None], strict=True):
        t1 = end if b is None else min(b["t"], end)
        if t1 > a["t"]:
            integral += sum(a[p] * pools[p].tp * pools[p].dp for p in pools) * (t1 - a["t"])
    assert integral <= sum(seconds.values()) + 1e-3 * (1 + len(samples))
    util = report["utilization"]
    if util is not None:
        assert 0.0 <= util <= 1.0, util


def check_slo(report: dict[str, Any], sim: ClusterSimulator) -> None:
    slo = sim.fleet.slo
    rows = sim.result.completed
    n = report["trace_requests"]
    ok_both = 0
    for arrival, ttft, tpot, e2e, prompt, output in rows:
        assert arrival >= 0 and 0 <= ttft <= e2e + 1e-9, (ttft, e2e)
        assert 1 <= prompt < MAX_MODEL_LEN and output >= 1
        if output >= 2 and prompt + output <= MAX_MODEL_LEN:
            assert tpot is not None
            assert tpot == pytest.approx((e2e - ttft) / (output - 1), rel=1e-6, abs=1e-9)
        elif output == 1:
            assert tpot is None
        ok = ttft * 1e3 <= slo.ttft_ms and (tpot or 0.0) * 1e3 <= slo.tpot_ms
        ok_both += ok
    s = report["slo"]
    for key in ("attainment", "attainment_ttft", "attainment_tpot"):
        assert 0.0 <= s[key] <= 1.0
    assert s["attainment"] == pytest.approx(ok_both / n, abs=1e-5)
    assert s["attainment"] <= min(s["attainment_ttft"], s["attainment_tpot"]) + 1e-9
    span = max(sim.result.end_s, 1e-9)  # unrounded: the report's simulated_s is rounded to 1 ms
    assert report["goodput_rps"] == pytest.approx(ok_both / span, abs=1e-4)
    if rows:
        assert report["latency_ms"]["ttft"]["p50"] is not None


@settings(
    max_examples=int(os.environ.get("SIM_PROPERTY_EXAMPLES", "200")),
    derandomize=os.environ.get("SIM_PROPERTY_RANDOM") is None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fleet=fleets(), policy=POLICIES, trace=traces())
def test_simulator_invariants(fleet: dict[str, Any], policy: str, trace: list[SimRequest]) -> None:
    try:
        report, sim = simulate(fleet, policy, trace)
    except (FleetConfigError, PolicyError) as exc:
        event(f"refused: {type(exc).__name__}: {str(exc)[:60]}")
        return  # refused with the project's own error (e.g. an L4 that cannot decode within the TPOT SLO)
    event(f"ran {policy}")
    check_conservation(report, sim, len(trace))
    replay_replicas(report, sim)
    check_billing(report, sim)
    check_slo(report, sim)
    check_policy(fleet, policy, sim)
    again, _ = simulate(fleet, policy, trace)
    assert _stable(again) == _stable(report)


# -- reproducers of what the property test found ----------------------------------------------------------

PD_MIN0 = {
    "cold_start_s": 0.0,
    "decision_interval_s": 1.0,
    "autoscaler": {"scale_down_window_s": 0.0},
    "pools": [
        {
            "name": "prefill",
            "gpu": "H100",
            "role": "prefill",
            "replicas": 1,
            "min_replicas": 0,
            "max_replicas": 1,
        },
        {
            "name": "decode",
            "gpu": "H100",
            "role": "decode",
            "replicas": 1,
            "min_replicas": 0,
            "max_replicas": 1,
        },
    ],
}


def test_found_decode_side_rejection_frees_the_prefill_hold() -> None:
    """A P/D request whose decode side refuses it (here max_tokens 0; any engine ValueError at the decode
    hop) failed `engine_rejected`, but the prefill instance kept the request's KV held for a transfer that
    would never come, until the hold's timeout (30 s): its blocks stayed taken, a draining prefill
    instance could not retire, and it was billed past the end of the run (removed at 30 s, end 0.02 s)."""
    fleet = parse_fleet(PD_MIN0)
    sim = ClusterSimulator(fleet, None, "fixed")
    seen: list[int] = []
    fail = sim._fail

    def spy(req: Any, reason: str) -> None:
        fail(req, reason)
        seen.append(sum(i.engine.num_held for i in sim._live))

    sim._fail = spy  # type: ignore[method-assign]
    result = sim.run([SimRequest(0.0, 256, 0)])
    assert result.failed == {"engine_rejected": 1}
    assert seen == [0]  # nothing held once the request failed

    report, sim = simulate(PD_MIN0, "mosaic", [SimRequest(0.0, 256, 0), SimRequest(5.0, 16, 4)])
    assert report["requests"]["failed_by_reason"] == {"engine_rejected": 1}
    check_billing(report, sim)  # every instance removed by the end of the run


def test_found_dynamo_starts_a_pool_configured_under_its_minimum() -> None:
    """A P/D fleet configured at 0 replicas with min_replicas 1: under `dynamo` every request waited in the
    admission queue until its deadline and failed, the pools never raised to their minimum (the planner
    echoed the provisioned 0 until a first plan that needs a finished request); HPA and Mosaic raise them."""
    fleet = {
        **PD_MIN0,
        "admission_deadline_s": 30.0,
        "pools": [{**p, "replicas": 0, "min_replicas": 1} for p in PD_MIN0["pools"]],
    }
    report, _ = simulate(fleet, "dynamo:20", [SimRequest(0.0, 300, 8), SimRequest(1.0, 300, 8)])
    assert report["requests"]["completed"] == 2, report["requests"]
    assert report["replicas"][1] == {"t": 1.0, "prefill": 1, "decode": 1}


def test_cli_report_is_identical_across_processes(tmp_path: Path) -> None:
    """`mosaic simulate --json` twice, in processes with different string-hash seeds (set and dict order of
    str keys differ between them): the same report, byte for byte, wall-clock fields aside."""
    fleet = {
        "cold_start_s": 5.0,
        "decision_interval_s": 2.0,
        "kv_link_gbps": 1.0,
        "kv_link_cross_domain_gbps": 0.2,
        "autoscaler": {"scale_down_window_s": 10.0},
        "nodes": {
            "nodes": [
                {"name": f"n{g}{d}", "gpu": g, "gpus": 4, "domain": f"rack-{d}"}
                for g in ("H100", "A100-80GB")
                for d in "ab"
            ]
        },
        "pools": [
            {
                "name": "p",
                "gpu": "H100",
                "role": "prefill",
                "replicas": 1,
                "min_replicas": 0,
                "max_replicas": 3,
            },
            {
                "name": "d",
                "gpu": "A100-80GB",
                "role": "decode",
                "replicas": 1,
                "min_replicas": 0,
                "max_replicas": 3,
            },
            {
                "name": "m",
                "gpu": "A100-80GB",
                "role": "mixed",
                "replicas": 1,
                "min_replicas": 1,
                "max_replicas": 2,
            },
        ],
    }
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet))
    trace = "synthetic:rate=6,n=150,arrival=gamma,burstiness=0.3,input=uniform:16:3000,output=uniform:1:200,seed=3"
    cmd = [sys.executable, "-c", "from server.cli import main; main()", "simulate", "--trace", trace]
    cmd += ["--fleet", str(path), "--policy", "mosaic", "--json"]
    reports = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["requests"]["completed"] + report["requests"]["failed"] == 150
        reports.append(_stable(report))
    assert reports[0] == reports[1]


def test_found_static_raises_a_pool_configured_under_its_minimum() -> None:
    """`static` with no count for a pool held the configured replicas even under `min_replicas` (0 with
    min 1: every request failed in the admission queue), though `static:pool=0` is refused as outside the
    bounds and every other policy raises such a pool; its default count is now the configured one within
    the pool's bounds."""
    fleet = {**PD_MIN0, "pools": [{**p, "replicas": 0, "min_replicas": 1} for p in PD_MIN0["pools"]]}
    report, _ = simulate(fleet, "static", [SimRequest(0.0, 300, 8)])
    assert report["requests"]["completed"] == 1, report["requests"]
    assert report["scale_events"][:2] == [
        {"t": 1.0, "pool": "prefill", "before": 0, "after": 1},
        {"t": 1.0, "pool": "decode", "before": 0, "after": 1},
    ]


def test_found_a_long_context_on_a_small_cache_does_not_block_the_queue() -> None:
    """Without a KV ledger the kv-fit filter (scraped usage) never passed a request over its 0.98 headroom
    ceiling (900 + 300 tokens, clamped to the 1,008-token context: 63 blocks of 16 against 0.98 · 64 = 62.7),
    though it fits the cache: a retryable kv_full that held it at the head of the FIFO admission queue until
    its deadline, and the small request behind it failed with it (both `admission_deadline`). It now goes
    when the worker has the room free (vLLM runs it), and its output is clamped to the context: 108 tokens
    counted as generated (the row counted the 300 asked for)."""
    fleet = {
        "cold_start_s": 0.0,
        "decision_interval_s": 1.0,
        "admission_deadline_s": 30.0,
        "engine": {"num_gpu_blocks": 64},
        "pools": [{"name": "mixed", "gpu": "H100", "role": "mixed", "replicas": 1, "max_replicas": 1}],
    }
    report, sim = simulate(fleet, "fixed", [SimRequest(0.0, 900, 300), SimRequest(0.0, 100, 10)])
    assert report["requests"]["completed"] == 2 and report["requests"]["failed"] == 0
    assert sorted(row[5] for row in sim.result.completed) == [10, 108]
