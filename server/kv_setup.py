"""Build the gateway's KV ledger: read the `kv.compression[].profile` files here (floor 4 does the I/O) and
hand the parsed profiles to the pure `scheduler.kv.config.build_ledger`.

`routing_with_kv` adds the `kv-best-fit` scorer to the `mosaic` policy when the ledger exists.

Relative profile paths are resolved against the folder of the config file the gateway was loaded from
(`MosaicConfig.source_dir`, set by `server.config.load_config`); a config built from data (tests, the
Helm chart's rendered values) resolves them against the working directory.
"""

from __future__ import annotations

from pathlib import Path

from placement.kv_profile import HeadProfile, ProfileError, load_head_profile
from scheduler.kv.config import KvConfig, KvConfigError, build_ledger, profile_paths
from scheduler.kv.ledger import KvLedger
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


def build_gateway_ledger(
    cfg: KvConfig, gateway_replicas: int = 1, base_dir: str | Path | None = None
) -> KvLedger | None:
    """`build_ledger` with the profiles read from disk (relative to `base_dir`); None when disabled."""
    if not cfg.enabled:
        return None
    return build_ledger(cfg, gateway_replicas, load_profiles(cfg, base_dir))


def routing_with_kv(cfg: RoutingConfig) -> RoutingConfig:
    """`cfg` with the `kv-best-fit` scorer enabled for the `mosaic` policy (weights: the policy defaults,
    `scheduler.routing.profiles.MOSAIC_WEIGHTS`, under the config's own). Unchanged for other policies or
    when the config already lists a `kv-best-fit` plugin (enabled or not: the user decided)."""
    if cfg.policy != "mosaic" or any(p.type == "kv-best-fit" for p in cfg.plugins):
        return cfg
    return cfg.model_copy(update={"plugins": [*cfg.plugins, PluginSpec(type="kv-best-fit")]})
