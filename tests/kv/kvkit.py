"""Small builders for the KV tests: workers, requests, a compression spec."""

from __future__ import annotations

from scheduler.fleet import Role, WorkerCapacity, WorkerState, WorkerView
from scheduler.kv.footprint import CompressionSpec
from scheduler.routing.framework import RouteRequest


def worker(
    wid: str = "w0",
    blocks: int = 100,
    block_size: int = 16,
    pool: str = "p",
    model: str = "m",
    max_model_len: int | None = None,
    kv_usage: float | None = None,
    scraped_blocks: int | None = None,
    preemptions: float | None = None,
    max_num_seqs: int = 256,
    prefill_tps: float = 10_000.0,
    role: Role = Role.MIXED,
) -> WorkerView:
    cap = WorkerCapacity(
        prefill_tokens_per_s=prefill_tps,
        decode_tokens_per_s=2_000.0,
        kv_blocks=blocks,
        block_size=block_size,
        cost_per_hour=1.0,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    return WorkerView(
        id=wid,
        url=f"http://{wid}",
        pool=pool,
        model=model,
        gpu="A100-80GB",
        role=role,
        state=WorkerState.READY,
        breaker_open=False,
        capacity=cap,
        kv_usage=kv_usage,
        num_gpu_blocks=scraped_blocks,
        preemptions_total=preemptions,
    )


def request(
    rid: str = "r0",
    prompt: int = 100,
    max_out: int = 50,
    predicted: int | None = None,
    model: str = "m",
    priority: int = 0,
    arrival: float = 0.0,
) -> RouteRequest:
    return RouteRequest(
        rid,
        model,
        prompt,
        max_out,
        max_out if predicted is None else predicted,
        priority=priority,
        arrival_s=arrival,
    )


def two_group_spec() -> CompressionSpec:
    """Two groups of 4 heads, budgets 0.5 and 0.1, sink 4, window 8, first chunk 16 (hand-computable)."""
    return CompressionSpec((4, 4), (0.5, 0.1), sink=4, window=8, prefill_chunk=16)


def simulated_l4_pool(model: str = "llama-3-8b") -> dict[str, object]:
    """One simulated L4 worker at gpu_memory_utilization 0.75 (467 blocks of 16 tokens), 50× model time."""
    return {
        "name": "l4",
        "model": model,
        "gpu": "L4",
        "role": "mixed",
        "gpu_memory_utilization": 0.75,
        "endpoints": {"simulated": {"replicas": 1, "time_scale": 50.0}},
    }
