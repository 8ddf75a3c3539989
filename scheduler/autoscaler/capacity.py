"""Per-instance capacities the autoscaler buys with, from the perf model within the latency SLO.

One computation for both drivers: the cluster simulator (`simulator.cluster_config.pool_specs`) and the
live gateway's controller (`server.autoscaling`) turn a pool's GPU, model, TP and engine knobs into a
`PoolSpec` through `instance_capacity`, so a simulated run and a live run size instances identically.

- decode tokens/s within the TPOT SLO: the largest batch b ≤ min(max_num_seqs, kv_tokens // context)
  whose decode step at `context` tokens per sequence takes ≤ TPOT; rate = b / step(b).
- prefill tokens/s: `PerfModel.prefill_tokens_per_s(min(2048, max_num_batched_tokens))`, the sustained
  rate at a typical chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from placement.perf_model import PerfModel

PREFILL_CHUNK = 2048  # the chunk at which sustained prefill throughput is quoted


@dataclass(frozen=True, slots=True)
class InstanceCapacity:
    decode_tps: float  # within the TPOT SLO; 0 when even one sequence misses it
    prefill_tps: float


def decode_tps_within_slo(
    perf: PerfModel, tpot_s: float, context: int, max_seqs: int, kv_tokens: int
) -> float:
    """Decode tokens/s one instance sustains with every step ≤ the TPOT SLO at `context` tokens per sequence.

    The largest batch b ≤ min(max_seqs, kv_tokens // context) whose decode step fits the SLO (binary search:
    step time grows with b); rate = b / step(b). 0 when even b = 1 misses the SLO.
    """
    hi = max(0, min(max_seqs, kv_tokens // max(1, context)))
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if perf.decode_step_time([context] * mid) <= tpot_s:
            lo = mid
        else:
            hi = mid - 1
    return lo / perf.decode_step_time([context] * lo) if lo else 0.0


def instance_capacity(
    perf: PerfModel,
    *,
    tpot_s: float,
    context: int,
    max_num_seqs: int,
    kv_tokens: int,
    max_num_batched_tokens: int = 8192,
) -> InstanceCapacity:
    """What one instance of `perf` (GPU, model, TP) sustains within the SLO (module docstring)."""
    return InstanceCapacity(
        decode_tps=decode_tps_within_slo(perf, tpot_s, context, max_num_seqs, kv_tokens),
        prefill_tps=perf.prefill_tokens_per_s(min(PREFILL_CHUNK, max_num_batched_tokens)),
    )
