"""`pd-domain-affinity`: prefer a prefill worker in the network domain of the request's decode worker.

A P/D request's KV cache moves from the prefill worker to the decode worker once per request; across
network domains (racks, RDMA groups, zones) that link is slower (the cluster simulator's
`kv_link_cross_domain_gbps`), so the transfer adds to TTFT. Topology-aware autoscaling places new
prefill and decode instances in one domain; this scorer makes the router use that placement.

The P/D decider (`profiles.PdProfileHandler`) picks the decode worker first and records it in the cycle's
facts under `DECODE_PEER_FACT` before the prefill pass. Per prefill candidate w, with D the decode
worker's domain (`WorkerView.domain`):

| case | score |
|---|---|
| w.domain == D | 1.0 |
| w.domain != D (both known) | 0.0 |
| D unknown, w.domain unknown, or no decode worker chosen (mixed / decode passes) | 0.5 (neutral) |

Neutral 0.5 keeps an unknown domain between a known match and a known mismatch, and a fleet with no
domains at all scores every candidate alike (the ordering is unchanged). The weight lives in the
profile (`profiles.MOSAIC_WEIGHTS`): it is sized so the domain decides only among comparably loaded
prefill workers; a same-domain worker whose queue is much longer loses to an idle one elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from scheduler.fleet import WorkerView
from scheduler.routing.framework import Cycle
from scheduler.routing.scorers import NoParams

DECODE_PEER_FACT = "pd.decode_worker"  # Cycle.facts key: the decode worker already chosen for this request

SAME_DOMAIN = 1.0
OTHER_DOMAIN = 0.0
UNKNOWN_DOMAIN = 0.5


def decode_peer(cycle: Cycle) -> WorkerView | None:
    """The decode worker the P/D decider chose for this request, if any."""
    peer = cycle.facts.get(DECODE_PEER_FACT)
    return peer if isinstance(peer, WorkerView) else None


def domain_affinity(peer_domain: str | None, domain: str | None) -> float:
    """1.0 same domain, 0.0 different domains, 0.5 when either is unknown (module docstring)."""
    if peer_domain is None or domain is None:
        return UNKNOWN_DOMAIN
    return SAME_DOMAIN if domain == peer_domain else OTHER_DOMAIN


class PdDomainAffinityScorer:
    """Scores prefill candidates by network domain relative to the chosen decode worker (module docstring)."""

    type: ClassVar[str] = "pd-domain-affinity"
    Params = NoParams

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def score(self, cycle: Cycle, candidates: Sequence[WorkerView]) -> list[float]:
        peer = decode_peer(cycle)
        peer_domain = peer.domain if peer is not None else None
        return [domain_affinity(peer_domain, w.domain) for w in candidates]
