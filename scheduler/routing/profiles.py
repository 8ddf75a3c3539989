"""Scheduling profiles, the P/D decider, and the named policies' defaults.

Three profiles, each one Filter → Score → Pick → Reserve pass over the workers of some roles:

| profile | roles | used for |
|---|---|---|
| `mixed` | mixed, decode | prompts shorter than `pd_threshold_tokens`, several sequences (a batch, `n` > 1), requests marked `single_hop` (Responses, prompt logprobs), or models with no prefill pool |
| `decode` | decode, mixed | P/D-eligible prompts: picked **first**, as decode holds the KV for the whole generation |
| `prefill` | prefill | P/D-eligible prompts whose decode pick is a decode-role worker |

The decider (`PdProfileHandler.handle`):

1. one sequence, prompt ≥ `pd_threshold_tokens` and the model has a prefill pool → run `decode`;
   - nothing fits → Reject (reasons from the decode pass);
   - a mixed worker won → single hop to it (path `single`);
   - a decode worker won → run `prefill`; a prefill worker fits and the P/D gate (`pd_gate.py`) finds
     remote prefill pays → P/D pair (path `pd`); else the decode worker prefills itself (path
     `decode-only`; its reservation is kept). The gate says local when the prefill pool's best queue wait
     exceeds `pd_max_prefill_wait_s` and the decode worker's own estimated prefill time plus a margin.
2. otherwise → run `mixed`; nothing fits → Reject.

Policies differ in scorers and picker only: `round-robin` (no scorers, rotating picker), `least-loaded`
(no scorers, fewest raw requests), `mosaic` (capacity-aware scorers, max weighted score).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler.fleet import Role
from scheduler.routing.framework import Cycle, Decision, SchedulingProfile
from scheduler.routing.pd_gate import PdGate
from scheduler.routing.reasons import Reject
from scheduler.routing.topology_scorer import DECODE_PEER_FACT

MIXED_ROLES = frozenset({Role.MIXED, Role.DECODE})
DECODE_ROLES = frozenset({Role.DECODE, Role.MIXED})
PREFILL_ROLES = frozenset({Role.PREFILL})
PROFILE_ROLES: Mapping[str, frozenset[Role]] = {
    "mixed": MIXED_ROLES,
    "decode": DECODE_ROLES,
    "prefill": PREFILL_ROLES,
}

POLICIES = ("round-robin", "least-loaded", "mosaic")
DEFAULT_POLICY = "mosaic"
POLICY_PICKERS: Mapping[str, str] = {
    "round-robin": "round-robin",
    "least-loaded": "least-loaded",
    "mosaic": "max-score",
}

# `context-length` before the worker-state filters: a prompt no worker's context can hold is a 400 whatever
# state each worker is in; counted first as `unhealthy` / `starting` / `draining` (retryable) on a worker not
# ready, it was held in the admission queue, at the head of the model's FIFO, until its deadline.
DEFAULT_FILTERS = (
    "model", "role", "adapter", "context-length", "excluded", "state", "breaker", "at-capacity", "kv-fit",
)  # fmt: skip
MOSAIC_SCORERS = (
    "capacity-load", "est-ttft", "prefix-affinity", "kv-headroom", "cost", "pd-domain-affinity", "lora-affinity",
)  # fmt: skip

# `kv-best-fit` is not among the default scorers: the gateway enables it when the KV ledger is on
# (`server.kv_setup.routing_with_kv`), with this weight in the mixed and decode profiles (0 for prefill: a
# prefill reservation lives only until the decode side pulls the KV). Measured with the router placing
# requests in the KV fleet simulator (`bench/kv_reservation.py --best-fit-sweep`, docs/kv.md "Routing
# weight"; 3 synthetic long-context mixes + 2 Mooncake slices): goodput vs weight 0 was on average 1.03x at
# 0.5 (0.99-1.09x), 1.02x at 1 (0.96-1.15x), and erratic above (0.50-1.35x at 2, 0.67-1.08x at 4): heavier
# best fit overrides the load and TTFT scorers. Long-prompt admission waits did not change with the weight;
# the admission queue's aging hold is what protects long prompts.
KV_BEST_FIT_WEIGHT = 0.5

# `pd-domain-affinity` (scheduler/routing/topology_scorer.py) scores prefill candidates 1 / 0 by whether
# they share the chosen decode worker's network domain (0.5 unknown). At 1.0 against the prefill
# profile's load scorers (est-ttft 3 + capacity-load 1) it decides among comparably loaded prefill
# workers only: between two equal GPUs the same-domain one loses once its queued work (this request
# included) exceeds ~4/3 of the other's — one 2,048-token prompt queued against an idle worker costs it
# 3·0.46 + 0.5 ≈ 1.9 points (tests/scheduler/routing/test_topology_scorer.py; the weight sweep in
# docs/routing.md "Network domains"). Only the prefill profile uses it (no decode peer elsewhere).
PD_DOMAIN_AFFINITY_WEIGHT = 1.0

# `lora-affinity` (scheduler/routing/lora.py) scores 1 / 0.5 / 0: the adapter running there, a free adapter
# slot, every slot taken by other adapters. The last means waiting for a slot — for the requests of another
# adapter to finish, whole generations — so a full worker should lose to one twice as loaded: at 2.0 it
# costs 2 points, what capacity-load (3) charges a worker with three times the best one's load. Measured in
# the simulator (bench/lora_routing.py, docs/routing.md "LoRA adapters"): against 0 it cut mean TTFT by a
# third at max_loras 1 and a fifth at 2; 4 and 8 did no better. It scores every worker 1 for a request without an
# adapter, so base-model traffic is routed exactly as without it.
LORA_AFFINITY_WEIGHT = 2.0

# Weights per profile (the same scorer serves every profile with its own weight). Why these:
# - mixed: load dominates (keeps every GPU at a similar utilisation, so traffic splits by capacity);
#   TTFT breaks near-ties towards fast prefill; affinity is strong but escapes under load; cost is a nudge.
# - decode: the decode worker's TTFT is decided by the prefill pick, so load and KV headroom matter.
# - prefill: prefill is compute-bound and short; TTFT decides, affinity saves recomputing the prompt.
MOSAIC_WEIGHTS: Mapping[str, Mapping[str, float]] = {
    "mixed": {
        "capacity-load": 3.0,
        "est-ttft": 2.0,
        "prefix-affinity": 2.0,
        "kv-headroom": 1.0,
        "cost": 0.5,
        "kv-best-fit": KV_BEST_FIT_WEIGHT,
        "pd-domain-affinity": 0.0,
        "lora-affinity": LORA_AFFINITY_WEIGHT,
    },
    "decode": {
        "capacity-load": 3.0,
        "est-ttft": 0.0,
        "prefix-affinity": 1.0,
        "kv-headroom": 2.0,
        "cost": 0.5,
        "kv-best-fit": KV_BEST_FIT_WEIGHT,
        "pd-domain-affinity": 0.0,
        "lora-affinity": LORA_AFFINITY_WEIGHT,
    },
    "prefill": {
        "capacity-load": 1.0,
        "est-ttft": 3.0,
        "prefix-affinity": 2.0,
        "kv-headroom": 0.5,
        "cost": 0.5,
        "kv-best-fit": 0.0,
        "pd-domain-affinity": PD_DOMAIN_AFFINITY_WEIGHT,
        "lora-affinity": LORA_AFFINITY_WEIGHT,
    },
}


@dataclass(frozen=True, slots=True)
class PdProfileHandler:
    """The P/D decider over three profiles (see the module docstring)."""

    mixed: SchedulingProfile
    decode: SchedulingProfile
    prefill: SchedulingProfile
    pd_threshold_tokens: int = 256
    gate: PdGate = field(
        default_factory=PdGate
    )  # conditional disaggregation; off by default (always remote prefill)

    def pd_eligible(self, cycle: Cycle) -> bool:
        """One sequence, a prompt of at least the threshold, and a prefill pool for the model. Several
        sequences (a batch of prompts, `n` > 1) are never split: vLLM answers a prefill hop with one
        `kv_transfer_params` (a batch's: its first prompt's), so a decode hop would pull one sequence's
        blocks for all of them. They go single-hop, a decode worker prefilling them itself. So does a request
        marked `single_hop` (an API without a prefill handover, OpenAI's Responses; prompt logprobs, which a
        decode worker given the prompt's KV cannot compute)."""
        req = cycle.req
        return (
            not req.single_hop
            and req.sequences == 1
            and req.prompt_tokens >= self.pd_threshold_tokens
            and cycle.view.has_role(req.model, Role.PREFILL)
        )

    def handle(self, cycle: Cycle) -> Decision | Reject:
        if not self.pd_eligible(cycle):
            single = cycle.run(self.mixed)
            return cycle.decide(single) if single.worker is not None else cycle.reject(single)
        decode = cycle.run(self.decode)
        if decode.worker is None:
            return cycle.reject(decode)
        if decode.worker.role != Role.DECODE:
            return cycle.decide(decode)
        cycle.facts[DECODE_PEER_FACT] = decode.worker  # the prefill pass scores domains against it
        prefill = cycle.run(self.prefill)
        if prefill.worker is None:
            return cycle.decide(decode, path="decode-only")
        if self.gate.enabled:
            verdict = self.gate.verdict(cycle.req, decode.worker, [s.worker for s in prefill.scored])
            if verdict.local:  # prefill pool saturated: prefill on the decode worker; the router releases
                return cycle.decide(decode, path="decode-only")  # the prefill pass's reservation
        return cycle.decide(decode, prefill, path="pd")

    def describe(self) -> dict[str, Any]:
        return {
            "pd_threshold_tokens": self.pd_threshold_tokens,
            **self.gate.describe(),
            "profiles": {p.name: describe_profile(p) for p in (self.mixed, self.decode, self.prefill)},
        }


@dataclass(frozen=True, slots=True)
class SingleProfileHandler:
    """One profile, no P/D: the simplest handler (tests, and callers with a custom profile)."""

    profile: SchedulingProfile

    def handle(self, cycle: Cycle) -> Decision | Reject:
        result = cycle.run(self.profile)
        return cycle.decide(result) if result.worker is not None else cycle.reject(result)

    def describe(self) -> dict[str, Any]:
        return {"profiles": {self.profile.name: describe_profile(self.profile)}}


def describe_profile(profile: SchedulingProfile) -> dict[str, Any]:
    return {
        "roles": sorted(r.value for r in profile.roles),
        "filters": [getattr(f, "type", type(f).__name__) for f in profile.filters],
        "weights": {ws.name: ws.weight for ws in profile.scorers},
        "picker": getattr(profile.picker, "type", type(profile.picker).__name__),
    }
