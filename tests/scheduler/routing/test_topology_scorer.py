"""`pd-domain-affinity`: exact scores, and the P/D prefill pick through the real `mosaic` defaults.

Two H100 prefill workers, one per rack, behind one A100 decode worker in rack-1 (so the decode pick is
fixed and the prefill pass decides). Prefill profile weights: capacity-load 1, est-ttft 3, prefix-affinity
2, kv-headroom 0.5, cost 0.5, pd-domain-affinity 1.
"""

from __future__ import annotations

import random

import pytest

from scheduler.fleet import WorkerView
from scheduler.routing.config import RoutingConfig, build_router
from scheduler.routing.framework import Cycle, Decision
from scheduler.routing.profiles import PD_DOMAIN_AFFINITY_WEIGHT
from scheduler.routing.topology_scorer import DECODE_PEER_FACT, PdDomainAffinityScorer
from tests.scheduler.routing.builders import req, view, worker

D1 = worker("d", gpu="A100-80GB", role="decode", domain="rack-1")
PROMPT = 2048


def prefill(id: str, domain: str | None, inflight: int = 0) -> WorkerView:
    """An H100 prefill worker with `inflight` 2,048-token prompts queued."""
    return worker(
        id, gpu="H100-SXM", role="prefill", domain=domain, inflight=inflight, prefill_tokens=inflight * PROMPT
    )


@pytest.mark.parametrize(
    ("peer_domain", "domains", "expected"),
    [
        pytest.param("rack-1", ["rack-1", "rack-2"], [1.0, 0.0], id="same domain 1, other domain 0"),
        pytest.param("rack-1", [None, "rack-1"], [0.5, 1.0], id="an unknown candidate domain is neutral 0.5"),
        pytest.param(None, ["rack-1", "rack-2"], [0.5, 0.5], id="unknown decode domain: all neutral"),
        pytest.param(None, [None, None], [0.5, 0.5], id="no domains anywhere: all neutral"),
    ],
)
def test_scores_exact(peer_domain: str | None, domains: list[str | None], expected: list[float]) -> None:
    candidates = [prefill(f"p{i}", d) for i, d in enumerate(domains)]
    cycle = Cycle(req(prompt=PROMPT), view(*candidates), 0.0, random.Random(0))
    cycle.facts[DECODE_PEER_FACT] = worker("d", gpu="A100-80GB", role="decode", domain=peer_domain)
    assert PdDomainAffinityScorer().score(cycle, candidates) == expected


def test_no_decode_peer_is_neutral() -> None:
    """Outside the prefill pass (mixed / decode profiles) nothing was chosen yet: every score is 0.5."""
    candidates = [prefill("a", "rack-1"), prefill("b", "rack-2")]
    cycle = Cycle(req(prompt=PROMPT), view(*candidates), 0.0, random.Random(0))
    assert PdDomainAffinityScorer().score(cycle, candidates) == [0.5, 0.5]


def _route(fleet: tuple[WorkerView, ...], seed: int, weight: float | None = None) -> Decision:
    cfg = RoutingConfig()
    if weight is not None:
        cfg = RoutingConfig.model_validate(
            {"profiles": {"prefill": {"weights": {"pd-domain-affinity": weight}}}}
        )
    decision = build_router(cfg).route(req(prompt=PROMPT), view(*fleet), 0.0, random.Random(seed))
    assert isinstance(decision, Decision) and decision.path == "pd"
    return decision


def test_default_weights_use_it_only_for_prefill() -> None:
    weights = {n: p["weights"] for n, p in build_router().describe()["profiles"].items()}
    assert weights["prefill"]["pd-domain-affinity"] == PD_DOMAIN_AFFINITY_WEIGHT == 1.0
    assert "pd-domain-affinity" not in weights["mixed"]  # weight 0 → not run in that profile
    assert "pd-domain-affinity" not in weights["decode"]


def test_equal_loads_pick_the_decode_workers_domain() -> None:
    """Idle twins tie on every other scorer; the domain breaks the tie for every rng seed, for either rack.
    With the scorer at weight 0 the rng splits the tie (so this test could fail)."""
    for decode, want in (
        (D1, "p-r1"),
        (worker("d", gpu="A100-80GB", role="decode", domain="rack-2"), "p-r2"),
    ):
        fleet = (decode, prefill("p-r1", "rack-1"), prefill("p-r2", "rack-2"))
        assert {_route(fleet, seed).prefill.id for seed in range(20)} == {want}  # type: ignore[union-attr]
    fleet = (D1, prefill("p-r1", "rack-1"), prefill("p-r2", "rack-2"))
    assert {_route(fleet, seed, weight=0).prefill.id for seed in range(20)} == {"p-r1", "p-r2"}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("same_inflight", "other_inflight", "expected"),
    [
        # est-ttft: T = overhead + (queued + 2048) / 28k tok/s; one queued prompt roughly doubles T, so the
        # busy worker loses 3·0.46 (est-ttft) + 1·0.5 (capacity-load) ≈ 1.9 > 1.0 (the domain's weight);
        # 3 vs 2 loses 3·0.24 + 0.25 = 0.97 < 1, 10 vs 8 loses 3·0.18 + 0.18 = 0.72, 10 vs 7 loses 1.08.
        pytest.param(1, 0, "p-r2", id="same domain one prompt behind an idle worker → escapes to rack-2"),
        pytest.param(10, 7, "p-r2", id="same domain 10 queued vs 7 → escapes (~43% more load)"),
        pytest.param(10, 8, "p-r1", id="same domain 10 queued vs 8 → comparable, stays in rack-1"),
        pytest.param(3, 2, "p-r1", id="same domain 3 queued vs 2 → comparable, stays in rack-1"),
    ],
)
def test_domain_decides_only_among_comparable_loads(
    same_inflight: int, other_inflight: int, expected: str
) -> None:
    fleet = (D1, prefill("p-r1", "rack-1", same_inflight), prefill("p-r2", "rack-2", other_inflight))
    assert _route(fleet, 0).prefill.id == expected  # type: ignore[union-attr]


def test_a_stream_does_not_pile_onto_the_same_domain_worker() -> None:
    """40 P/D requests, none completing: each routed one adds a queued prompt to its prefill worker. The
    same-domain worker takes more, but the other rack still takes a large share (load escape)."""
    counts = {"p-r1": 0, "p-r2": 0}
    router = build_router()
    for i in range(40):
        fleet = view(D1, prefill("p-r1", "rack-1", counts["p-r1"]), prefill("p-r2", "rack-2", counts["p-r2"]))
        decision = router.route(req(prompt=PROMPT, id=f"r{i}"), fleet, 0.0, random.Random(i))
        assert isinstance(decision, Decision) and decision.prefill is not None
        counts[decision.prefill.id] += 1
    assert counts["p-r1"] > counts["p-r2"] >= 15, counts  # measured 23 / 17
