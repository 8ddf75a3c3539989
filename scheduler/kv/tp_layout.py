"""Per-rank page tables of a compression pool served with tensor parallelism (pure).

Under TP vLLM shards every layer's KV heads evenly over the ranks, and a rank's page pool holds only its own
heads: a ragged-paging worker groups the heads *of each rank* into page tables (sorted chunking of their
budgets, as at tp 1), and a request fits only if it fits on its most loaded rank. The ledger's footprint
model takes that as `CompressionSpec.rank_groups` (tp · the most loaded rank's head-pages, in pool-wide
head-pages; `scheduler.kv.footprint`).

Which heads a rank holds:

- `contiguous` — stock vLLM: rank r holds heads [r·H/tp, (r+1)·H/tp) of every layer;
- a partition from `mosaic kv-layout --tp N --json` (its `tp.rank_groups`), for a model whose weights were
  permuted as that document's `permutation` says, which balances the ranks' pages (`placement.kv_tp`).

`TpLayout.from_document` reads the latter (the file is opened by the caller: `server.kv_setup`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from placement.kv_tp import contiguous_assignment, rank_cost
from scheduler.kv.footprint import CompressionSpec

RankOf = tuple[tuple[int, ...], ...]  # [layer][head] → rank


@dataclass(frozen=True, slots=True)
class TpLayout:
    """A head → rank assignment made by `mosaic kv-layout --tp`, with the settings it was made for."""

    tp: int
    rank_of: RankOf
    heads_per_group: int
    alpha: float

    @classmethod
    def from_document(cls, doc: Any, layers: int, kv_heads: int) -> TpLayout:
        """Parse a `mosaic kv-layout --json` document with a TP partition for a `layers` × `kv_heads` profile;
        ValueError saying what does not fit."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("tp"), Mapping):
            raise ValueError("not a `mosaic kv-layout --tp N --json` document (no `tp` partition in it)")
        if (doc.get("layers"), doc.get("kv_heads")) != (layers, kv_heads):
            raise ValueError(
                f"made for {doc.get('layers')} layers × {doc.get('kv_heads')} KV heads; the profile has "
                f"{layers} × {kv_heads}"
            )
        part = doc["tp"]
        tp, ranks, hp, alpha = (
            part.get("tp"),
            part.get("rank_groups"),
            doc.get("heads_per_group"),
            doc.get("alpha"),
        )
        if type(tp) is not int or tp < 2 or not isinstance(ranks, list) or len(ranks) != tp:
            raise ValueError("its `tp` partition needs `tp` ≥ 2 and one `rank_groups` entry per rank")
        if type(hp) is not int or hp < 1 or not isinstance(alpha, int | float):
            raise ValueError("it needs `heads_per_group` (≥ 1) and `alpha`")
        rank_of = [[-1] * kv_heads for _ in range(layers)]
        for r, groups in enumerate(ranks):
            for group in groups if isinstance(groups, list) else [None]:
                for member in group if isinstance(group, list) else [None]:
                    ok = isinstance(member, list) and len(member) == 2 and all(type(x) is int for x in member)
                    if not ok or not (0 <= member[0] < layers and 0 <= member[1] < kv_heads):
                        raise ValueError(f"rank {r} names {member!r}, not a [layer, head] of the profile")
                    if rank_of[member[0]][member[1]] != -1:
                        raise ValueError(f"head {member} is on two ranks")
                    rank_of[member[0]][member[1]] = r
        return cls(tp, check_rank_of(rank_of, tp, kv_heads), hp, float(alpha))


def check_rank_of(rank_of: Sequence[Sequence[int]], tp: int, kv_heads: int) -> RankOf:
    """`rank_of` as a tuple, after checking vLLM can shard it: every head on a rank, H/tp of each layer each."""
    if kv_heads % tp:
        raise ValueError(f"tp {tp} must divide the {kv_heads} KV heads per layer")
    for layer, row in enumerate(rank_of):
        counts = [0] * tp
        for head, r in enumerate(row):
            if not 0 <= r < tp:
                raise ValueError(f"head [{layer}, {head}] is on no rank")
            counts[r] += 1
        if any(c != kv_heads // tp for c in counts):
            raise ValueError(
                f"layer {layer} gives its ranks {counts} heads; vLLM shards {kv_heads // tp} to each"
            )
    return tuple(tuple(row) for row in rank_of)


def contiguous_rank_of(layers: int, kv_heads: int, tp: int) -> RankOf:
    """Stock vLLM sharding: rank r holds heads [r·H/tp, (r+1)·H/tp) of every layer."""
    if kv_heads % tp:
        raise ValueError(f"tp {tp} must divide the {kv_heads} KV heads per layer")
    return tuple(tuple(row) for row in contiguous_assignment(layers, kv_heads, tp))


def rank_split_spec(
    budgets: np.ndarray, rank_of: RankOf, heads_per_group: int, **constants: Any
) -> CompressionSpec:
    """The compression spec of a TP pool: each rank's heads grouped by sorted chunking of `budgets` [L, H]
    (group budget = its largest member's), the groups of all ranks in rank order, `rank_groups` their indices
    per rank. `constants`: `CompressionSpec`'s sink, window, prefill_chunk and name."""
    b2 = np.asarray(budgets, dtype=np.float64)
    flat = b2.ravel()
    sizes: list[int] = []
    group_budgets: list[float] = []
    rank_groups: list[tuple[int, ...]] = []
    tp = 1 + max(max(row) for row in rank_of)
    for r in range(tp):
        groups, _ = rank_cost(b2, rank_of, r, heads_per_group)
        first = len(sizes)
        for g in groups:
            sizes.append(len(g))
            group_budgets.append(float(max(flat[f] for f in g)))  # budgets are clipped to [0, 1]
        rank_groups.append(tuple(range(first, len(sizes))))
    return CompressionSpec(tuple(sizes), tuple(group_budgets), rank_groups=tuple(rank_groups), **constants)
