"""Checkpoint of an unfinished `mosaic profile` run, so `--resume` continues where it stopped.

A `--url` grid probes a live server in real time: hours on a real GPU. A Ctrl-C, a lost connection or a
reboot near the end used to throw all of it away. After every bucket the run's results so far are written
beside the output, to `<out>.partial.json` (atomically: a crash mid-write leaves the previous checkpoint), and
the file is removed once the profile itself is written.

The checkpoint records the settings the results depend on (GPU, model, SLO, edges, seed, rate grid, probe
sizes, URL, ...). Resuming with different ones would put two runs' answers in one profile, so it is refused
with the settings that differ named. A bucket's record is what the profile file and the run's closing notes
need: its max rate, the measurement at it, and whether it was capped at the grid's top or hopeless one
request at a time (the probes themselves are not kept).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loadgen.profile_search import Measurement, SearchResult
from loadgen.profiling import Bucket

SCHEMA = "mosaic.profile-checkpoint/v1"
SUFFIX = ".partial.json"

Done = dict[tuple[int, int], SearchResult | None]  # None: the GPU cannot serve the bucket (max rate 0)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: unreadable, not one, or of a run with other settings."""


def checkpoint_path(out: Path) -> Path:
    """Where the run writing `out` keeps its checkpoint: `<out>.partial.json`, beside it."""
    return out.with_name(out.name + SUFFIX)


def _record(res: SearchResult | None) -> dict[str, Any]:
    if res is None:
        return {"fits": False}
    return {
        "fits": True,
        "max_rate": res.max_rate,
        "capped": res.capped,
        "unloaded_miss": res.unloaded_miss,
        "measurement": None if res.measurement is None else res.measurement.as_dict(),
    }


# what a record read back must hold: a hand-edited or damaged one is refused before any bucket is probed (it
# crashed the run only when the profile was written, after the rest of the grid: hours on a real GPU)
_Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_Count = Annotated[int, Field(ge=0)]


class _MeasurementRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rate: _Amount
    n: _Count
    ttft_p90_ms: _Amount
    tpot_p90_ms: _Amount
    stable: bool = True
    failed: _Count = 0


class _BucketRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    i: _Count
    j: _Count
    fits: bool
    max_rate: _Amount = 0.0
    capped: bool = False
    unloaded_miss: bool = False
    measurement: _MeasurementRecord | None = None


def _result(rec: _BucketRecord) -> SearchResult | None:
    if not rec.fits:
        return None
    m = rec.measurement
    return SearchResult(
        max_rate=rec.max_rate,
        measurement=None if m is None else Measurement(**m.model_dump()),
        capped=rec.capped,
        unloaded_miss=rec.unloaded_miss,
    )


def _plain(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings as they read back from JSON (tuples become lists), so a resume compares like with like."""
    return json.loads(json.dumps(dict(settings)))


@dataclass(slots=True)
class Checkpoint:
    """The buckets done so far (`done`, keyed by (i, j)) of the run with `settings`, kept at `path`."""

    path: Path
    settings: dict[str, Any]
    done: Done = field(default_factory=dict)

    @classmethod
    def fresh(cls, path: Path, settings: Mapping[str, Any]) -> Checkpoint:
        return cls(path, _plain(settings))

    @classmethod
    def load(cls, path: Path, settings: Mapping[str, Any]) -> Checkpoint:
        """The checkpoint at `path`, if it belongs to a run with these `settings`; else `CheckpointError`."""
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(
                f"no checkpoint at {path} (a run writes one there after each bucket and removes it when the "
                "profile is written)"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: not a readable checkpoint ({exc})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise CheckpointError(f"{path}: not a profile checkpoint (schema {SCHEMA} expected)")
        want = _plain(settings)
        had = doc.get("settings")
        if not isinstance(had, dict):
            raise CheckpointError(f"{path}: the checkpoint has no settings")
        differ = [
            f"{k} {had.get(k)!r} → {want.get(k)!r}"
            for k in sorted(want.keys() | had.keys())
            if had.get(k) != want.get(k)
        ]
        if differ:
            raise CheckpointError(
                f"{path} is a run with other settings ({'; '.join(differ)}): rerun with its settings, or delete "
                "it to start over"
            )
        buckets = doc.get("buckets")
        if not isinstance(buckets, list):
            raise CheckpointError(f"{path}: the checkpoint has no bucket list")
        done: Done = {}
        for k, raw in enumerate(buckets):
            try:
                rec = _BucketRecord.model_validate(raw)
            except ValidationError as exc:
                err = exc.errors(include_url=False)[0]
                where = ".".join(str(p) for p in err["loc"]) or "the record"
                raise CheckpointError(
                    f"{path}: bucket record {k} is malformed ({where}: {err['msg']}); delete the file to start over"
                ) from None
            done[(rec.i, rec.j)] = _result(rec)
        return cls(path, want, done)

    def record(self, bucket: Bucket, res: SearchResult | None) -> None:
        """Add one finished bucket and rewrite the file: a temporary file beside it, renamed over it."""
        self.done[(bucket.i, bucket.j)] = res
        doc = {
            "schema": SCHEMA,
            "settings": self.settings,
            "buckets": [{"i": i, "j": j, **_record(r)} for (i, j), r in sorted(self.done.items())],
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
