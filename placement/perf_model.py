"""Roofline timing of one vLLM engine step on a given GPU, model and tensor-parallel degree.

A step (one forward pass of vLLM's continuous batching) processes some prefill chunks and some decodes
together. Its time is

    t = t_fix(seqs) + t_tp(T) + max(t_mem, t_compute)
    t_mem     = (W/tp + Σ_decode c_i · kv_bytes/tp) / (BW · η)                 weights + KV read over HBM
    t_compute = (2·N·T + 4·L·d·A) / (tp · F · MFU(T))                          T tokens in the step
    A         = Σ_prefill p_j·(c_j + p_j/2) + Σ_decode c_i                    attention token-pairs (causal)
    MFU(T)    = mfu_max · T / (T + T_half)                                     ramps with tokens per step
    t_fix     = step_base + step_per_seq · seqs
    t_tp      = 2·L · (α · log2(tp) + T · h · a · 2(tp−1)/tp / B)    tp > 1; exactly 0 at tp = 1 (a = max(2, dtype_bytes))

(REFERENCE.md, "Roofline perf model"). η is the achievable fraction of peak bandwidth (HBM vs GDDR).
t_tp is the tensor-parallel all-reduce traffic: two all-reduces a layer (after attention and after the
MLP), each of the step's T·h activations (h = hidden size); α = `GpuSpec.allreduce_latency_us` per log2(tp)
step (tree latency), B = `GpuSpec.allreduce_gbps`, the effective bandwidth of a ring all-reduce that moves
2(tp−1)/tp of the message per GPU. Decode at small batch is latency-bound (≈ 2·L·α·log2 tp: ~10 ms a log2
step for Llama-2-70B on A100, ~7 ms on H100, the "floor" splitwise-sim shows at TP4/8); large prefills add
the bandwidth part, which also stands in for the compute efficiency TP4/8 lose on narrower GEMMs.

The constants below and the GPU rows' MFU were fitted to the published measurements in
`../shared/data/calibration/` (vLLM benchmark_serving on Llama-3-8B; splitwise-sim's Llama-2-70B TP2
prefill/decode), α and B to splitwise-sim's TP2/4/8 runs on A100-80GB and H100. `tests/placement/
test_perf_model.py` holds the reference table (every point within ±25%, one TP8 prefill under a stated
wider bar) and checks the per-tp accuracy over the whole CSV.

KV capacity: (memory · gpu_memory_utilization − weights/tp − activation reserve) / (kv_bytes/tp).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from placement.catalog import GpuSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class PerfConstants:
    mfu_max: float = 0.60  # plateau MFU of large prefills where the GPU row has no calibrated value
    eta_hbm: float = 0.70  # achieved fraction of HBM bandwidth in decode (Vidur: 0.68–0.72)
    eta_gddr: float = 0.78  # GDDR6 parts reach a higher fraction of their (lower) peak
    step_base_s: float = 0.00045  # scheduler + sampling + launch overhead per step
    step_per_seq_s: float = 0.000035  # per sequence in the batch (input prep, sampling, detokenise)
    api_overhead_s: float = 0.012  # per-request fixed TTFT at the API server (tokenise, schedule, detok)
    activation_reserve_frac: float = 0.04  # of device memory, kept for activations / CUDA graphs


DEFAULT_CONSTANTS = PerfConstants()


class PerfModel:
    """Step timing and KV capacity for (GPU, model, tp). Pure arithmetic: safe to call in tight loops."""

    __slots__ = (
        "_allreduce_s",
        "_allreduce_s_per_token",
        "_attn_flops_per_pair",
        "_bw",
        "_c",
        "_flops",
        "_kv_bytes",
        "_linear_flops",
        "_weight_read",
        "gpu",
        "model",
        "tp",
    )

    def __init__(
        self, gpu: GpuSpec, model: ModelSpec, tp: int = 1, constants: PerfConstants = DEFAULT_CONSTANTS
    ):
        if tp < 1:
            raise ValueError(f"tensor parallel degree must be ≥ 1, got {tp}")
        self.gpu = gpu
        self.model = model
        self.tp = tp
        self._c = constants
        eta = constants.eta_gddr if gpu.memory_kind == "gddr" else constants.eta_hbm
        self._bw = gpu.hbm_gbps * 1e9 * eta * tp  # aggregate effective bytes/s over the TP group
        self._flops = gpu.tflops * 1e12 * tp
        self._weight_read = model.weight_bytes
        self._kv_bytes = model.kv_bytes_per_token
        self._linear_flops = 2.0 * model.params
        self._attn_flops_per_pair = 4.0 * model.layers * model.num_heads * model.head_dim
        # Tensor-parallel all-reduces: 2 per layer (after attention and after the MLP), each of the step's
        # T·hidden activations; latency per log2(tp) step plus ring traffic 2(tp−1)/tp of the message. Both
        # are exactly 0.0 at tp = 1 (log2(1) = 0, tp − 1 = 0), so a single GPU's step time is the roofline's.
        n = 2 * model.layers
        self._allreduce_s = n * gpu.allreduce_latency_us * 1e-6 * math.log2(tp)
        # The activations all-reduced are 16-bit (bf16/fp16) even when weights and KV are 8-bit: FP8 models
        # quantise GEMM inputs, not the residual stream vLLM all-reduces; a 32-bit model sends 32-bit.
        activation_bytes = max(2, model.dtype_bytes)
        token_bytes = model.hidden_size * activation_bytes * 2.0 * (tp - 1) / tp
        self._allreduce_s_per_token = n * token_bytes / (gpu.allreduce_gbps * 1e9)

    @property
    def constants(self) -> PerfConstants:
        return self._c

    def mfu(self, tokens: float) -> float:
        peak = self.gpu.mfu_max if self.gpu.mfu_max is not None else self._c.mfu_max
        return peak * tokens / (tokens + self.gpu.mfu_half_tokens)

    def fixed_step_s(self, seqs: int) -> float:
        c = self._c
        return c.step_base_s + c.step_per_seq_s * seqs

    def tp_comm_s(self, tokens: int) -> float:
        """Seconds of tensor-parallel all-reduce in a step of `tokens` tokens (0.0 at tp = 1)."""
        return self._allreduce_s + tokens * self._allreduce_s_per_token

    def step_time_totals(
        self, prefill_tokens: int, prefill_pairs: float, num_decodes: int, decode_ctx_sum: int, seqs: int
    ) -> float:
        """Seconds for one step from aggregates (O(1); the engine keeps these sums incrementally).

        prefill_pairs = Σ p·(c + p/2) over prefill chunks (p new tokens after c cached ones);
        decode_ctx_sum = Σ context length over decoding sequences; seqs = sequences in the step.
        """
        tokens = prefill_tokens + num_decodes
        if tokens <= 0:
            return 0.0
        t_mem = (self._weight_read + decode_ctx_sum * self._kv_bytes) / self._bw
        flops = self._linear_flops * tokens + self._attn_flops_per_pair * (prefill_pairs + decode_ctx_sum)
        t_compute = flops / (self._flops * self.mfu(tokens))
        t_tp = self._allreduce_s + tokens * self._allreduce_s_per_token  # tp_comm_s(tokens), inlined (hot)
        return self.fixed_step_s(seqs) + t_tp + max(t_mem, t_compute)

    def step_time(self, prefill_chunks: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """Seconds for one step of `prefill_chunks` [(new_tokens, cached_context)] and decodes of `decode_contexts`."""
        p_tokens = sum(p for p, _ in prefill_chunks)
        pairs = sum(p * (c + p / 2.0) for p, c in prefill_chunks)
        return self.step_time_totals(
            p_tokens,
            pairs,
            len(decode_contexts),
            sum(decode_contexts),
            len(prefill_chunks) + len(decode_contexts),
        )

    def prefill_time(self, prompt_lengths: Sequence[int]) -> float:
        """Seconds to prefill whole prompts in one step (no chunking, nothing cached)."""
        return self.step_time([(p, 0) for p in prompt_lengths], [])

    def decode_step_time(self, contexts: Sequence[int]) -> float:
        """Seconds for one decode step of a batch with the given context lengths."""
        return self.step_time([], contexts)

    def prefill_tokens_per_s(self, chunk: int = 2048) -> float:
        """Sustained prefill rate in tokens/s at a typical chunk size: the router's TTFT estimate divisor."""
        return chunk / self.prefill_time([chunk])

    def decode_tokens_per_s(self, batch: int, context: int) -> float:
        """Decode throughput of a full batch of `batch` sequences at `context` tokens each."""
        return batch / self.decode_step_time([context] * batch)

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """Tokens of KV that fit across the TP group after weights and the activation reserve (0 if none)."""
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        per_gpu = self.gpu.memory_bytes * (gpu_memory_utilization - self._c.activation_reserve_frac)
        free = per_gpu * self.tp - self._weight_read
        return max(0, math.floor(free / self._kv_bytes))

    def kv_capacity_blocks(self, gpu_memory_utilization: float = 0.9, block_size: int = 16) -> int:
        """vLLM's `num_gpu_blocks` for this GPU, model and utilisation."""
        return self.kv_capacity_tokens(gpu_memory_utilization) // block_size

    def fits(self, gpu_memory_utilization: float = 0.9) -> bool:
        """Whether the weights fit with room for at least one max-context sequence."""
        return self.kv_capacity_tokens(gpu_memory_utilization) >= self.model.max_context
