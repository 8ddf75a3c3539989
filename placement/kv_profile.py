"""Per-head KV retention profiles: read Tangram's `.npz` release format and a simple JSON/CSV.

A retention ratio counts only the evictable context (Tangram's definition, `../shared/data/kv_profiles`):

    ratio = (kept − sink − window) / (total − sink)   ⇒   kept(T) = min(T, sink + window + ratio · (T − sink))

so the sink and the recent window are always kept and a ratio of 0 still keeps `sink + window` tokens.

Formats (`load_head_profile(path)` picks by suffix):

* Tangram `profile.npz` / `profile_perlayer.npz`: `raw_ratio` f64 [R, S, L, H] (R base ratios, S calibration
  samples), `sample_meta` i32 [S, 4] = (ctx_len, sink, total, window), `static_layer_ids`, `meta` (JSON bytes).
  The first base ratio is used; μ and σ are the mean and the population std over the S samples.
* JSON: ``{"model": "m", "sink": 32, "window": 4096, "heads": [{"layer": 0, "head": 0, "samples": [0.1, 0.2]},
  {"layer": 0, "head": 1, "mu": 0.3, "sigma": 0.05}, ...]}`` (every head gives either samples or mu and sigma).
* CSV with a header: `layer,head` and either `samples` (numbers separated by `;` or spaces) or `mu,sigma`
  (the aliases `static_layer`, `kv_head`, `ratio_mean`, `ratio_std` of `per_head_profile.csv` are accepted, so a slice of that
  file for one scorer/model/scope loads as is). Optional `sink` and `window` columns (one value for the file).

Every (layer, head) of an L×H grid must appear exactly once; ratios must lie in [0, 1].
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from placement.textfiles import read_text

DEFAULT_SINK = 32  # Tangram's calibration: sink = 32 tokens
DEFAULT_WINDOW = 4096  # Tangram's calibration: recent window = 4096 tokens


class ProfileError(ValueError):
    """A profile file that cannot be read; the message names the file and the field."""


@dataclass(frozen=True)
class HeadProfile:
    """Retention statistics per (layer, KV head). Arrays are read-only float64 of shape [L, H] ([S, L, H])."""

    name: str
    mu: np.ndarray
    sigma: np.ndarray
    samples: np.ndarray | None  # [S, L, H] per-sample ratios, None when only μ and σ were given
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    layer_ids: tuple[
        int, ...
    ] = ()  # physical layer index of each profiled layer (Tangram's static_layer_ids)

    @property
    def layers(self) -> int:
        return int(self.mu.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.mu.shape[1])

    @property
    def num_heads_total(self) -> int:
        return self.layers * self.kv_heads

    def budgets(self, alpha: float = 2.0) -> np.ndarray:
        """Static per-head budget μ_h + α·σ_h, clipped to [0, 1] (Tangram's μ + 2σ with α = 2)."""
        return np.clip(self.mu + alpha * self.sigma, 0.0, 1.0)

    def kept_tokens(self, ratio: float, tokens: int) -> int:
        """Tokens a head with retention `ratio` keeps of a `tokens`-long context (sink and window always kept)."""
        return kept_tokens(ratio, tokens, self.sink, self.window)


def kept_tokens(ratio: float, tokens: int, sink: int, window: int) -> int:
    """min(T, sink + window + ceil(ratio · (T − sink))): the inverse of Tangram's ratio definition, rounded up."""
    if tokens <= sink + window:
        return tokens
    return min(tokens, sink + window + math.ceil(ratio * (tokens - sink) - 1e-9))


def load_head_profile(path: str | Path) -> HeadProfile:
    """Read a profile from `.npz` (Tangram), `.json` or `.csv`; raises ProfileError naming the file and field."""
    p = Path(path)
    if p.is_dir():
        raise ProfileError(f"profile file {p} is a directory")
    if not p.is_file():
        raise ProfileError(f"profile file {p} does not exist")
    loaders = {".npz": _load_npz, ".json": _load_json, ".csv": _load_csv}
    loader = loaders.get(p.suffix.lower())
    if loader is None:
        raise ProfileError(
            f"profile file {p}: unknown format {p.suffix!r}; use .npz (Tangram), .json or .csv"
        )
    try:
        return loader(p)
    except ProfileError as exc:
        msg = str(exc)
        raise ProfileError(msg if str(p) in msg else f"profile file {p}: {msg}") from None


def from_samples(
    name: str, samples: np.ndarray, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW
) -> HeadProfile:
    """A profile from per-sample ratios [S, L, H]: μ = mean, σ = population std over samples."""
    arr = np.asarray(samples, dtype=np.float64)
    if arr.ndim != 3 or arr.shape[0] < 1 or arr.shape[1] < 1 or arr.shape[2] < 1:
        raise ProfileError(f"profile {name}: samples must have shape [S, L, H], got {arr.shape}")
    _check_ratios(name, "samples", arr)
    return _frozen(name, arr.mean(axis=0), arr.std(axis=0), arr, sink, window, tuple(range(arr.shape[1])))


def from_moments(
    name: str, mu: np.ndarray, sigma: np.ndarray, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW
) -> HeadProfile:
    """A profile from μ and σ arrays [L, H] (no samples: the simulator then draws from N(μ, σ) clipped)."""
    m = np.asarray(mu, dtype=np.float64)
    s = np.asarray(sigma, dtype=np.float64)
    if m.ndim != 2 or m.shape != s.shape or m.size == 0:
        raise ProfileError(
            f"profile {name}: mu and sigma must be [L, H] arrays of one shape, got {m.shape} and {s.shape}"
        )
    _check_ratios(name, "mu", m)
    if (s < 0).any() or not np.isfinite(s).all():
        raise ProfileError(f"profile {name}: sigma must be finite and ≥ 0")
    return _frozen(name, m, s, None, sink, window, tuple(range(m.shape[0])))


def _frozen(
    name: str,
    mu: np.ndarray,
    sigma: np.ndarray,
    samples: np.ndarray | None,
    sink: int,
    window: int,
    layer_ids: tuple[int, ...],
) -> HeadProfile:
    if sink < 0 or window < 0:
        raise ProfileError(f"profile {name}: sink and window must be ≥ 0, got {sink} and {window}")
    for a in (mu, sigma, samples):
        if a is not None:
            a.setflags(write=False)
    return HeadProfile(name, mu, sigma, samples, int(sink), int(window), layer_ids)


def _check_ratios(name: str, field: str, arr: np.ndarray) -> None:
    if not np.isfinite(arr).all() or (arr < 0).any() or (arr > 1).any():
        raise ProfileError(f"profile {name}: {field} ratios must be finite and in [0, 1]")


def _load_npz(p: Path) -> HeadProfile:
    try:
        with np.load(p, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise ProfileError(f"profile file {p} is not a readable .npz: {exc}") from None
    if "raw_ratio" not in arrays:
        raise ProfileError(f"profile file {p}: missing array 'raw_ratio' (expected Tangram's profile.npz)")
    raw = np.asarray(arrays["raw_ratio"], dtype=np.float64)
    if raw.ndim != 4:
        raise ProfileError(f"profile file {p}: 'raw_ratio' must be [R, S, L, H], got shape {raw.shape}")
    sink, window = DEFAULT_SINK, DEFAULT_WINDOW
    meta_rows = arrays.get("sample_meta")
    if meta_rows is not None and meta_rows.ndim == 2 and meta_rows.shape[1] >= 4 and len(meta_rows):
        sink, window = int(meta_rows[0, 1]), int(meta_rows[0, 3])  # (ctx_len, sink, total, win)
    name = p.parent.name or p.stem
    if "meta" in arrays:
        try:
            meta = json.loads(bytes(arrays["meta"]).decode())
            name = f"{meta.get('scorer', '')}/{p.parent.name}".strip("/") if isinstance(meta, dict) else name
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
    prof = from_samples(name, raw[0], sink, window)
    ids = arrays.get("static_layer_ids")
    if ids is not None and len(ids) == prof.layers:
        prof = HeadProfile(
            prof.name, prof.mu, prof.sigma, prof.samples, sink, window, tuple(int(i) for i in ids)
        )
    return prof


def _load_json(p: Path) -> HeadProfile:
    text = read_text(p, ProfileError, f"cannot read profile file {p}: ")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile file {p} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("heads"), list):
        raise ProfileError(f"profile file {p}: expected an object with a 'heads' list")
    rows = [_row_from_mapping(p, i, h) for i, h in enumerate(data["heads"])]
    return _from_rows(
        p,
        str(data.get("model", p.stem)),
        rows,
        _int_field(p, data, "sink", DEFAULT_SINK),
        _int_field(p, data, "window", DEFAULT_WINDOW),
    )


def _load_csv(p: Path) -> HeadProfile:
    try:
        with p.open(newline="") as fh:
            records = list(csv.DictReader(fh))
    except (OSError, csv.Error, UnicodeDecodeError) as exc:
        raise ProfileError(f"profile file {p} is not a readable CSV: {exc}") from None
    if not records:
        raise ProfileError(f"profile file {p}: no rows")
    aliases = {"kv_head": "head", "static_layer": "layer", "ratio_mean": "mu", "ratio_std": "sigma"}
    rows = []
    for i, rec in enumerate(records):
        norm: dict[str, Any] = {}
        for k, v in rec.items():
            if k is None or v is None or v == "":
                continue
            norm[aliases.get(k.strip(), k.strip())] = v
        if "samples" in norm:
            norm["samples"] = [x for x in str(norm["samples"]).replace(";", " ").split()]
        rows.append(_row_from_mapping(p, i, norm))
    first = {k: v for k, v in records[0].items() if k}
    return _from_rows(
        p,
        p.stem,
        rows,
        _int_field(p, first, "sink", DEFAULT_SINK),
        _int_field(p, first, "window", DEFAULT_WINDOW),
    )


def _int_field(p: Path, data: dict[str, Any], key: str, default: int) -> int:
    if data.get(key) in (None, ""):
        return default
    try:
        return int(data[key])
    except (TypeError, ValueError):
        raise ProfileError(f"profile file {p}: '{key}' must be an integer, got {data[key]!r}") from None


def _row_from_mapping(p: Path, i: int, h: Any) -> tuple[int, int, list[float] | None, float, float]:
    if not isinstance(h, dict):
        raise ProfileError(f"profile file {p}: heads[{i}] must be an object")
    try:
        layer, head = int(h["layer"]), int(h["head"])
        if h.get("samples") is not None:
            samples = [float(x) for x in h["samples"]]
            if not samples:
                raise ValueError("empty samples")
            return layer, head, samples, 0.0, 0.0
        return layer, head, None, float(h["mu"]), float(h["sigma"])
    except KeyError as exc:
        raise ProfileError(
            f"profile file {p}: heads[{i}] is missing field {exc.args[0]!r} "
            "(need layer, head and samples or mu+sigma)"
        ) from None
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"profile file {p}: heads[{i}] has a non-numeric field ({exc})") from None


def _from_rows(
    p: Path, name: str, rows: list[tuple[int, int, list[float] | None, float, float]], sink: int, window: int
) -> HeadProfile:
    layers = sorted({r[0] for r in rows})
    heads = sorted({r[1] for r in rows})
    if min(layers) < 0 or min(heads) < 0:
        raise ProfileError(f"profile file {p}: layer and head indices must be ≥ 0")
    li = {v: i for i, v in enumerate(layers)}
    hi = {v: i for i, v in enumerate(heads)}
    if len(rows) != len(layers) * len(heads) or len({(r[0], r[1]) for r in rows}) != len(rows):
        raise ProfileError(
            f"profile file {p}: every (layer, head) of a {len(layers)}×{len(heads)} grid must appear "
            f"exactly once, got {len(rows)} rows"
        )
    with_samples = [r for r in rows if r[2] is not None]
    if with_samples and len(with_samples) != len(rows):
        raise ProfileError(
            f"profile file {p}: mix of heads with samples and heads with mu/sigma; use one form"
        )
    if with_samples:
        counts = {len(r[2] or []) for r in rows}
        if len(counts) != 1:
            raise ProfileError(
                f"profile file {p}: every head must have the same number of samples, got {sorted(counts)}"
            )
        arr = np.zeros((counts.pop(), len(layers), len(heads)))
        for layer, head, samples, _, _ in rows:
            arr[:, li[layer], hi[head]] = samples
        prof = from_samples(name, arr, sink, window)
    else:
        mu = np.zeros((len(layers), len(heads)))
        sigma = np.zeros_like(mu)
        for layer, head, _, m, s in rows:
            mu[li[layer], hi[head]], sigma[li[layer], hi[head]] = m, s
        prof = from_moments(name, mu, sigma, sink, window)
    return HeadProfile(prof.name, prof.mu, prof.sigma, prof.samples, prof.sink, prof.window, tuple(layers))
