"""Automatic prefix caching, block-granular, as vLLM v1 does it (`--enable-prefix-caching`).

A prompt's full blocks are identified by chained hashes: h_i = hash((h_{i−1}, tokens of block i)), so a
block matches only if everything before it matches too. When a request is admitted, the longest run of
its leading block hashes found in the cache is reused: those tokens count as computed (no prefill work)
and the request takes a reference on each block, at most (num_tokens − 1) // block_size blocks so at
least one token is computed to produce logits. When a prompt block fills during prefill it is
registered in the cache; if the same hash is already there (computed concurrently), the request drops
its private copy and shares the cached one.

Freed cached blocks (reference count 0) stay cached but count as *free* — `kv_cache_usage_perc` is blocks
in use / total, as in vLLM — and are evicted least-recently-freed first when an allocation needs the room.

A LoRA adapter's prompts hash apart from the base model's and each other's (`block_hashes(lora=)`), as
vLLM keys cached blocks by adapter. Only prompt blocks are cached (vLLM also hashes full blocks of generated tokens; a multi-turn client that
resends an answer as the next prompt would hit them there and not here). Counters: `queries` = prompt
tokens looked up, `hits` = tokens found, as `vllm:prefix_cache_{queries,hits}_total`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from scheduler.routing.prefix import adapter_seed
from simulator.kv_blocks import KvAccounting


def block_hashes(token_ids: Sequence[int], block_size: int, lora: str | None = None) -> tuple[int, ...]:
    """Chained hashes of the full blocks of `token_ids` (a partial last block has none). A LoRA adapter's
    request (`lora`) chains from its own start, as vLLM puts the adapter in every block's hash: the same
    prompt under two adapters, or under an adapter and the base model, shares no cached block."""
    out, prev = [], adapter_seed(lora)  # 0 for none; a stable int per name (str hashes are salted)
    ids = tuple(token_ids)
    for start in range(0, len(ids) - block_size + 1, block_size):
        prev = hash((prev, ids[start : start + block_size]))  # ints and tuples hash deterministically
        out.append(prev)
    return tuple(out)


class PrefixCache:
    """Reference counts of cached blocks plus an LRU of the unreferenced ones, over a `KvAccounting` pool."""

    __slots__ = ("evictable", "kv", "refs")

    def __init__(self, kv: KvAccounting) -> None:
        self.kv = kv
        self.refs: dict[int, int] = {}  # hash → references by live requests (0 → in `evictable`)
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks of `hashes` are cached (≤ max_blocks)."""
        k, refs = 0, self.refs
        for h in hashes[:max_blocks]:
            if h not in refs:
                break
            k += 1
        return k

    def pool_cost(self, hashes: Sequence[int]) -> int:
        """Free blocks that referencing `hashes` takes from the pool (the unreferenced ones leave the LRU)."""
        ev = self.evictable
        return sum(1 for h in hashes if h in ev)

    def acquire(self, hashes: Sequence[int]) -> None:
        """Take one reference on each (cached) block; unreferenced ones return to use."""
        refs, ev = self.refs, self.evictable
        for h in hashes:
            if refs[h] == 0:
                del ev[h]
                self.kv.allocate(1)
            refs[h] += 1

    def register(self, h: int) -> None:
        """A request's private block just filled with hash `h`: cache it, or share the copy already cached."""
        refs = self.refs
        if h not in refs:
            refs[h] = 1  # the private block becomes the cached one: the pool count does not change
            return
        self.kv.release(1)  # drop the duplicate, then reference the cached copy
        self.acquire((h,))

    def release(self, hashes: Sequence[int]) -> None:
        """Drop one reference on each block; blocks nobody references become free (still cached, evictable)."""
        refs, ev = self.refs, self.evictable
        for h in hashes:
            refs[h] -= 1
            if refs[h] == 0:
                ev[h] = None
                self.kv.release(1)

    def make_room(self, n: int) -> None:
        """Evict least-recently-freed cached blocks until `n` blocks are free without them."""
        ev, refs = self.evictable, self.refs
        short = n - (self.kv.free - len(ev))
        while short > 0 and ev:
            h, _ = ev.popitem(last=False)
            del refs[h]
            short -= 1
