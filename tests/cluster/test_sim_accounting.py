"""Where the cluster simulator's books must agree with the gateway's: the end of billing, and the in-flight
counts the router reads for a P/D request's decode hop."""

from __future__ import annotations

from typing import Any

from simulator.cluster import ClusterSimulator, SimRequest
from simulator.cluster_config import parse_fleet
from tests.cluster.test_cluster_sim import PD_FLEET


def test_billing_ends_when_the_trace_is_served_not_at_the_next_tick() -> None:
    """One short request on a fixed 1 + 1 fleet: billed to its completion (well under a second), not to the
    first decision tick at 10 s that noticed the trace was over (the old end)."""
    sim = ClusterSimulator(parse_fleet(PD_FLEET), None, "fixed")
    result = sim.run([SimRequest(0.0, 64, 4)])
    assert len(result.completed) == 1
    arrival, _, _, e2e, _, _ = result.completed[0]
    assert result.end_s == arrival + e2e and result.end_s < 1.0
    assert sum(result.instance_seconds.values()) == 2 * result.end_s


def test_decode_hop_counts_as_decode_at_dispatch_as_the_gateway_ticket() -> None:
    """After a P/D request's prefill, its decode instance shows no prompt backlog and one decode request
    (`server.registry.InflightTicket(prefilled_remotely=True)`); it showed the whole prompt as backlog and
    no decode request until the first token, so routing read a different load than the gateway."""
    sim = ClusterSimulator(parse_fleet(PD_FLEET), None, "fixed")
    seen: list[tuple[int, int]] = []
    prefill_done = sim._prefill_done

    def spy(req: Any, inst: Any, now: float) -> None:
        prefill_done(req, inst, now)
        decode = sim._instances[req.decision.decode.id]
        seen.append((decode.inflight_prefill_tokens, decode.inflight_decode))

    sim._prefill_done = spy  # type: ignore[method-assign]
    result = sim.run([SimRequest(0.0, 4000, 8)])
    assert seen == [(0, 1)]
    assert len(result.completed) == 1
    decode = next(i for i in sim._instances.values() if i.pool == "decode-a100")
    assert (decode.inflight, decode.inflight_prefill_tokens, decode.inflight_decode) == (0, 0, 0)
