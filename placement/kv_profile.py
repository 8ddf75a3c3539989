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
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from placement.textfiles import parse_json, read_text

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
        """Static per-head budget μ_h + α·σ_h, clipped to [0, 1] (Tangram's μ + 2σ with α = 2). A product that
        overflows (a huge σ or α) is +inf and clips to 1, the answer it stands for: no warning."""
        with np.errstate(over="ignore"):
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
        with p.open("rb") as fh:  # ours to close: np.load leaks its own handle when the zip is damaged
            head = fh.read(6)
            fh.seek(0)
            # neither a zip (.npz) nor an .npy: np.load would take it for a pickle and talk of allow_pickle
            if head and not head.startswith((b"PK\x03\x04", b"\x93NUMPY")):
                raise ValueError("not an .npz archive (no zip header)")
            loaded = np.load(fh, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise ValueError("a single .npy array, not an .npz archive")
            with loaded as data:
                arrays = {k: data[k] for k in data.files}
    # an empty file is EOFError (which click turns into "Aborted!", exit 130), a damaged archive BadZipFile
    # or zlib.error, a damaged member ValueError
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise ProfileError(f"profile file {p} is not a readable .npz: {exc or type(exc).__name__}") from None
    if "raw_ratio" not in arrays:
        raise ProfileError(f"profile file {p}: missing array 'raw_ratio' (expected Tangram's profile.npz)")
    raw = _numbers(p, "raw_ratio", arrays["raw_ratio"])
    if raw.ndim != 4 or 0 in raw.shape:
        raise ProfileError(
            f"profile file {p}: 'raw_ratio' must be [R, S, L, H] with none of them 0, got shape {raw.shape}"
        )
    sink, window = DEFAULT_SINK, DEFAULT_WINDOW
    meta_rows = arrays.get("sample_meta")
    if meta_rows is not None and meta_rows.ndim == 2 and meta_rows.shape[1] >= 4 and len(meta_rows):
        row = _numbers(p, "sample_meta", meta_rows)[0]  # (ctx_len, sink, total, win)
        sink, window = _whole(p, "sample_meta sink", row[1]), _whole(p, "sample_meta window", row[3])
    name = p.parent.name or p.stem
    if "meta" in arrays:
        try:
            meta = json.loads(bytes(arrays["meta"]).decode())
            name = f"{meta.get('scorer', '')}/{p.parent.name}".strip("/") if isinstance(meta, dict) else name
        except (UnicodeDecodeError, TypeError, ValueError, RecursionError):  # a name only: keep the default
            pass
    prof = from_samples(name, raw[0], sink, window)
    ids = arrays.get("static_layer_ids")
    if ids is not None:
        ids = _numbers(p, "static_layer_ids", ids)
        if ids.ndim != 1:
            raise ProfileError(f"profile file {p}: 'static_layer_ids' must be a list, got shape {ids.shape}")
        if len(ids) == prof.layers:
            layer_ids = tuple(_whole(p, "static_layer_ids", i) for i in ids)
            prof = HeadProfile(prof.name, prof.mu, prof.sigma, prof.samples, sink, window, layer_ids)
    return prof


def _numbers(p: Path, field: str, value: np.ndarray) -> np.ndarray:
    """The array as float64, or ProfileError naming the field (strings, objects, complex numbers)."""
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ProfileError(f"profile file {p}: '{field}' must hold numbers, got {value.dtype}") from None


def _whole(p: Path, field: str, value: float) -> int:
    """A whole number ≥ 0 (an index, a token count), or ProfileError: NaN, ∞ and 2.5 are none."""
    if not math.isfinite(value) or not float(value).is_integer() or value < 0:
        raise ProfileError(f"profile file {p}: {field} must be a whole number ≥ 0, got {float(value):g}")
    return int(value)


def _load_json(p: Path) -> HeadProfile:
    text = read_text(p, ProfileError, f"cannot read profile file {p}: ")
    data = parse_json(text, ProfileError, f"profile file {p} is not valid JSON")
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
    except (TypeError, ValueError, OverflowError):
        raise ProfileError(f"profile file {p}: '{key}' must be an integer, got {data[key]!r}") from None


def _row_from_mapping(p: Path, i: int, h: Any) -> tuple[int, int, list[float] | None, float, float]:
    if not isinstance(h, dict):
        raise ProfileError(f"profile file {p}: heads[{i}] must be an object")
    try:
        layer, head = _index(h["layer"]), _index(h["head"])
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
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProfileError(f"profile file {p}: heads[{i}] has a non-numeric field ({exc})") from None


def _index(value: Any) -> int:
    """A layer or head index: an int, a whole float (JSON's 2.0) or an integer string (CSV); 1.5 and 1e400
    (∞) are none (int() truncated the one and raised OverflowError on the other)."""
    if isinstance(value, bool):
        raise TypeError(f"an index must be a whole number, got {value!r}")
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise ValueError(f"an index must be a whole number, got {value!r}")
    return int(value)


def _from_rows(
    p: Path, name: str, rows: list[tuple[int, int, list[float] | None, float, float]], sink: int, window: int
) -> HeadProfile:
    if not rows:
        raise ProfileError(f"profile file {p}: no heads")
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
