"""Review fixes in the KV ledger, admission queue and `kv:` config: each test fails without its fix.

1. batch admission plans a fitting request whatever its estimated TTFT;
2. two waiters sharing a client request id neither lose a planned reservation nor each other's hold;
3. `kv.lease_s` must outlast the request timeouts;
4. reconcile ignores releases of reservations that never ran (`unreserved`);
5. books (and `/metrics` series) of removed workers are dropped;
6. config values that were accepted and ignored (or harmful) are refused;
7. compression on a tp > 1 pool is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass
from typing import Any

import pytest

from scheduler.fleet import FleetView, WorkerView
from scheduler.kv.batch_admission import AdmissionParams, plan_admission, plan_value
from scheduler.kv.config import KvConfig
from scheduler.kv.ledger import KvLedger, LedgerSettings
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Decision
from scheduler.routing.reasons import Outcome
from server.admission import AdmissionQueue, plan_keys
from server.config import ConfigError, validate_config
from server.footprint import parse_request, route_request
from server.kv_admission import KvQueuePolicy
from server.metrics import GatewayMetrics
from tests.kv.kvkit import request, worker

# ---- 1. batch admission: a high estimated TTFT never makes a fitting request unplannable ----------------


@pytest.mark.parametrize("use_cp_sat", [False, True])
@pytest.mark.parametrize(
    ("now", "value"),
    [
        # weight 1 + age/10, TTFT 30000 / 5000 = 6 s → raw v = weight − 0.5 · 6; squashed 0.01² / (0.02 − v)
        pytest.param(0.0, 0.0001 / 2.02, id="age 0: v = -2"),
        pytest.param(5.0, 0.0001 / 1.52, id="age 5: v = -1.5"),
        pytest.param(9.9, 0.0001 / 1.03, id="age 9.9: v = -1.01"),
    ],
)
def test_idle_worker_plans_a_long_prompt_at_any_age(now: float, value: float, use_cp_sat: bool) -> None:
    ledger = KvLedger(LedgerSettings())
    idle = worker("A", blocks=100_000, prefill_tps=5000.0)
    plan = plan_admission([request("long", 30_000, 100)], [idle], ledger, now, use_cp_sat=use_cp_sat)
    assert plan.assignments == (("long", "A"),)
    assert plan.objective == pytest.approx(value)


def test_plan_value_keeps_the_order_and_positive_values_unchanged() -> None:
    raws = [-1e9, -50.0, -2.0, -0.5, 0.0, 0.005, 0.01, 0.5, 3.0]
    values = [plan_value(r) for r in raws]
    assert all(v > 0 for v in values)
    assert values == sorted(values) and len(set(values)) == len(values)
    assert values[-3:] == [0.01, 0.5, 3.0]  # v ≥ VALUE_FLOOR: the objective as it was
    assert plan_value(float("-inf")) > 0


def test_a_cheap_request_still_beats_a_slow_one_for_the_last_room_and_the_faster_worker_is_chosen() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    fast, slow = (
        worker("fast", blocks=2000, prefill_tps=5000.0),
        worker("slow", blocks=2000, prefill_tps=1000.0),
    )
    # One 30k-token request (1881 blocks): both workers give v < 0; the faster one (less negative) wins.
    plan = plan_admission([request("long", 30_000, 100)], [slow, fast], ledger, 0.0, use_cp_sat=False)
    assert plan.assignments == (("long", "fast"),)
    # Room for one of them: the plan's objective still prefers the short prompt (v = 1 − 0.5 · 0.2 > 0)
    # over the long one (squashed v < 0.01) for the same KV.
    one = [worker("A", blocks=1900, prefill_tps=5000.0)]
    queue = [request("long", 30_000, 100), request("short", 1000, 29_000)]  # 1881 and 1875 blocks
    plan = plan_admission(queue, one, ledger, 0.0, AdmissionParams(time_limit_ms=2000))
    assert plan.method == "cp-sat" and plan.assignments == (("short", "A"),)
    assert plan.objective == pytest.approx(0.9)


# ---- 2. duplicate client request ids ----------------------------------------------------------------


@dataclass
class Busy:
    reason: str = "no worker fits: 1 kv_full"
    retry_after_s: float = 1.0
    retryable: bool = True


def test_batch_plan_of_two_waiters_sharing_an_id_hands_out_both_reservations() -> None:
    async def run() -> None:
        ledger = KvLedger(LedgerSettings(watermark=0.0))
        w = worker("w", blocks=100)
        view = FleetView((w,))
        router = build_router(RoutingConfig(), reserve=[ledger])
        rng = random.Random(0)
        kv = KvConfig(batch_admission={"enabled": True, "solver": "greedy"})  # type: ignore[arg-type]
        policy = KvQueuePolicy(
            kv, ledger, lambda: view, lambda req, ex: router.route(req, view, 0.0, rng, ex), lambda: 0.0
        )
        # Both waiters carry the client's X-Request-Id "dup"; 10 blocks each.
        out = await policy.plan("m", [request("dup", 160, 0), request("dup", 160, 0)])
        assert sorted(out) == ["dup", "dup#1"] and ledger.reserved("w") == 20
        for d in out.values():
            d.release(Outcome.COMPLETED)
        assert ledger.reserved("w") == 0 and ledger.active() == []  # nothing left for the lease sweep

        # Through the queue: both waiters are admitted, and releasing their decisions frees everything.
        queue: AdmissionQueue[Decision] = AdmissionQueue(
            8, 5.0, is_reject=lambda r: isinstance(r, Busy), poll_s=0.02, policy=policy
        )
        a = asyncio.create_task(queue.admit("m", Busy, request("dup", 160, 0)))
        await asyncio.sleep(0)
        b = asyncio.create_task(queue.admit("m", Busy, request("dup", 160, 0)))
        decisions = await asyncio.wait_for(asyncio.gather(a, b), 3.0)
        assert all(isinstance(d, Decision) for d in decisions)
        assert ledger.reserved("w") == 20
        for d in decisions:
            d.release(Outcome.COMPLETED)
        assert ledger.reserved("w") == 0 and ledger.active() == []

    asyncio.run(run())


def _aging_policy(ledger: KvLedger, w: WorkerView) -> KvQueuePolicy:
    """The gateway's queue policy over `ledger` and one worker, aging after 1 s, at t = 5 s."""
    view = FleetView((w,))
    return KvQueuePolicy(
        KvConfig(queue={"aging_s": 1.0}),  # type: ignore[arg-type]
        ledger,
        lambda: view,
        lambda req, exclude: pytest.fail("aging never routes"),
        lambda: 5.0,
    )


def test_waiters_sharing_an_id_keep_their_own_holds() -> None:
    ledger = KvLedger()
    w = worker("w", blocks=100)  # capacity 98
    ledger.reserve(request("running", prompt=800, max_out=0), w, 0.0)  # 50 blocks
    policy = _aging_policy(ledger, w)
    first, second = request("dup", prompt=1280, max_out=0), request("dup", prompt=640, max_out=0)  # 80, 40
    policy.before_attempt(first, waited_s=2.0)
    assert policy.held == {"dup": "w"} and ledger.snapshot()["w"]["holds"] == 80
    policy.before_attempt(second, waited_s=2.0)
    assert ledger.snapshot()["w"]["holds"] == 120 and len(policy.held) == 2
    policy.leave(second)  # the second waiter's deadline: only its own hold goes
    assert policy.held == {"dup": "w"} and ledger.snapshot()["w"]["holds"] == 80
    assert ledger.free(w, "dup") == 48  # the holder may still use its hold
    policy.leave(first)
    assert policy.held == {} and ledger.snapshot()["w"]["holds"] == 0
    assert policy.stats.holds == 2 and policy.stats.holds_dropped == 2


def test_plan_keys_are_unique_and_keep_unique_ids() -> None:
    reqs = [request(i) for i in ("a", "b", "a", "a#1", "a")]
    assert plan_keys(reqs) == ["a", "b", "a#1", "a#1#1", "a#2"]


# ---- 3, 6, 7. config -----------------------------------------------------------------------------------


def _config(kv: dict[str, Any] | None = None, limits: dict[str, Any] | None = None, tp: int = 1) -> Any:
    pools = [
        {
            "name": "p",
            "model": "llama-3-8b",
            "gpu": "A100-80GB",
            "tp": tp,
            "endpoints": {"static": ["http://x:1"]},
        }
    ]
    data: dict[str, Any] = {"pools": pools}
    if kv is not None:
        data["kv"] = kv
    if limits is not None:
        data["limits"] = limits
    return validate_config(data)


def _refused(match: str, **kw: Any) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        _config(**kw)
    return str(info.value)


def test_lease_must_outlast_the_request_timeouts() -> None:
    msg = _refused(r"kv\.lease_s", limits={"total_timeout_s": 3600})
    assert msg == (
        "config: kv.lease_s: 900 s must exceed the longest time a request holds KV pages without renewing "
        "them, max(limits.total_timeout_s, first_token_timeout_s, stall_timeout_s) = 3600 s"
    )
    _refused(r"kv\.lease_s.* = 1000 s", limits={"first_token_timeout_s": 1000})
    _refused(r"kv\.lease_s.* = 900 s", limits={"stall_timeout_s": 900})
    assert _config({"lease_s": 3700}, {"total_timeout_s": 3600}).kv.lease_s == 3700
    assert not _config({"enabled": False}, {"total_timeout_s": 3600}).kv.enabled  # no ledger, no lease


def test_compression_must_name_a_configured_pool_or_model() -> None:
    prof = "profile.npz"
    msg = _refused(
        r"kv\.compression\.0\.pool", kv={"compression": [{"pool": "decode-h100", "profile": prof}]}
    )
    assert msg == "config: kv.compression.0.pool: no pool named 'decode-h100'; pools: p"
    msg = _refused(
        r"kv\.compression\.0\.model", kv={"compression": [{"model": "llama-70b", "profile": prof}]}
    )
    assert msg == "config: kv.compression.0.model: no model named 'llama-70b'; models: llama-3-8b"
    assert len(_config({"compression": [{"pool": "p", "profile": prof}]}).kv.compression) == 1


def test_compression_on_a_tensor_parallel_pool_is_accepted_and_a_layout_needs_one() -> None:
    """Per-rank page tables are built for tp > 1 pools (tests/kv/test_kv_tp_compression.py); a TP layout file
    on pools that all have tp 1 is refused."""
    for target in ({"pool": "p"}, {"model": "llama-3-8b"}):
        assert _config({"compression": [{**target, "profile": "x.npz"}]}, tp=2).pools[0].tp == 2
        msg = _refused(
            r"kv\.compression\.0\.tp_layout",
            kv={"compression": [{**target, "profile": "x.npz", "tp_layout": "layout.json"}]},
        )
        assert msg.endswith("no pool it applies to has tp > 1 (p: tp 1)")


def test_explicit_aging_at_or_past_the_queue_deadline_is_refused() -> None:
    msg = _refused(r"kv\.queue\.aging_s", kv={"queue": {"aging_s": 10}})
    assert msg == (
        "config: kv.queue.aging_s: 10 s must be below limits.queue_deadline_s (10 s), or the waiter gets its "
        "429 before its aging hold (null turns aging off)"
    )
    _refused(r"kv\.queue\.aging_s", kv={"queue": {"aging_s": 3}}, limits={"queue_deadline_s": 2})
    assert _config({"queue": {"aging_s": 9.5}}).kv.queue.aging_s == 9.5
    assert _config({"queue": {"aging_s": None}}, {"queue_deadline_s": 1}).kv.queue.aging_s is None
    # The default (2 s) under a short deadline is inert, not an error: tests and small setups use them.
    assert _config(limits={"queue_deadline_s": 1}).kv.queue.aging_s == 2.0
    # Batch mode does not hold (its aging is the plan weight): queue.aging_s is not used there.
    _config({"queue": {"aging_s": 20}, "batch_admission": {"enabled": True}})


def test_zero_watermark_and_infinite_time_limits_are_refused() -> None:
    msg = _refused(r"kv\.watermark", kv={"watermark": 0})
    assert "must be > 0" in msg and "null block" in msg
    _refused(r"kv\.batch_admission\.time_limit_ms", kv={"batch_admission": {"time_limit_ms": float("inf")}})
    _refused(r"kv\.lease_s", kv={"lease_s": float("inf")})
    _refused(r"kv\.queue\.aging_s", kv={"queue": {"aging_s": float("nan")}})
    assert _config({"watermark": 0.001}).kv.watermark == 0.001


# ---- 4. reconcile --------------------------------------------------------------------------------------


def test_unreserved_probes_do_not_blind_reconcile() -> None:
    ledger = KvLedger(LedgerSettings())  # watermark 0.02, tolerance 0.02, share 1
    w = worker(blocks=1000)
    for i in range(50):  # the batch queue's probes (and router rollbacks): reserved, never dispatched
        res = ledger.reserve(request(f"probe{i}", 160, 0), w, float(i))  # 10 blocks
        assert res is not None
        res.release(Outcome.UNRESERVED)
    [sample] = ledger.reconcile([worker(blocks=1000, kv_usage=0.5)], 60.0)  # 500 blocks nobody explains
    assert sample.shrink_units == 480  # 500 − 0.02 · 1000; was 0 (500 probe blocks counted as released)
    assert ledger.capacity(w) == 980 - 480


def test_released_pages_that_ran_still_explain_usage() -> None:
    ledger = KvLedger(LedgerSettings())
    w = worker(blocks=1000)
    for i in range(50):
        res = ledger.reserve(request(f"r{i}", 160, 0), w, 0.0)
        assert res is not None
        res.release(Outcome.COMPLETED)  # ran: the scrape may predate the release
    [sample] = ledger.reconcile([worker(blocks=1000, kv_usage=0.5)], 1.0)
    assert sample.shrink_units == 0


# ---- 5. removed workers --------------------------------------------------------------------------------


def test_forget_drops_an_idle_book_at_once_and_a_busy_one_at_its_last_release() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    a, b = worker("a", blocks=100), worker("b", blocks=100)
    ledger.hold("h", a, 10, 0.0)
    res = ledger.reserve(request("r", 160, 0), b, 0.0)
    assert res is not None
    assert ledger.forget("a") is True and set(ledger.snapshot()) == {"b"}
    assert ledger.forget("b") is False and set(ledger.snapshot()) == {"b"}  # 10 blocks still reserved
    res.release(Outcome.COMPLETED)
    assert ledger.snapshot() == {} and ledger.reserved("b") == 0
    assert ledger.forget("never-seen") is True
    assert ledger.capacity(worker("a", blocks=50)) == 50  # seen again: a fresh book


def test_reconcile_against_the_fleet_forgets_removed_workers_and_their_metrics() -> None:
    ledger = KvLedger(LedgerSettings(watermark=0.0))
    a, b = worker("a", blocks=100, kv_usage=0.0), worker("b", blocks=100, kv_usage=0.0)
    ledger.reconcile(FleetView((a, b)), 0.0)
    metrics = GatewayMetrics()
    metrics.attach_live(lambda: [], lambda: {}, ledger.snapshot)
    assert 'mosaic_kv_total_units{worker="b"} 100.0' in metrics.render().decode()
    ledger.reconcile(FleetView((a,)), 1.0)  # discovery removed b
    text = metrics.render().decode()
    assert 'worker="b"' not in text and 'mosaic_kv_total_units{worker="a"} 100.0' in text
    ledger.reconcile([a], 2.0)  # a partial list (the fleet driver's) forgets nothing
    assert set(ledger.snapshot()) == {"a"}


def test_a_request_reusing_a_waiters_id_can_neither_use_nor_remove_its_hold() -> None:
    """The hold belonged to the request id: a client retrying with the aged head's X-Request-Id (or any request
    reusing it) passed `fits` on the head's held pages and its `reserve` deleted the head's hold. It belongs to
    the gateway's ticket now."""
    ledger = KvLedger()
    w = worker("w", blocks=100)  # capacity 98
    ledger.reserve(request("running", prompt=16 * 38, max_out=0), w, 0.0)  # 38 blocks: 60 left
    policy = _aging_policy(ledger, w)
    head = dataclasses.replace(request("X", prompt=16 * 60, max_out=0), ticket=1)
    policy.before_attempt(head, waited_s=2.0)
    assert ledger.snapshot()["w"]["holds"] == 60
    newcomer = dataclasses.replace(request("X", prompt=16 * 60, max_out=0), ticket=2)
    assert ledger.free(w, newcomer.holder) == 0 and ledger.free(w, head.holder) == 60
    assert not ledger.fits(newcomer, w, 5.0) and ledger.reserve(newcomer, w, 5.0) is None
    assert ledger.snapshot()["w"]["holds"] == 60  # still the head's
    assert ledger.fits(head, w, 5.0)
    res = ledger.reserve(head, w, 5.0)
    assert res is not None and ledger.snapshot()["w"]["holds"] == 0  # the holder's reserve takes its hold


def test_the_gateway_numbers_each_request_it_routes() -> None:
    parsed = parse_request("completions", b'{"model": "m", "prompt": [1, 2, 3]}')
    a = route_request(parsed, "X", 0.0, 16, ticket=7)
    assert (a.ticket, a.holder) == (7, 7)
    assert route_request(parsed, "X", 0.0, 16).holder == "X"  # unnumbered: the request id
