"""Paged KV-cache accounting for the engine model: how many blocks a sequence needs, and the pool they come from.

vLLM stores KV in blocks of `block_size` tokens (16 by default); a sequence whose KV holds T tokens uses
ceil(T / block_size) blocks. The engine asks this class only two per-sequence questions, so a subclass can
model another layout (the KV engineer's ragged paging: heads grouped into G page tables, a request of T
tokens needing Σ_g n_g · ceil(r_g · T / block_size) head-pages) without touching the scheduler:

    blocks_for(req, tokens)   blocks a sequence of `req` holds when its KV has `tokens` tokens
    next_growth(req, tokens)  the smallest t ≥ tokens with blocks_for(req, t + 1) > blocks_for(req, t):
                              the context length at which the next decode step needs more blocks

`next_growth` lets the engine keep decode steps O(1): it files each decoding sequence under the step at
which it next grows instead of checking every sequence every step. Contract: blocks_for is non-decreasing
in tokens, and next_growth agrees with it (the default implementation derives it by search).

The pool itself is plain counting: `allocate(n)` / `release(n)`, `used`, `free`, `usage` = used / usable
(what vLLM exports as `vllm:kv_cache_usage_perc`). Which physical blocks a sequence holds is not modelled.
As in vLLM, one block of `num_blocks` is the null block (vLLM's BlockPool keeps it for padding and never
hands it out): `usable` = num_blocks − 1 blocks hold KV, usage is over those, and the reported
`num_gpu_blocks` stays num_blocks. With all num_blocks usable a worker preempted one block later than vLLM
(8 blocks: vLLM's usage 3/7 where the model said 3/8).
"""

from __future__ import annotations

from simulator.requests import EngineRequest


class KvAccounting:
    """A pool of `num_blocks` KV blocks of `block_size` tokens, one of them vLLM's null block; uniform
    paging (stock vLLM). Subclasses count in smaller units (`units_per_block` of them per block)."""

    __slots__ = ("block_size", "num_blocks", "usable", "used")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.usable = num_blocks - self.units_per_block  # less the null block
        if self.usable < 1:
            raise ValueError(
                f"num_blocks must be ≥ 2 (one is vLLM's null block), got {num_blocks // self.units_per_block}"
            )
        self.used = 0

    @property
    def units_per_block(self) -> int:
        return 1

    # ---- per-sequence footprint (override for other layouts) ----
    def blocks_for(self, req: EngineRequest, tokens: int) -> int:
        """ceil(tokens / block_size)."""
        return -(-tokens // self.block_size)

    def next_growth(self, req: EngineRequest, tokens: int) -> int:
        """Smallest multiple of block_size ≥ tokens: a decode at that context length opens a new block."""
        bs = self.block_size
        return -(-tokens // bs) * bs

    def capacity_tokens(self, req: EngineRequest | None = None) -> int:
        """Largest context one sequence can hold when it has the whole pool (bounds max_model_len)."""
        return self.usable * self.block_size

    # ---- the pool ----
    @property
    def free(self) -> int:
        return self.usable - self.used

    @property
    def usage(self) -> float:
        """Blocks in use / usable blocks: vLLM's kv_cache_usage_perc (0–1; BlockPool.get_usage)."""
        return self.used / self.usable

    def can_allocate(self, n: int) -> bool:
        return n <= self.usable - self.used

    def allocate(self, n: int) -> None:
        if n < 0 or n > self.usable - self.used:
            raise RuntimeError(f"cannot allocate {n} blocks: {self.usable - self.used} free")
        self.used += n

    def release(self, n: int) -> None:
        if n < 0 or n > self.used:
            raise RuntimeError(f"cannot release {n} blocks: {self.used} in use")
        self.used -= n


def generic_next_growth(kv: KvAccounting, req: EngineRequest, tokens: int, limit: int) -> int:
    """next_growth by search for subclasses whose blocks_for has no closed form (exponential then binary)."""
    base = kv.blocks_for(req, tokens)
    if kv.blocks_for(req, tokens + 1) > base:
        return tokens
    lo, step = tokens, 1
    hi = tokens + 1
    while hi < limit and kv.blocks_for(req, hi + 1) <= base:
        lo = hi
        step *= 2
        hi = tokens + step
    hi = min(hi, limit)
    # invariant: blocks_for(lo + 1) == base; find the smallest t in (lo, hi] with blocks_for(t + 1) > base
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if kv.blocks_for(req, mid + 1) > base:
            hi = mid
        else:
            lo = mid
    return hi
