"""`kv:` section of the gateway config (pydantic v2, unknown keys refused) and the ledger it builds.

```yaml
kv:
  enabled: true            # false → no reservation: workers admit greedily and may preempt (vLLM default)
  mode: worst_case         # worst_case: reserve max_tokens (never preempts) | predicted: a quantile, grown as it streams
  watermark: 0.02          # fraction of each worker's KV kept unreserved; must be > 0: it also covers vLLM's null
                           # block (floor(num_gpu_blocks · (1 − w)) ≤ num_gpu_blocks − 1, the blocks vLLM can use)
  share: null              # this gateway's share of every worker; null → 1 / gateway.replicas
  lease_s: 900             # a reservation not renewed for this long is released (lease_expired); must exceed
                           # the longest a request may hold pages unrenewed (server.config checks the limits)
  alpha: 2.0               # per-head budget μ + α·σ for compression pools
  reconcile_tolerance: 0.02  # reported usage may exceed what reservations explain by this fraction before shrinking
  data_parallel: per_engine  # a data-parallel vLLM's engines are booked apart and each request pinned to one
                             # (X-data-parallel-rank) | pooled: one sum, vLLM's balancer picks the engine
  predictor: {quantile: 0.9, window: 512, min_samples: 20}
  overbook: {max_frac: 0.1, preemption_budget: 0}   # predicted mode only
  compression:             # pools (or models) whose workers compress KV per head (ragged paging)
    - pool: decode-h100
      profile: profiles/llama-3.1-8b/profile.npz   # Tangram .npz, or JSON/CSV (placement/kv_profile.py)
      heads_per_group: 4
      prefill_chunk: 8192
      tp_layout: contiguous  # pools with tp > 1: which heads each rank holds (stock vLLM sharding), or the
                             # `mosaic kv-layout --tp N --json` file the weights were permuted by
  batch_admission: {enabled: false, solver: cp-sat, time_limit_ms: 50, max_head: 32, aging_s: 10}
  queue: {backfill: 32, aging_s: 2}   # admission queue: backfill window, aging hold after this wait
```
`build_ledger(cfg, gateway_replicas, profiles, pools, layouts)` returns a pure `KvLedger` (`None` when
`enabled: false`) from the parsed compression profiles and TP layouts; reading them is the caller's job
(`server.kv_setup`, which resolves relative paths against the config file's folder with `profile_paths`), so
this floor does no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from placement.kv_layout import sorted_groups
from placement.kv_profile import HeadProfile
from scheduler.config_numbers import NoBoolNumbers
from scheduler.kv.batch_admission import AdmissionParams
from scheduler.kv.footprint import CompressionSpec
from scheduler.kv.ledger import KvLedger, LedgerSettings, SpecTable
from scheduler.kv.tp_layout import TpLayout, contiguous_rank_of, rank_split_spec
from scheduler.length_predictor import DEFAULT_INPUT_EDGES, LengthPredictor


class _Strict(NoBoolNumbers):
    # inf/NaN refused in every float (a time limit, lease or aging of `inf` is accepted by `gt=0` otherwise)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PredictorConfig(_Strict):
    quantile: float = Field(default=0.9, gt=0, le=1)
    window: int = Field(default=512, ge=1)
    min_samples: int = Field(default=20, ge=1)
    input_edges: list[int] = Field(default_factory=lambda: list(DEFAULT_INPUT_EDGES))


class OverbookConfig(_Strict):
    max_frac: float = Field(default=0.1, ge=0, le=1)  # worst-case reservations may exceed capacity by this
    preemption_budget: float = Field(default=0.0, ge=0)  # preemptions per reconcile tolerated before halving


class CompressionPoolConfig(_Strict):
    pool: str | None = None
    model: str | None = None
    profile: str
    heads_per_group: int = Field(default=4, ge=1)
    alpha: float | None = Field(default=None, ge=0)  # None → kv.alpha
    prefill_chunk: int = Field(default=8192, ge=1)
    # pools with tp > 1: "contiguous" (stock vLLM sharding) or a `mosaic kv-layout --tp N --json` file
    tp_layout: str = Field(default="contiguous", min_length=1)

    @model_validator(mode="after")
    def _one_target(self) -> CompressionPoolConfig:
        if (self.pool is None) == (self.model is None):
            raise ValueError("give exactly one of pool or model")
        return self


class BatchAdmissionConfig(_Strict):
    """`scheduler.kv.batch_admission.plan_admission` settings for the gateway's admission queue tick.

    CP-SAT is kept where it beat greedy in the bench: given 20–50 ms per tick it finds plans within ~1% of
    the best (greedy: ~7% below); at 5 ms it barely helps (docs/kv.md). Greedy stays the fallback.
    """

    enabled: bool = False
    solver: Literal["greedy", "cp-sat"] = "cp-sat"
    time_limit_ms: float = Field(default=50.0, gt=0)
    max_head: int = Field(default=32, ge=1)
    aging_s: float = Field(default=10.0, gt=0)


class QueueConfig(_Strict):
    """How the gateway's admission queue uses the ledger (`server.kv_admission`), when `kv.enabled`.

    `backfill`: waiters behind the head that may be admitted past it when they fit (0 = strict FIFO, which
    never starves a large request but leaves the KV it cannot use idle behind it). `aging_s`: a waiter
    queued this long gets a ledger hold (`KvLedger.hold`) on its best worker — the one it is closest to
    fitting on — so later small requests stop taking the pages it waits for; null = no aging. It must be
    below `limits.queue_deadline_s` (10 s by default) to act before the 429.
    """

    backfill: int = Field(default=32, ge=0)
    aging_s: float | None = Field(default=2.0, gt=0)


class KvConfig(_Strict):
    """KV budget reservation settings (docs/kv.md)."""

    enabled: bool = True
    mode: Literal["worst_case", "predicted"] = "worst_case"
    # > 0, checked by `_watermark_covers_the_null_block` alone, with why (a `ge=0` here answered -0.1 with
    # "should be greater than or equal to 0", and then the validator refused 0 itself)
    watermark: float = Field(default=0.02, lt=1)
    share: float | None = Field(default=None, gt=0, le=1)
    lease_s: float = Field(default=900.0, gt=0)
    alpha: float = Field(default=2.0, ge=0)
    reconcile_tolerance: float = Field(default=0.02, ge=0, le=1)
    data_parallel: Literal["per_engine", "pooled"] = "per_engine"
    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    overbook: OverbookConfig = Field(default_factory=OverbookConfig)
    compression: list[CompressionPoolConfig] = Field(default_factory=list)
    batch_admission: BatchAdmissionConfig = Field(default_factory=BatchAdmissionConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)

    @field_validator("watermark")
    @classmethod
    def _watermark_covers_the_null_block(cls, w: float) -> float:
        # vLLM keeps one block of num_gpu_blocks as its null block; with w = 0 and the shares summing to 1
        # the gateways would reserve it too. Any w > 0 keeps floor(total · (1 − w)) ≤ total − 1.
        if w <= 0:
            raise ValueError(
                "must be > 0 (e.g. 0.01): it also keeps vLLM's null block (one per worker) out of reservations"
            )
        return w


class KvConfigError(ValueError):
    """A `kv:` setting that cannot be used (e.g. an unreadable profile); the message names the field."""


def build_predictor(cfg: KvConfig) -> LengthPredictor:
    p = cfg.predictor
    try:
        return LengthPredictor(p.quantile, p.window, p.min_samples, p.input_edges)
    except ValueError as exc:
        raise KvConfigError(f"kv.predictor: {exc}") from None


def profile_paths(cfg: KvConfig, base_dir: str | Path | None = None) -> list[Path]:
    """Where each `kv.compression[i].profile` lives: relative paths are taken from `base_dir` (the config
    file's folder when the gateway loaded one), absolute ones as they are. Pure: nothing is opened."""
    out = []
    for c in cfg.compression:
        path = Path(c.profile)
        out.append(Path(base_dir) / path if base_dir is not None and not path.is_absolute() else path)
    return out


def build_compression(
    cfg: KvConfig,
    profiles: Sequence[HeadProfile],
    pools: Mapping[str, tuple[str, int]] | None = None,
    layouts: Sequence[TpLayout | None] = (),
) -> tuple[dict[str, CompressionSpec], dict[str, CompressionSpec]]:
    """(by pool, by model) compression specs from `kv.compression`, given each entry's parsed profile and TP
    layout (in order, None for `contiguous`; the caller reads the files, e.g. `server.kv_setup`). `pools`:
    name → (model, tp) of the configured pools; a pool with tp > 1 gets the per-rank spec
    (`scheduler.kv.tp_layout`), registered by pool (a model's entry too), an explicit pool entry first."""
    if len(profiles) != len(cfg.compression):
        raise KvConfigError(
            f"kv.compression: {len(cfg.compression)} entries but {len(profiles)} parsed profiles; read them "
            "with server.kv_setup.load_profiles (or build with server.kv_setup.build_gateway_ledger)"
        )
    pools = pools or {}
    layouts = list(layouts) or [None] * len(profiles)
    by_pool: dict[str, CompressionSpec] = {}
    by_model: dict[str, CompressionSpec] = {}
    split_by_model: dict[str, CompressionSpec] = {}  # a model entry's spec for its tp > 1 pools
    for i, (c, profile, layout) in enumerate(zip(cfg.compression, profiles, layouts, strict=True)):
        alpha = cfg.alpha if c.alpha is None else c.alpha
        constants = {"sink": profile.sink, "window": profile.window, "prefill_chunk": c.prefill_chunk}
        groups = sorted_groups(profile, c.heads_per_group, alpha)
        spec = CompressionSpec(groups.sizes, groups.budgets, name=profile.name, **constants)  # type: ignore[arg-type]
        targets = [c.pool] if c.pool is not None else [p for p, (m, _) in pools.items() if m == c.model]
        split = {p: pools[p][1] for p in targets if pools.get(p, ("", 1))[1] > 1}
        where = f"kv.compression.{i}.tp_layout"
        if layout is not None:
            if not split:
                raise KvConfigError(
                    f"{where}: a TP layout for pools of tp 1 ({', '.join(targets) or 'none'})"
                )
            if (layout.heads_per_group, layout.alpha) != (c.heads_per_group, alpha):
                raise KvConfigError(
                    f"{where}: made with --heads-per-group {layout.heads_per_group} --alpha {layout.alpha:g}; "
                    f"this entry has heads_per_group {c.heads_per_group}, alpha {alpha:g}"
                )
        for pool, tp in split.items():
            try:
                if layout is None:
                    rank_of = contiguous_rank_of(profile.layers, profile.kv_heads, tp)
                elif layout.tp != tp:
                    raise ValueError(f"partitions over {layout.tp} ranks; pool {pool!r} has tp {tp}")
                else:
                    rank_of = layout.rank_of
            except ValueError as exc:
                raise KvConfigError(f"{where}: {exc}") from None
            tp_spec = rank_split_spec(
                profile.budgets(alpha), rank_of, c.heads_per_group, name=profile.name, **constants
            )
            (by_pool if c.pool is not None else split_by_model)[pool] = tp_spec
        if c.pool is not None and c.pool not in split:
            by_pool[c.pool] = spec
        elif c.model is not None:
            by_model[c.model] = spec
    return {**split_by_model, **by_pool}, by_model


def build_ledger(
    cfg: KvConfig,
    gateway_replicas: int = 1,
    profiles: Sequence[HeadProfile] = (),
    pools: Mapping[str, tuple[str, int]] | None = None,
    layouts: Sequence[TpLayout | None] = (),
) -> KvLedger | None:
    """The gateway's ledger for `cfg` (None when reservation is disabled). Share = cfg.share or 1/replicas.
    `profiles`: the parsed profile of each `kv.compression` entry, in order (required when there are any);
    `pools` and `layouts`: as `build_compression`."""
    if not cfg.enabled:
        return None
    by_pool, by_model = build_compression(cfg, profiles, pools, layouts)
    settings = LedgerSettings(
        mode=cfg.mode,
        watermark=cfg.watermark,
        share=cfg.share if cfg.share is not None else 1.0 / max(1, gateway_replicas),
        lease_s=cfg.lease_s,
        max_overbook_frac=cfg.overbook.max_frac,
        preemption_budget=cfg.overbook.preemption_budget,
        reconcile_tolerance=cfg.reconcile_tolerance,
        per_engine=cfg.data_parallel == "per_engine",
    )
    return KvLedger(settings, SpecTable(by_pool=by_pool, by_model=by_model), build_predictor(cfg))


def admission_params(cfg: KvConfig) -> AdmissionParams:
    """`plan_admission` parameters from `kv.batch_admission` (use_cp_sat = solver == "cp-sat")."""
    b = cfg.batch_admission
    return AdmissionParams(aging_s=b.aging_s, time_limit_ms=b.time_limit_ms, max_head=b.max_head)
