"""Compression workers for the engine model: per-head KV retention and ragged page accounting.

A compression worker (Tangram-style ragged paging) keeps, per request, only part of each head's prompt KV.
Each request draws one calibration sample s of the worker's profile (seeded by the request id) and gets the
per-head retention r_{s,h} of that sample (without samples: N(μ_h, σ_h) clipped to [0, 1]). Heads are laid
out in page-table groups (sorted chunking of μ + α·σ, `placement.kv_layout`); a group's table is as long as
its longest head, so group g keeps

    ratio_g = max_{h∈g} r_{s,h}                 (dynamic worker: retention as the compressor decides)
    ratio_g = min(max_{h∈g} r_{s,h}, B_g)        (static-budget worker: never keeps more than the budget)
    K_g(T)  = min(T, sink + window + ceil(ratio_g · (T − sink)))

Page accounting, in head-pages (one head × block_size tokens; the pool is num_gpu_blocks · n_heads):

    prefilling, T tokens computed:  Σ_g n_g · ceil(min(T, K_g(T) + C) / bs)    kept so far + one raw chunk C
    decoding,  T = P + d tokens:    Σ_g n_g · ceil((K_g(P) + d) / bs)          generated tokens all kept

`RaggedKvAccounting` implements the engine's `KvAccounting` contract for both phases; `CompressionEngine`
tells it when a sequence switches phase (prefill done → compress down to K_g(P); preempted → back to
prefill) by overriding the engine's transition methods — the one hook the engine lacks (see docs/kv.md).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import numpy as np

from placement.kv_layout import HeadGroups, sorted_groups
from placement.kv_profile import HeadProfile, kept_tokens
from placement.perf_model import PerfModel
from scheduler.kv.footprint import CompressionSpec
from simulator.engine import Engine, EngineConfig, _Seq
from simulator.kv_blocks import KvAccounting, generic_next_growth
from simulator.requests import EngineRequest, RequestRecord


@dataclass(frozen=True)
class CompressionModel:
    """A compression worker's profile, head layout and compressor constants."""

    profile: HeadProfile
    groups: HeadGroups
    prefill_chunk: int = 4096
    static_budget: bool = True

    @classmethod
    def build(
        cls,
        profile: HeadProfile,
        heads_per_group: int = 4,
        alpha: float = 2.0,
        prefill_chunk: int = 4096,
        static_budget: bool = True,
    ) -> CompressionModel:
        return cls(profile, sorted_groups(profile, heads_per_group, alpha), prefill_chunk, static_budget)

    @property
    def num_heads(self) -> int:
        return self.profile.num_heads_total

    def spec(self) -> CompressionSpec:
        """The ledger's view of this worker (policy B3: per-group μ + α·σ budgets)."""
        p = self.profile
        return CompressionSpec(
            self.groups.sizes, self.groups.budgets, p.sink, p.window, self.prefill_chunk, name=p.name
        )


class _Draw:
    """One request's retention: per-group kept prompt tokens and the bookkeeping of its phase."""

    __slots__ = ("decoding", "head_ratios", "kept_p", "prompt", "ratios")

    def __init__(self, ratios: list[float], head_ratios: np.ndarray, prompt: int) -> None:
        self.ratios = ratios
        self.head_ratios = head_ratios
        self.prompt = prompt
        self.kept_p: list[int] = []
        self.decoding = False


class RaggedKvAccounting(KvAccounting):
    """Head-page pool of a compression worker (see the module docstring for the formulas)."""

    __slots__ = ("_draws", "_members", "_sizes", "gpu_blocks", "model", "seed")

    def __init__(self, num_gpu_blocks: int, block_size: int, model: CompressionModel, seed: int = 0) -> None:
        self.model = model  # before the base's init: units_per_block (its null block's head-pages) reads it
        super().__init__(num_gpu_blocks * model.num_heads, block_size)
        self.gpu_blocks = num_gpu_blocks
        self.seed = seed
        self._sizes = list(model.groups.sizes)
        self._members = [list(m) for m in model.groups.members]
        self._draws: dict[str, _Draw] = {}

    @property
    def units_per_block(self) -> int:
        return self.model.num_heads

    # ---- retention of one request ----
    def draw(self, req: EngineRequest) -> _Draw:
        d = self._draws.get(req.request_id)
        if d is None:
            d = self._draws[req.request_id] = self._new_draw(req)
        return d

    def _new_draw(self, req: EngineRequest) -> _Draw:
        p = self.model.profile
        rng = random.Random((self.seed << 32) ^ zlib.crc32(req.request_id.encode()))
        if p.samples is not None:
            heads = p.samples[rng.randrange(p.samples.shape[0])].ravel()
        else:
            noise = np.array([rng.gauss(0.0, 1.0) for _ in range(p.num_heads_total)])
            heads = np.clip(p.mu.ravel() + p.sigma.ravel() * noise, 0.0, 1.0)
        ratios = []
        for g, members in enumerate(self._members):
            r = float(max(heads[h] for h in members))
            ratios.append(min(r, self.model.groups.budgets[g]) if self.model.static_budget else r)
        d = _Draw(ratios, heads, req.num_prompt_tokens)
        sink, window = p.sink, p.window
        d.kept_p = [kept_tokens(r, d.prompt, sink, window) for r in ratios]
        return d

    # ---- KvAccounting contract ----
    def blocks_for(self, req: EngineRequest, tokens: int) -> int:
        d = self.draw(req)
        bs = self.block_size
        total = 0
        if d.decoding:
            extra = tokens - d.prompt
            for n, k in zip(self._sizes, d.kept_p, strict=True):
                total += n * (-(-(k + extra) // bs))
            return total
        p, c = self.model.profile, self.model.prefill_chunk
        for n, r in zip(self._sizes, d.ratios, strict=True):
            held = min(tokens, kept_tokens(r, tokens, p.sink, p.window) + c)
            total += n * (-(-held // bs))
        return total

    def next_growth(self, req: EngineRequest, tokens: int) -> int:
        d = self.draw(req)
        if not d.decoding:
            return generic_next_growth(self, req, tokens, tokens + 1_000_000)
        bs = self.block_size
        extra = tokens - d.prompt
        # group g opens a page when its token count K_g + (t − P) is a multiple of bs
        return tokens + min((-(k + extra)) % bs for k in d.kept_p)

    def capacity_tokens(self, req: EngineRequest | None = None) -> int:
        """Uncompressed tokens the pool holds (a sequence during prefill may need its raw chunk)."""
        return (self.gpu_blocks - 1) * self.block_size

    # ---- phase changes (CompressionEngine) and measurements ----
    def enter_decode(self, req: EngineRequest) -> None:
        self.draw(req).decoding = True

    def leave_decode(self, req: EngineRequest) -> None:
        self.draw(req).decoding = False

    def forget(self, request_id: str) -> None:
        self._draws.pop(request_id, None)

    def peak_units(self, req: EngineRequest, output_tokens: int) -> int:
        """Head-pages the request holds at its worst moment: end of prefill or end of decode (policy B4)."""
        d = self.draw(req)
        was = d.decoding
        try:
            d.decoding = False
            prefill = self.blocks_for(req, d.prompt)
            d.decoding = True
            final = self.blocks_for(req, d.prompt + output_tokens)
        finally:
            d.decoding = was
        return max(prefill, final)

    def ideal_slots(self, req: EngineRequest, output_tokens: int) -> int:
        """Head-token slots with no group padding and no page rounding: Σ_h kept_h(P) + n_heads · output."""
        d = self.draw(req)
        p = self.model.profile
        kept = sum(kept_tokens(float(r), d.prompt, p.sink, p.window) for r in d.head_ratios)
        return kept + self.model.num_heads * output_tokens


class CompressionEngine(Engine):
    """The engine model with a `RaggedKvAccounting` pool; compresses a sequence's KV when its prefill ends."""

    def __init__(self, perf: PerfModel, config: EngineConfig, model: CompressionModel, seed: int = 0) -> None:
        blocks = config.num_gpu_blocks or perf.kv_capacity_blocks(
            config.gpu_memory_utilization, config.block_size
        )
        self.ragged = RaggedKvAccounting(blocks, config.block_size, model, seed)
        super().__init__(perf, config, seed, self.ragged)

    def _prefill_done(
        self,
        s: _Seq,
        g: int,
        end: float,
        prefilled: list[str],
        firsts: list[str],
        finished: list[RequestRecord],
    ) -> None:
        kv = self.ragged
        kv.enter_decode(s.req)
        new = kv.blocks_for(s.req, s.computed)
        if new < s.blocks:  # the compressor evicts: the raw chunk's pages go back to the pool
            kv.release(s.blocks - new)
            s.blocks = new
        elif new > s.blocks and kv.can_allocate(new - s.blocks):  # recompute past the prompt (rare)
            kv.allocate(new - s.blocks)
            s.blocks = new
        super()._prefill_done(s, g, end, prefilled, firsts, finished)

    def _preempt(self, s: _Seq, g: int) -> None:
        super()._preempt(s, g)
        self.ragged.leave_decode(s.req)

    def _end(self, s: _Seq, end: float, finished: list[RequestRecord]) -> None:
        super()._end(s, end, finished)
        self.ragged.forget(s.id)

    def abort(self, request_id: str, now: float) -> RequestRecord | None:
        rec = super().abort(request_id, now)
        self.ragged.forget(request_id)
        return rec
