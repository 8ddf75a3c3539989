"""Per-head compression on tensor-parallel pools: each rank's page tables hold its own heads, so a request's
footprint is tp · its most loaded rank's head-pages (`scheduler.kv.tp_layout`), with stock vLLM's contiguous
shards or the `mosaic kv-layout --tp N --json` partition the weights were permuted by.

One layer of four KV heads with budgets 0.9, 0.8, 0.1, 0.0 (sink and window 0), one head per page table,
block size 16, a 1,000-token prompt and 100 reserved output tokens: each head keeps ceil(b·1000) prompt tokens,
so its steady pages are ceil((kept + 100)/16) = 63, 57, 13, 7 (sum 140):

- tp 1: 140 head-pages;
- tp 2, contiguous shards {h0, h1} | {h2, h3}: 2 · max(120, 20) = 240 (the tp 1 spec under-reserved by 100);
- tp 2, the balanced partition {h0, h3} | {h1, h2} `kv-layout` finds: 2 · max(70, 70) = 140.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from scheduler.kv.config import KvConfig, KvConfigError, build_compression
from scheduler.kv.footprint import WorkerKvSpec, need
from scheduler.kv.tp_layout import TpLayout, contiguous_rank_of
from server.commands import kv_layout
from server.config import ConfigError, validate_config
from server.gateway import Gateway
from server.kv_setup import load_profiles
from tests.kv.kvkit import worker

PROFILE_CSV = "layer,head,mu,sigma,sink,window\n0,0,0.9,0,0,0\n0,1,0.8,0,0,0\n0,2,0.1,0,0,0\n0,3,0.0,0,0,0\n"


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.csv"
    path.write_text(PROFILE_CSV)
    return path


def layout_document(profile: Path, tp: int = 2, heads_per_group: int = 1) -> dict[str, Any]:
    """What `mosaic kv-layout --tp N --json` prints for `profile`."""
    app = typer.Typer()
    app.callback()(lambda: None)
    kv_layout.register(app)
    args = [
        "kv-layout",
        "--profile",
        str(profile),
        "--heads-per-group",
        str(heads_per_group),
        "--tp",
        str(tp),
    ]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def steady(cfg: KvConfig, profile: Path, pools: dict[str, tuple[str, int]], layout: Any = None) -> int:
    """Steady head-pages of the 1,000 + 100 token request on pool `p`'s spec."""
    by_pool, by_model = build_compression(cfg, load_profiles(cfg), pools, [layout])
    spec = by_pool.get("p") or by_model.get("m")
    assert spec is not None
    return need(1000, 100, WorkerKvSpec(16, None, spec)).steady


def kv(profile: Path, **entry: Any) -> KvConfig:
    target = {"model": "m"} if "model" in entry else {"pool": "p"}
    return KvConfig.model_validate(
        {"compression": [{**target, "profile": str(profile), "heads_per_group": 1, **entry}]}
    )


def test_a_tp1_pool_holds_all_heads_in_one_pool(profile_file: Path) -> None:
    assert steady(kv(profile_file), profile_file, {"p": ("m", 1)}) == 140


def test_contiguous_shards_reserve_the_most_loaded_rank(profile_file: Path) -> None:
    cfg = kv(profile_file)
    assert steady(cfg, profile_file, {"p": ("m", 2)}) == 240
    by_pool, _ = build_compression(cfg, load_profiles(cfg), {"p": ("m", 2)})
    spec = by_pool["p"]
    assert spec.group_sizes == (1, 1, 1, 1) and spec.group_budgets == (0.9, 0.8, 0.1, 0.0)
    assert spec.rank_groups == ((0, 1), (2, 3))
    assert contiguous_rank_of(2, 4, 2) == ((0, 0, 1, 1), (0, 0, 1, 1))


def test_a_kv_layout_partition_file_balances_the_ranks(profile_file: Path, tmp_path: Path) -> None:
    doc = layout_document(profile_file)
    layout = TpLayout.from_document(doc, layers=1, kv_heads=4)
    assert layout.rank_of in (((0, 1, 1, 0),), ((1, 0, 0, 1),))  # {h0, h3} and {h1, h2}, either way round
    assert (layout.tp, layout.heads_per_group, layout.alpha) == (2, 1, 2.0)
    assert steady(kv(profile_file), profile_file, {"p": ("m", 2)}, layout) == 140


def test_a_model_entry_splits_its_tp_pools_and_a_pool_entry_wins(profile_file: Path) -> None:
    cfg = KvConfig.model_validate(
        {
            "compression": [
                {"model": "m", "profile": str(profile_file), "heads_per_group": 1},
                {"pool": "q", "profile": str(profile_file), "heads_per_group": 2},
            ]
        }
    )
    pools = {"p": ("m", 2), "q": ("m", 2), "r": ("m", 1)}
    by_pool, by_model = build_compression(cfg, load_profiles(cfg), pools)
    assert by_pool["p"].rank_groups == ((0, 1), (2, 3))  # the model's entry, split over p's two ranks
    assert by_pool["q"].group_sizes == (2, 2) and by_pool["q"].rank_groups == ((0,), (1,))  # its own entry
    assert by_model["m"].rank_groups == ()  # tp 1 pools (r) use the model's spec as before
    assert "r" not in by_pool


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(lambda d: d["tp"].update(tp=4), "one `rank_groups` entry per rank", id="tp and ranks"),
        pytest.param(lambda d: d.update(kv_heads=8), "made for 1 layers × 8 KV heads", id="other profile"),
        pytest.param(lambda d: d.update(tp=None), "no `tp` partition", id="made without --tp"),
        pytest.param(
            lambda d: d["tp"]["rank_groups"][0].append([[0, 1]]), "is on two ranks", id="a head twice"
        ),
        pytest.param(lambda d: d["tp"]["rank_groups"][1].pop(), "is on no rank", id="a head missing"),
        pytest.param(
            lambda d: d["tp"]["rank_groups"][0].append(d["tp"]["rank_groups"][1].pop()),
            "layer 0 gives its ranks [3, 1] heads; vLLM shards 2 to each",
            id="ranks unbalanced",
        ),
        pytest.param(
            lambda d: d["tp"]["rank_groups"][0].append([[0, 9]]), "not a [layer, head]", id="no head"
        ),
    ],
)
def test_a_layout_document_that_does_not_fit_is_refused(
    profile_file: Path, change: Any, message: str
) -> None:
    doc = layout_document(profile_file)
    change(doc)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TpLayout.from_document(doc, layers=1, kv_heads=4)


def test_a_layout_must_match_its_pool_and_entry(profile_file: Path) -> None:
    layout = TpLayout.from_document(layout_document(profile_file), layers=1, kv_heads=4)
    cases = [
        ({"p": ("m", 4)}, {}, "partitions over 2 ranks; pool 'p' has tp 4"),
        ({"p": ("m", 2)}, {"heads_per_group": 2}, "made with --heads-per-group 1 --alpha 2; this entry has"),
        ({"p": ("m", 1)}, {}, "a TP layout for pools of tp 1"),
    ]
    for pools, entry, message in cases:
        cfg = kv(profile_file, **entry)
        with pytest.raises(KvConfigError, match=r"kv\.compression\.0\.tp_layout: " + message):
            build_compression(cfg, load_profiles(cfg), pools, [layout])
    three = KvConfig.model_validate({"compression": [{"pool": "p", "profile": str(profile_file)}]})
    with pytest.raises(KvConfigError, match="tp 3 must divide the 4 KV heads"):
        build_compression(three, load_profiles(three), {"p": ("m", 3)})


def _config(tmp_path: Path, tp: int, tp_layout: str = "contiguous") -> dict[str, Any]:
    pool = {
        "name": "p",
        "model": "llama-3-8b",
        "gpu": "H100",
        "tp": tp,
        "endpoints": {"static": ["http://127.0.0.1:9"]},
    }
    entry = {
        "pool": "p",
        "profile": str(tmp_path / "profile.csv"),
        "heads_per_group": 1,
        "tp_layout": tp_layout,
    }
    return {"pools": [pool], "kv": {"compression": [entry]}}


def test_the_gateway_reserves_per_rank_on_a_tp_pool(
    profile_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, compression on a tp > 1 pool was refused at config time."""
    monkeypatch.chdir(tmp_path)
    gw = Gateway(validate_config(_config(tmp_path, 2)))
    assert gw.ledger is not None
    spec = gw.ledger.spec_for(worker(pool="p", model="llama-3-8b"))
    assert spec.compression is not None and spec.compression.rank_groups == ((0, 1), (2, 3))
    assert need(1000, 100, spec).steady == 240
    (tmp_path / "layout.json").write_text(json.dumps(layout_document(profile_file)))
    gw = Gateway(validate_config(_config(tmp_path, 2, "layout.json")))  # relative: the working directory
    assert gw.ledger is not None
    assert need(1000, 100, gw.ledger.spec_for(worker(pool="p", model="llama-3-8b"))).steady == 140


def test_bad_tp_layouts_are_config_errors(profile_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"kv\.compression\.0\.tp_layout: a TP layout says which heads"):
        validate_config(_config(tmp_path, 1, "layout.json"))
    with pytest.raises(ConfigError, match=r"kv\.compression\.0\.tp_layout: .*missing\.json: No such file"):
        Gateway(validate_config(_config(tmp_path, 2, str(tmp_path / "missing.json"))))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"kv\.compression\.0\.tp_layout: .*bad\.json: Expecting"):
        Gateway(validate_config(_config(tmp_path, 2, str(tmp_path / "bad.json"))))
