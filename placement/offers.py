"""GPU offers for the planner: names made canonical against the catalog, prices, availability caps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from placement.binpacking import GpuOffer, PlacementError
from placement.catalog import Catalog, CatalogError, load_catalog
from placement.counts import MAX_COST_PER_HOUR, MAX_PLAN_INSTANCES, finite_number, whole_number
from placement.profiles import read_structured


def canonical_gpu(name: str, catalog: Catalog) -> str:
    try:
        return catalog.gpu(name).name
    except CatalogError:
        return name


def canonical_model(name: str, catalog: Catalog) -> str:
    try:
        return catalog.model(name).name
    except CatalogError:
        return name


def load_gpu_offers(
    source: str | Path | Sequence[str] | Mapping[str, Any], catalog: Catalog | None = None
) -> dict[str, GpuOffer]:
    """GPU offers from a YAML/JSON file, a mapping, or a list of names (costs default to the catalog's).

    ```yaml
    gpus:
      A10G: {}                              # catalog price ($1.01/h)
      A100-80GB: {cost_per_hour: 3.67, max: 4, min: 0}
    ```
    `max` is availability (GPUs one can get); a list `gpus: [A10G, L4]` takes every default.
    """
    catalog = catalog or load_catalog()
    origin = "--gpus"
    if isinstance(source, str | Path) and (Path(source).is_file() or _looks_like_path(str(source))):
        if not Path(source).exists():
            raise PlacementError(f"--gpus {source}: no such file")
        origin = str(source)
        source = read_structured(source, PlacementError)
    elif isinstance(source, str):
        source = [s.strip() for s in source.split(",") if s.strip()]
    if isinstance(source, Mapping) and "gpus" in source:
        extra = sorted(set(source) - {"gpus", "schema"})
        if extra:
            raise PlacementError(f"{origin}: unknown key(s) {extra}; expected 'gpus'")
        source = source["gpus"]
    listed = isinstance(source, list | tuple)  # names only: catalog prices
    if listed:
        rows: dict[str, Any] = {}
        for n in source:
            if str(n) in rows:
                raise PlacementError(f"{origin}: GPU {n} is given twice")
            rows[str(n)] = {}
    elif isinstance(source, Mapping):
        rows = dict(source)
    else:
        raise PlacementError(f"{origin}: expected a mapping of GPU types or a list of names")
    if not rows:
        raise PlacementError(f"{origin}: no GPU types given")
    offers: dict[str, GpuOffer] = {}
    given_as: dict[str, str] = {}  # canonical name → the name the user wrote (A100 and A100-80GB are one)
    for key, row in rows.items():
        if key is None or isinstance(key, bool):  # `~:`, `yes:`: YAML read no name there
            raise PlacementError(f"{origin}: GPU name {key!r} is not a name; quote it")
        raw = str(key)  # `4090:` is a number to YAML, and a GPU name here
        row = row or {}
        if not isinstance(row, Mapping) or set(row) - {"cost_per_hour", "min", "max"}:
            raise PlacementError(f"{origin}: GPU {raw}: allowed keys are cost_per_hour, min, max")
        name = canonical_gpu(raw, catalog)
        if name in given_as:
            raise PlacementError(
                f"{origin}: GPU {raw} is given twice (also as {given_as[name]}), both {name}"
            )
        given_as[name] = raw
        cost = row.get("cost_per_hour")
        if cost is None:
            try:
                cost = catalog.gpu(name).cost_per_hour
            except CatalogError:
                if listed:  # a name without a price: say which the catalog has
                    raise PlacementError(
                        f"{origin}: GPU {raw} is not in the catalog; valid GPUs: {', '.join(catalog.gpus)} "
                        "(another needs cost_per_hour in a --gpus file)"
                    ) from None
                raise PlacementError(
                    f"{origin}: GPU {raw} is not in the catalog: give cost_per_hour"
                ) from None
        where = f"{origin}: GPU {raw}:"
        cost = finite_number(cost, f"{where} cost_per_hour", 0, PlacementError, MAX_COST_PER_HOUR)
        low = whole_number(row.get("min", 0), f"{where} min", 0, PlacementError, MAX_PLAN_INSTANCES)
        high = row.get("max")
        if high is not None:
            high = whole_number(high, f"{where} max", 0, PlacementError, MAX_PLAN_INSTANCES)
        try:
            offers[name] = GpuOffer(name, cost, low, high)
        except PlacementError as exc:  # its message names the GPU already
            raise PlacementError(f"{origin}: {exc}") from None
    return offers


def _looks_like_path(text: str) -> bool:
    """A --gpus value meant as a file (a list of names has neither slashes nor these suffixes)."""
    return "/" in text or "\\" in text or text.lower().endswith((".yaml", ".yml", ".json"))
