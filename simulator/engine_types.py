"""The engine model's value types: its configuration (vLLM's knobs), counters, per-step result, and the
read-only view of one request. Re-exported by `simulator.engine`, which is where callers import them from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from simulator.requests import RequestRecord

LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def vllm_env_flag(environ: Mapping[str, str], name: str) -> bool:
    """A vLLM boolean env var as vLLM 0.32 reads it (`envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN`,
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): "1" or "true" (any case, spaces stripped) turn it on; unset or anything
    else ("yes", "on", "True1") leave it off."""
    return environ.get(name, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """vLLM's engine knobs (same names as its CLI flags), plus the simulated model's output-length law."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None  # None → perf model capacity (vLLM: --num-gpu-blocks-override)
    max_model_len: int | None = None  # None → min(model.max_context, KV capacity in tokens)
    enable_prefix_caching: bool = False  # vLLM's automatic prefix caching (simulator/prefix_cache.py)
    max_loras: int = 1  # LoRA adapters one step may run (vLLM's --max-loras and its default)
    # vLLM's env VLLM_ALLOW_LONG_MAX_MODEL_LEN: a max_model_len past the model's context is refused without it
    allow_long_max_model_len: bool = False
    natural_output_mean: float = 204.0  # mean EOS position of the simulated model (ShareGPT-like)
    natural_output_shape: float = 2.0  # gamma shape k of the EOS position: cv = 1/√k (ShareGPT: 0.71)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be ≥ 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM's SchedulerConfig refuses this too: every running decode must fit one step's budget.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be ≥ max_num_seqs ({self.max_num_seqs})"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:  # one is vLLM's null block
            raise ValueError(
                f"num_gpu_blocks must be ≥ 2 (one is vLLM's null block), got {self.num_gpu_blocks}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be ≥ 2, got {self.max_model_len}")
        if isinstance(self.max_loras, bool) or not (isinstance(self.max_loras, int) and self.max_loras >= 1):
            raise ValueError(f"max_loras must be an integer ≥ 1, got {self.max_loras!r}")  # vLLM: Field(ge=1)
        if self.natural_output_mean < 1 or self.natural_output_shape < 0:
            raise ValueError("natural_output_mean must be ≥ 1 and natural_output_shape ≥ 0")


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters, the sources of vLLM's `_total` metrics."""

    prompt_tokens: int = 0  # counted once per request, when its first token is emitted
    generation_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # KV tokens thrown away by preemption (recomputed later)
    steps: int = 0
    busy_s: float = 0.0  # simulated seconds spent in steps
    success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class StepResult(NamedTuple):
    """What one engine step did. Every id in `decoded` or `prefilled` emitted exactly one token at `end`.

    A NamedTuple rather than a dataclass: one is built per step, and tuple construction is the cheapest.
    """

    start: float
    duration_s: float
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    decoded: tuple[str, ...] = ()  # decoding sequences (in decode-join order); includes those finishing
    # prefill or recompute completed → one token (a pooling request's: none, it finished; `num_pooled`)
    prefilled: tuple[str, ...] = ()
    first_tokens: tuple[str, ...] = ()  # subset of `prefilled`: the request's very first token
    finished: tuple[RequestRecord, ...] = ()
    preempted: tuple[str, ...] = ()
    kv_received: tuple[str, ...] = ()  # P/D decode side: remote KV transfers that landed before this step
    # prompt tokens computed for the requests in `first_tokens` (less their prefix-cache or remote-KV part),
    # all counted at the step that emits the first token, as vLLM's prefill stats are
    prompt_computed: int = 0
    # pooling requests among `prefilled`: their prefill completed and finished them without emitting a token
    num_pooled: int = 0

    @property
    def end(self) -> float:
        return self.start + self.duration_s

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes

    @property
    def idle(self) -> bool:
        return self.num_prefill_tokens + self.num_decodes == 0


@dataclass(frozen=True, slots=True)
class SeqView:
    """A read-only view of one request inside the engine (`Engine.inspect`)."""

    request_id: str
    state: str  # waiting | transferring | prefill | decoding | held
    prompt_tokens: int
    computed_tokens: int  # tokens whose KV is computed
    output_tokens: int  # tokens emitted so far
    blocks: int  # KV blocks held
    stop_at: int  # output length at which it finishes
    preemptions: int
