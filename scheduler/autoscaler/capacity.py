"""Per-instance capacities the autoscaler buys with, from the perf model within the latency SLO.

One computation for both drivers: the cluster simulator (`simulator.cluster_config.pool_specs`) and the
live gateway's controller (`server.autoscaling`) turn a pool's GPU, model, TP and engine knobs into a
`PoolSpec` through `instance_capacity`, so a simulated run and a live run size instances identically.

- decode tokens/s within the TPOT SLO: the largest batch b ≤ min(max_num_seqs, kv_tokens // context)
  whose decode step at `context` tokens per sequence takes ≤ TPOT; rate = b / step(b).
- prefill tokens/s: `PerfModel.prefill_tokens_per_s(min(2048, max_num_batched_tokens))`, the sustained
  rate at a typical chunk.
- the decode profile: decode tokens/s within the TPOT SLO at each context of `PROFILE_CONTEXTS` the KV
  cache holds (`decode_profile`), so the policies size decode at the context they observe (a sequence's
  KV is read every step: at 8k tokens an A100 sustains a sixth of its 1k-token rate for Llama-3-8B).
"""

from __future__ import annotations

from dataclasses import dataclass

from placement.perf_model import PerfModel

PREFILL_CHUNK = 2048  # the chunk at which sustained prefill throughput is quoted
PROFILE_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


@dataclass(frozen=True, slots=True)
class InstanceCapacity:
    decode_tps: float  # within the TPOT SLO at the configured context; 0 when even one sequence misses it
    prefill_tps: float
    # (context tokens per sequence, decode tokens/s within the TPOT SLO), ascending, every rate > 0
    decode_by_context: tuple[tuple[int, float], ...] = ()

    def times(self, engines: int) -> InstanceCapacity:
        """An instance of `engines` such engines (a data-parallel vLLM server): every rate `engines` times."""
        if engines == 1:
            return self
        return InstanceCapacity(
            self.decode_tps * engines,
            self.prefill_tps * engines,
            tuple((context, rate * engines) for context, rate in self.decode_by_context),
        )


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


def no_decode_reason(perf: PerfModel, tpot_s: float, context: int, kv_tokens: int) -> str:
    """Why `decode_tps_within_slo` is 0, for the error that refuses the pool: a KV cache too small for one
    sequence reads very differently from a GPU too slow for the SLO."""
    if kv_tokens < context:
        return f"its KV cache holds {kv_tokens} tokens, less than one sequence of {context} tokens of context"
    step_ms = perf.decode_step_time([context]) * 1e3
    return f"one sequence's decode step takes {step_ms:.1f} ms at {context} tokens of context"


def decode_profile(
    perf: PerfModel,
    tpot_s: float,
    max_seqs: int,
    kv_tokens: int,
    contexts: tuple[int, ...] = PROFILE_CONTEXTS,
) -> tuple[tuple[int, float], ...]:
    """`decode_tps_within_slo` at each context the KV cache holds, up to the first that misses the SLO."""
    points = []
    for context in contexts:
        tps = (
            decode_tps_within_slo(perf, tpot_s, context, max_seqs, kv_tokens) if context <= kv_tokens else 0.0
        )
        if tps <= 0:
            break
        points.append((context, tps))
    return tuple(points)


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
        decode_by_context=decode_profile(perf, tpot_s, max_num_seqs, kv_tokens),
    )
