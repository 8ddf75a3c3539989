"""The cluster simulator: determinism, conservation, P/D, cold starts, soft scale-in, and the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from scheduler.autoscaler.factory import build_policy
from server.cli import build_app
from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import FleetConfigError, decode_tps_within_slo, parse_fleet, pool_specs
from simulator.cluster_report import build_report

PD_FLEET = {
    "model": "llama-3-8b",
    "slo": {"ttft_ms": 3000, "tpot_ms": 100},
    "cold_start_s": 60,
    "decision_interval_s": 10,
    "autoscaler": {"pd_ratio": 1.0, "scale_down_window_s": 60},
    "pools": [
        {
            "name": "prefill-h100",
            "gpu": "H100",
            "role": "prefill",
            "replicas": 1,
            "min_replicas": 1,
            "max_replicas": 6,
        },
        {
            "name": "decode-a100",
            "gpu": "A100-80GB",
            "role": "decode",
            "replicas": 1,
            "min_replicas": 1,
            "max_replicas": 6,
        },
    ],
}


def poisson(
    n: int,
    rate: float,
    seed: int,
    prompt: tuple[int, int] = (200, 2000),
    out: tuple[int, int] = (20, 300),
    start: float = 0.0,
) -> list[SimRequest]:
    rng = random.Random(seed)
    t = start
    reqs = []
    for _ in range(n):
        t += rng.expovariate(rate)
        reqs.append(SimRequest(t, rng.randint(*prompt), rng.randint(*out)))
    return reqs


def run(fleet_data: dict, policy_name: str, requests: list[SimRequest]) -> tuple[dict, ClusterSimulator]:
    fleet = parse_fleet(fleet_data)
    specs = pool_specs(fleet)
    policy = build_policy(
        policy_name, specs, fleet.autoscaler_config(), {p.name: p.replicas for p in fleet.pools}
    )
    sim = ClusterSimulator(fleet, policy, policy_name)
    result = sim.run(requests)
    return build_report(result, wall_s=1.0), sim


def test_same_seed_same_report() -> None:
    a, _ = run(PD_FLEET, "mosaic", poisson(400, 6, seed=3))
    b, _ = run(PD_FLEET, "mosaic", poisson(400, 6, seed=3))
    for key in ("slo", "latency_ms", "gpu_hours", "scale_events", "replicas", "preemptions"):
        assert a[key] == b[key], key


def test_every_request_completes_or_is_counted_failed() -> None:
    report, sim = run(PD_FLEET, "mosaic", poisson(600, 10, seed=1))
    req = report["requests"]
    assert req["completed"] + req["failed"] == report["trace_requests"] == 600
    assert req["aborted_by_scale_in"] == 0
    # nothing left inside any engine, every reservation and in-flight count back to zero
    assert sim._open_requests == 0
    assert all(i.inflight == 0 for i in sim._instances.values())


def test_pd_path_tokens_and_ttft_include_transfer() -> None:
    reqs = [SimRequest(0.0, 1000, 50)]
    report, sim = run({**PD_FLEET, "kv_link_gbps": 1.0}, "fixed", reqs)
    assert report["requests"]["completed"] == 1
    # the decode side waits for 1,000 tokens · 128 KiB = 131 MB over 1 GB/s = 0.131 s before its first token
    assert report["latency_ms"]["ttft"]["p50"] > 131
    decode = next(i for i in sim._instances.values() if i.pool == "decode-a100")
    prefill = next(i for i in sim._instances.values() if i.pool == "prefill-h100")
    assert decode.engine.counters.generation_tokens == 50
    assert prefill.engine.counters.prompt_tokens == 1000
    assert prefill.engine.num_held == 0  # the held blocks were freed when the transfer landed


def test_scale_up_is_cold_and_scale_in_is_soft() -> None:
    # a burst then silence: instances are added (ready only after the 60 s cold start) and later drained
    reqs = poisson(1500, 25, seed=2) + poisson(30, 0.05, seed=4, start=120)
    report, sim = run(PD_FLEET, "mosaic", reqs)
    ups = [e for e in report["scale_events"] if e["after"] > e["before"]]
    downs = [e for e in report["scale_events"] if e["after"] < e["before"]]
    assert ups and downs
    first_up = ups[0]["t"]
    # cost is billed from an instance's start (its cold start included), not from when it became ready:
    # every instance bought by a scale-up is billed from the decision that bought it to its removal
    end = sim.result.end_s
    bought = [i for i in sim._instances.values() if i.created > 0]
    assert len(bought) == sum(e["after"] - e["before"] for e in ups)
    assert sorted(i.created for i in bought) == sorted(
        e["t"] for e in ups for _ in range(e["after"] - e["before"])
    )
    billed = sum((i.removed if i.removed is not None else end) - i.created for i in sim._instances.values())
    assert sim.result.billed_seconds == pytest.approx(billed, abs=1e-6)
    assert sum(sim.result.instance_seconds.values()) == pytest.approx(billed, abs=1e-6)  # tp 1 everywhere
    assert report["gpu_hours"]["total"] == pytest.approx(billed / 3600, abs=1e-4)
    assert report["requests"]["aborted_by_scale_in"] == 0
    assert report["requests"]["completed"] == len(reqs)
    assert first_up <= 20


def test_static_fleet_too_small_queues_then_serves() -> None:
    fixed = {
        **PD_FLEET,
        "pools": [
            {
                "name": "mixed-l4",
                "gpu": "L4",
                "role": "mixed",
                "replicas": 1,
                "min_replicas": 1,
                "max_replicas": 1,
            }
        ],
    }
    report, _ = run(fixed, "fixed", poisson(300, 80, seed=5, prompt=(100, 300), out=(10, 60)))
    assert report["requests"]["completed"] == 300
    assert report["slo"]["attainment_ttft"] < 0.9  # overloaded: requests waited


def test_decode_capacity_within_slo_is_the_largest_batch_that_fits() -> None:
    from placement.catalog import load_catalog
    from placement.perf_model import PerfModel

    cat = load_catalog()
    perf = PerfModel(cat.gpu("A100-80GB"), cat.model("llama-3-8b"))
    for slo in (0.02, 0.03, 0.05):
        best = max(b for b in range(1, 257) if perf.decode_step_time([1024] * b) <= slo)  # brute force
        assert decode_tps_within_slo(perf, slo, 1024, 256, 400_000) == pytest.approx(
            best / perf.decode_step_time([1024] * best)
        )
    # KV capacity caps the batch: 20,480 tokens hold 20 sequences of 1,024
    assert decode_tps_within_slo(perf, 0.05, 1024, 256, 20_480) == pytest.approx(
        20 / perf.decode_step_time([1024] * 20)
    )
    assert decode_tps_within_slo(perf, 0.001, 1024, 256, 400_000) == 0.0  # below the weight-read time


def test_bad_fleet_is_one_clear_error() -> None:
    with pytest.raises(FleetConfigError, match=r"pools\.0\.role"):
        parse_fleet({"pools": [{"name": "x", "gpu": "L4", "role": "both"}]})
    with pytest.raises(FleetConfigError, match="unknown GPU 'B300'"):
        pool_specs(parse_fleet({"pools": [{"name": "x", "gpu": "B300"}]}))
    with pytest.raises(
        FleetConfigError
    ) as err:  # a validator's own words, without pydantic's "Value error, "
        parse_fleet({"pools": [{"name": "a", "gpu": "H100", "replicas": 5, "max_replicas": 2}]})
    assert str(err.value) == "fleet: pools.0: pool a: replicas (5) must be ≤ max_replicas (2)"


def test_cli_simulate_writes_report_and_plots(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps(PD_FLEET))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(
        build_app(),
        [
            "simulate",
            "--trace",
            "synthetic:rate=4,n=200,input=800,output=100",
            "--fleet",
            str(fleet),
            "--policy",
            "hpa-util:0.7",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["schema"] == "mosaic.simulate/v1" and report["trace_requests"] == 200
    assert (tmp_path / "plots" / "replicas.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--policy", "magic"], "unknown policy 'magic'", id="unknown policy → exit 2 with the valid names"
        ),
        pytest.param(
            ["--fleet", "/nonexistent.yaml"], "cannot read fleet file", id="missing fleet file → exit 2"
        ),
    ],
)
def test_cli_simulate_bad_input_exits_2(tmp_path: Path, args: list[str], message: str) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps(PD_FLEET))
    base = ["simulate", "--trace", "synthetic:rate=4,n=10,input=100,output=10", "--fleet", str(fleet)]
    result = CliRunner().invoke(build_app(), base + args)
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    ("change", "cause"),
    [
        pytest.param(
            {"engine": {"num_gpu_blocks": 2}},
            "its KV cache holds 32 tokens, less than one sequence of 1024 tokens of context",
            id="a KV cache too small names the cache, not the GPU's speed",
        ),
        pytest.param(
            {"slo": {"ttft_ms": 3000, "tpot_ms": 1}},
            "one sequence's decode step takes",
            id="a TPOT no step can meet names the step time",
        ),
    ],
)
def test_cli_simulate_says_why_a_pool_cannot_decode(
    tmp_path: Path, change: dict[str, Any], cause: str
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({**PD_FLEET, **change}))
    args = ["simulate", "--trace", "synthetic:rate=4,n=10,input=100,output=10", "--fleet", str(fleet)]
    result = CliRunner().invoke(build_app(), [*args, "--policy", "fixed"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pool decode-a100" in lines[0] and cause in lines[0], result.output
