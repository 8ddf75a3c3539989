"""KV footprint of one request on one worker, in the worker's page units (pure arithmetic).

Units. A *stock* vLLM worker counts blocks: one block is `block_size` tokens of every layer and KV head, and
capacity is `num_gpu_blocks`. A *compression* worker (ragged paging) gives every head group g its own page
table; one group page holds `block_size` tokens of the |g| heads of g. The ledger counts such workers in
**head-pages** (one head, `block_size` tokens): capacity = num_gpu_blocks · n_heads (n_heads = layers · KV
heads) and a group page is |g| head-pages, so both kinds compare against the same bytes.

Stock worker (P prompt tokens, O reserved output tokens, M = max_model_len):

    blocks = ceil(min(P + O, M) / block_size)

Compression worker with groups g (|g| heads, budget B_g = max_{h∈g} μ_h + α·σ_h), sink s and window w:

    K_g        = min(P, s + w + ceil(B_g · (P − s)))            prompt tokens group g keeps (P > s + w)
    prefill_g  = min(P, K_g + C)                                 peak while prefilling: kept + one chunk C
    steady_g   = K_g + O                                         after prefill, at the end of decode
    group pages  = Σ_g ceil(steady_g / bs)                       (the issue's formula, in group pages)
    steady       = Σ_g |g| · ceil(steady_g / bs)                 head-pages held after the first token
    peak         = Σ_g |g| · max(ceil(prefill_g / bs), ceil(steady_g / bs))   reserved at admission
    transient    = peak − steady                                 the first-chunk pages freed after prefill

`peak` bounds the worker's usage over the request's whole life (each group's usage rises during a chunk,
drops when the chunk is compressed, then grows by one token per decode step), so reserving `peak` until the
first token and `steady` afterwards never under-reserves while B_g bounds the retention (static budgets).
With tensor parallelism a rank's page pool holds only its own heads: for `rank_groups` the footprint is
tp · max_r (rank r's head-pages), the most loaded rank, in pool-wide head-pages.

Several sequences (`request_need`): a batch of prompts p_1..p_k with `n` completions each decodes k·n
sequences, and vLLM gives each its own blocks and its own context limit. With O output tokens for the whole
request (O = k·n·max_tokens in the worst case) each sequence gets o = ceil(O / (k·n)), and

    footprint = Σ_i n · need(p_i, o)            (peak, steady, group pages and reserved output alike)

each sequence clamped to max_model_len and rounded to blocks on its own. A prompt's blocks are shared by
its n sequences only when the worker caches prefixes; that is not counted on (each sequence reserves its
prompt), so the footprint is an upper bound either way.

Prefill-only sequences (`resident_shape`): a pooling request's sequences (embeddings, score, rerank) each end
at their prefill and free their KV then; vLLM's scheduler runs at most `max_num_seqs` of them at once, so the
request holds at most its largest `max_num_seqs` sequences at a time; and as they are scheduled as blocks
free, a batch larger than the KV runs in turns (the ledger reserves it at most one request's share of the
worker: `scheduler.kv.ledger`), served, not refused.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from placement.kv_profile import kept_tokens


@dataclass(frozen=True, slots=True)
class CompressionSpec:
    """A compression worker's ragged layout: group sizes and budgets, and the compressor's constants."""

    group_sizes: tuple[int, ...]
    group_budgets: tuple[float, ...]  # B_g, retention ratio of the evictable context, in [0, 1]
    sink: int = 32
    window: int = 4096
    prefill_chunk: int = 8192  # tokens prefilled uncompressed before the compressor runs (C)
    rank_groups: tuple[tuple[int, ...], ...] = ()  # TP: group indices per rank; () = one pool
    name: str = ""

    def __post_init__(self) -> None:
        if not self.group_sizes or len(self.group_sizes) != len(self.group_budgets):
            raise ValueError("group_sizes and group_budgets must be non-empty and of equal length")
        if any(s < 1 for s in self.group_sizes) or any(not 0.0 <= b <= 1.0 for b in self.group_budgets):
            raise ValueError("group sizes must be ≥ 1 and budgets in [0, 1]")
        if self.prefill_chunk < 1 or self.sink < 0 or self.window < 0:
            raise ValueError("prefill_chunk must be ≥ 1, sink and window ≥ 0")

    @property
    def num_heads(self) -> int:
        return sum(self.group_sizes)

    @classmethod
    def uniform(cls, num_heads: int, ratio: float, **kw: int | str) -> CompressionSpec:
        """Every head at one ratio (policy B2): a single group of all heads."""
        return cls((num_heads,), (ratio,), **kw)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class WorkerKvSpec:
    """How a worker stores KV: block size, context limit and, for compression workers, the layout."""

    block_size: int = 16
    max_model_len: int | None = None
    compression: CompressionSpec | None = None
    max_num_seqs: int | None = None  # sequences one engine runs at once (`resident_shape`); None: unbounded

    @property
    def units_per_block(self) -> int:
        """Ledger units in one vLLM block: 1 for stock workers, n_heads head-pages for compression workers."""
        return 1 if self.compression is None else self.compression.num_heads


@dataclass(frozen=True, slots=True)
class Footprint:
    """A request's KV need on one worker, in that worker's ledger units (see the module docstring)."""

    peak: int  # units to hold from admission to the first token
    steady: int  # units to hold from the first token to the end
    group_pages: int  # Σ_g ceil(steady_g / bs) (compression) or blocks (stock)
    reserved_output: int  # output tokens the footprint covers (after the context-limit clamp)
    kept_prompt_tokens: tuple[int, ...] = field(default=())  # K_g per group (compression only)

    @property
    def transient(self) -> int:
        return self.peak - self.steady


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def clamp_output(prompt_tokens: int, output_tokens: int, max_model_len: int | None) -> int:
    """Reserved output, cut so prompt + output ≤ max_model_len (vLLM stops there)."""
    out = max(0, output_tokens)
    if max_model_len is not None:
        out = min(out, max(0, max_model_len - prompt_tokens))
    return out


def need(prompt_tokens: int, output_tokens: int, spec: WorkerKvSpec) -> Footprint:
    """Footprint of a request of `prompt_tokens` with `output_tokens` reserved, on a worker stored as `spec`."""
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be ≥ 0, got {prompt_tokens}")
    out = clamp_output(prompt_tokens, output_tokens, spec.max_model_len)
    bs = spec.block_size
    comp = spec.compression
    if comp is None:
        total = prompt_tokens + out
        if spec.max_model_len is not None:
            total = min(total, spec.max_model_len)
        blocks = _ceil_div(total, bs)
        return Footprint(blocks, blocks, blocks, out)
    kept = tuple(kept_tokens(b, prompt_tokens, comp.sink, comp.window) for b in comp.group_budgets)
    steady_g = [_ceil_div(k + out, bs) for k in kept]
    peak_g = [
        max(_ceil_div(min(prompt_tokens, k + comp.prefill_chunk), bs), s)
        for k, s in zip(kept, steady_g, strict=True)
    ]
    sizes = comp.group_sizes
    steady = _pooled(comp, [n * p for n, p in zip(sizes, steady_g, strict=True)])
    peak = _pooled(comp, [n * p for n, p in zip(sizes, peak_g, strict=True)])
    return Footprint(peak, steady, sum(steady_g), out, kept)


SequenceShape = int | tuple[tuple[int, ...], int]
"""A request's prompt side: the prompt tokens of its one sequence, or (each prompt's tokens, n)."""


def resident_shape(shape: SequenceShape, max_num_seqs: int | None) -> SequenceShape:
    """The sequences of a prefill-only request that vLLM holds at once (module docstring): all of them when
    they are at most `max_num_seqs`, else its `max_num_seqs` largest."""
    if isinstance(shape, int) or not max_num_seqs:
        return shape
    prompts, n = shape
    n = max(1, n)
    if len(prompts) * n <= max_num_seqs:
        return shape
    largest = heapq.nlargest(max_num_seqs, (p for p in prompts for _ in range(n)))
    return tuple(largest), 1


def request_need(shape: SequenceShape, output_tokens: int, spec: WorkerKvSpec) -> Footprint:
    """Footprint of a whole request (module docstring, "Several sequences"): `need(shape, output_tokens)`
    for one sequence; for (prompts, n) the sum over its len(prompts)·n sequences, each with
    ceil(output_tokens / sequences) of the request's output tokens."""
    if isinstance(shape, int):
        return need(shape, output_tokens, spec)
    prompts, n = shape
    if not prompts:
        raise ValueError("a request has at least one prompt")
    n = max(1, n)
    per_seq = _ceil_div(max(0, output_tokens), n * len(prompts))
    peak = steady = pages = reserved = 0
    seen: dict[int, Footprint] = {}
    for p in prompts:
        fp = seen.get(p)
        if fp is None:
            fp = seen[p] = need(p, per_seq, spec)
        peak += n * fp.peak
        steady += n * fp.steady
        pages += n * fp.group_pages
        reserved += n * fp.reserved_output
    return Footprint(peak, steady, pages, reserved)


def _pooled(comp: CompressionSpec, head_pages: Sequence[int]) -> int:
    """Σ over groups, or tp · the most loaded rank when groups are split over TP ranks."""
    if not comp.rank_groups:
        return sum(head_pages)
    return len(comp.rank_groups) * max(sum(head_pages[g] for g in rank) for rank in comp.rank_groups)


def oracle_units(group_sizes: Sequence[int], peak_tokens: Sequence[int], block_size: int) -> int:
    """Head-pages of a request whose per-group peak token counts are known (policy B4, the oracle)."""
    return sum(n * _ceil_div(t, block_size) for n, t in zip(group_sizes, peak_tokens, strict=True))
