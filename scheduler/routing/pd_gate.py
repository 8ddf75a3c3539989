"""Conditional disaggregation: send a P/D-eligible request to a remote prefill worker only when that pays.

As in NVIDIA Dynamo's disaggregated router and llm-d's P/D threshold. After the decider has picked a
decode worker d and run the `prefill` pass, the gate compares the prefill pool's queue with what d
would take to prefill the prompt itself:

    W_w   = queued prefill tokens_w / prefill_tps_w       queue wait on prefill worker w (seconds)
            queued = max(gateway in-flight prefill tokens, scraped waiting · P)   (the est-ttft queue)
    W     = min W_w over the prefill candidates that passed the filters   (the pool's best wait)
    L_d   = est-ttft of d for this prompt = overhead_d + (queued_d + P) / prefill_tps_d

    local prefill (path `decode-only`)   iff   W > max_prefill_wait_s      (the pool is saturated)
                                          and  W > L_d + local_margin_s    (and d would be sooner)
    else remote prefill (path `pd`). On `decode-only` the decode worker keeps its reservation; the prefill
    pass's reservations are released by the router, as for any reservation a Decision does not carry.

`max_prefill_wait_s = None` turns the gate off (always remote, the behaviour before the gate);
`local_margin_s = None` drops the second test (local whenever the pool is over the bound). The margin
stands for what the estimate leaves out: a local prefill stalls d's running decodes (their TPOT), a
remote one adds a KV transfer. Why both tests (and not either): a prefill queue also grows when the
decode side is backed up (prefill workers hold KV until decode pulls it); then L_d is long too, and
sending prefill work to the decode pool would feed the jam (measured: docs/routing.md "Conditional
disaggregation"). Pure: no clock, the snapshot's counters only, so a seeded simulation replays exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.fleet import WorkerView
from scheduler.routing.framework import RouteRequest
from scheduler.routing.scorers import estimated_ttft_s, queued_prefill_tokens


def prefill_queue_wait_s(worker: WorkerView, req: RouteRequest) -> float:
    """W_w: seconds of prefill already queued on `worker`, at its own prefill rate (inf if it has none).

    The queue is the one the est-ttft scorer uses (max of the gateway's in-flight prefill tokens and the
    scraped waiting count × this prompt), without this request's own prompt and the API overhead.
    """
    rate = worker.capacity.prefill_tokens_per_s
    if rate <= 0:
        return math.inf
    return queued_prefill_tokens(worker, req) / rate


@dataclass(frozen=True, slots=True)
class PdGateVerdict:
    """The gate's inputs and answer for one request (seconds); `local` True → decode-only."""

    local: bool
    best_prefill_wait_s: float
    local_prefill_s: float
    reason: str  # "remote" (pool under the bound) | "local-not-sooner" | "pool-saturated" (→ local)


@dataclass(frozen=True, slots=True)
class PdGate:
    """Decides remote vs local prefill for a P/D-eligible request (see the module docstring)."""

    max_prefill_wait_s: float | None = None
    local_margin_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self.max_prefill_wait_s is not None

    def verdict(
        self, req: RouteRequest, decode: WorkerView, prefill_candidates: Sequence[WorkerView]
    ) -> PdGateVerdict:
        """The verdict for `req` with `decode` chosen; `prefill_candidates` is non-empty."""
        best = min(prefill_queue_wait_s(w, req) for w in prefill_candidates)
        local = estimated_ttft_s(decode, req)
        if self.max_prefill_wait_s is None:
            return PdGateVerdict(False, best, local, "remote")
        if best <= self.max_prefill_wait_s:
            return PdGateVerdict(False, best, local, "remote")
        if self.local_margin_s is not None and best <= local + self.local_margin_s:
            return PdGateVerdict(False, best, local, "local-not-sooner")
        return PdGateVerdict(True, best, local, "pool-saturated")

    def describe(self) -> dict[str, Any]:
        return {
            "pd_max_prefill_wait_s": self.max_prefill_wait_s,
            "pd_local_prefill_margin_s": self.local_margin_s,
        }
