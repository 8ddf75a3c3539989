"""Build the gateway's KV ledger: read the `kv.compression[].profile` and `.tp_layout` files here (floor 4 does
the I/O) and hand the parsed profiles and TP layouts to the pure `scheduler.kv.config.build_ledger`.

`routing_with_kv` adds the `kv-best-fit` scorer to the `mosaic` policy when the ledger exists.

Relative profile and layout paths are resolved against the folder of the config file the gateway was loaded from
(`MosaicConfig.source_dir`, set by `server.config.load_config`); a config built from data (tests, the
Helm chart's rendered values) resolves them against the working directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from placement.kv_profile import HeadProfile, ProfileError, load_head_profile
from scheduler.kv.config import KvConfig, KvConfigError, build_ledger, profile_paths
from scheduler.kv.ledger import KvLedger
from scheduler.kv.tp_layout import TpLayout
from scheduler.routing.config import PluginSpec, RoutingConfig


def load_profiles(cfg: KvConfig, base_dir: str | Path | None = None) -> list[HeadProfile]:
    """The parsed profile of each `kv.compression` entry, in order; `KvConfigError` naming the entry."""
    out = []
    for i, path in enumerate(profile_paths(cfg, base_dir)):
        try:
            out.append(load_head_profile(path))
        except ProfileError as exc:
            raise KvConfigError(f"kv.compression.{i}.profile: {exc}") from None
    return out


def load_layouts(
    cfg: KvConfig, profiles: Sequence[HeadProfile], base_dir: str | Path | None = None
) -> list[TpLayout | None]:
    """The TP layout of each `kv.compression` entry, in order: None for `contiguous`, else its `mosaic
    kv-layout --tp N --json` file parsed against the entry's profile; `KvConfigError` naming the entry."""
    out: list[TpLayout | None] = []
    for i, (c, profile) in enumerate(zip(cfg.compression, profiles, strict=True)):
        if c.tp_layout == "contiguous":
            out.append(None)
            continue
        path = Path(c.tp_layout)
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        try:
            doc = json.loads(path.read_text())
            out.append(TpLayout.from_document(doc, profile.layers, profile.kv_heads))
        except (OSError, UnicodeDecodeError, ValueError) as exc:  # (json's errors are ValueErrors)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise KvConfigError(f"kv.compression.{i}.tp_layout: {path}: {reason}") from None
    return out


def build_gateway_ledger(
    cfg: KvConfig,
    gateway_replicas: int = 1,
    base_dir: str | Path | None = None,
    pools: Mapping[str, tuple[str, int]] | None = None,
) -> KvLedger | None:
    """`build_ledger` with the profiles and TP layouts read from disk (relative to `base_dir`); `pools`: name
    → (model, tp) of the configured pools. None when disabled."""
    if not cfg.enabled:
        return None
    profiles = load_profiles(cfg, base_dir)
    return build_ledger(cfg, gateway_replicas, profiles, pools, load_layouts(cfg, profiles, base_dir))


def routing_with_kv(cfg: RoutingConfig) -> RoutingConfig:
    """`cfg` with the `kv-best-fit` scorer enabled for the `mosaic` policy (weights: the policy defaults,
    `scheduler.routing.profiles.MOSAIC_WEIGHTS`, under the config's own). Unchanged for other policies or
    when the config already lists a `kv-best-fit` plugin (enabled or not: the user decided)."""
    if cfg.policy != "mosaic" or any(p.type == "kv-best-fit" for p in cfg.plugins):
        return cfg
    return cfg.model_copy(update={"plugins": [*cfg.plugins, PluginSpec(type="kv-best-fit")]})
