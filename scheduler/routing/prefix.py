"""Prompt-prefix hashing and the bounded per-worker LRU the prefix-affinity scorer reads.

Hashes are **chained** over fixed-size blocks, like vLLM's prefix cache: hᵢ = H(hᵢ₋₁ ‖ blockᵢ), so hᵢ
identifies the whole prefix up to block i and a match of hᵢ implies a match of every earlier block.
H is BLAKE2b truncated to 63 bits: stable across processes (Python's `hash` of str is salted), so
several gateway replicas and the simulator agree.

- `block_hashes(tokens, block_size)`: exact, from token ids (the gateway has them for token-id prompts
  or with a tokenizer); only full blocks are hashed, as vLLM caches only full blocks.
- `text_block_hashes(text, chars_per_block)`: from text when no tokenizer is configured; ~4 characters
  per token, so 64 characters ≈ one 16-token block.
- `seed`: the chain's start. 0 for a base model; a LoRA adapter's requests start from `adapter_seed(name)`,
  as vLLM keys its prefix cache by adapter too (the same prompt under two adapters shares no cached block).

`PrefixIndex` keeps, per worker, the most recently dispatched block hashes (bounded: the oldest fall out
first, as a worker's KV cache evicts). All state changes are explicit (`record`, `unrecord`, `forget`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

_MASK = (1 << 63) - 1


def _chain(prev: int, payload: bytes) -> int:
    digest = hashlib.blake2b(prev.to_bytes(8, "little") + payload, digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def adapter_seed(adapter: str | None) -> int:
    """The hash chain's start for a request naming `adapter` (0: none)."""
    return 0 if adapter is None else _chain(0, b"lora\0" + adapter.encode("utf-8", "surrogatepass"))


def block_hashes(
    tokens: Sequence[int], block_size: int = 16, max_blocks: int | None = None, seed: int = 0
) -> tuple[int, ...]:
    """Chained hashes of each full `block_size`-token block of `tokens` (at most `max_blocks`)."""
    if block_size < 1:
        raise ValueError(f"block_size must be ≥ 1, got {block_size}")
    n = len(tokens) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    if n <= 0:
        return ()  # shorter than one block: nothing to hash
    raw = array("q", tokens[: n * block_size]).tobytes()  # one conversion; 8 bytes per token id
    step = block_size * 8
    out: list[int] = []
    h = seed
    for i in range(n):
        h = _chain(h, raw[i * step : (i + 1) * step])
        out.append(h)
    return tuple(out)


def text_block_hashes(
    text: str, chars_per_block: int = 64, max_blocks: int | None = None, seed: int = 0
) -> tuple[int, ...]:
    """Chained hashes of each full `chars_per_block`-character block of `text` (at most `max_blocks`)."""
    if chars_per_block < 1:
        raise ValueError(f"chars_per_block must be ≥ 1, got {chars_per_block}")
    n = len(text) // chars_per_block
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[int] = []
    h = seed
    for i in range(n):
        h = _chain(h, text[i * chars_per_block : (i + 1) * chars_per_block].encode("utf-8", "surrogatepass"))
        out.append(h)
    return tuple(out)


class PrefixIndex:
    """Per-worker LRU of block hashes, each worker bounded to `capacity` hashes.

    `record(worker, hashes, now)` marks the hashes most recent; `match(worker, hashes, now)` counts how many
    leading hashes the worker holds (entries older than `ttl_s`, if set, count as gone).
    """

    __slots__ = ("_lru", "capacity", "ttl_s")

    def __init__(self, capacity: int, ttl_s: float | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be ≥ 1, got {capacity}")
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._lru: dict[str, OrderedDict[int, float]] = {}

    def record(self, worker_id: str, hashes: Sequence[int], now: float) -> None:
        lru = self._lru.setdefault(worker_id, OrderedDict())
        # tail first, so a prompt's leading blocks are its most recent entries and its tail is evicted first,
        # as vLLM frees a request's blocks: evicting the head first left a chained match of 0 and the dead
        # tail holding the space
        for h in reversed(hashes):
            lru[h] = now
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def fresh(self, worker_id: str, hashes: Sequence[int], now: float) -> list[int]:
        """The hashes of `hashes` the worker does not hold now (absent, or older than `ttl_s`)."""
        lru = self._lru.get(worker_id)
        if not lru:
            return list(hashes)
        ttl = self.ttl_s
        return [h for h in hashes if (seen := lru.get(h)) is None or (ttl is not None and now - seen > ttl)]

    def unrecord(self, worker_id: str, hashes: Sequence[int], at: float) -> None:
        """Take back what `record(worker_id, hashes, at)` added: each hash still stamped `at` (a later record
        of it, by another request, keeps it)."""
        lru = self._lru.get(worker_id)
        if not lru:
            return
        for h in hashes:
            if lru.get(h) == at:
                del lru[h]

    def match(self, worker_id: str, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of `hashes` held by `worker_id` (chained hashes: stop at the first miss)."""
        lru = self._lru.get(worker_id)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            seen = lru.get(h)
            if seen is None or (self.ttl_s is not None and now - seen > self.ttl_s):
                break
            n += 1
        return n

    def size(self, worker_id: str) -> int:
        return len(self._lru.get(worker_id, ()))

    def forget(self, worker_id: str) -> None:
        """Drop a worker's entries (it restarted or left the fleet: its cache is gone)."""
        self._lru.pop(worker_id, None)

    def workers(self) -> int:
        """Workers with entries."""
        return len(self._lru)

    def keep_only(self, worker_ids: Iterable[str]) -> None:
        """Drop the entries of every worker not in `worker_ids` (those that left the fleet)."""
        keep = set(worker_ids)
        for gone in [w for w in self._lru if w not in keep]:
            del self._lru[gone]
