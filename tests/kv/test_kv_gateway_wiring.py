"""How the gateway wires the KV ledger: profile paths relative to the config file, `kv-best-fit` in the
default `mosaic` policy, the P/D prefill hand-off release, and the queue policy's aging holds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from scheduler.fleet import FleetView, Role
from scheduler.kv.config import KvConfig
from scheduler.kv.ledger import KvLedger
from scheduler.routing.config import RoutingConfig
from scheduler.routing.profiles import KV_BEST_FIT_WEIGHT
from scheduler.routing.reasons import Outcome
from server.config import load_config, validate_config
from server.gateway import Gateway
from server.kv_admission import KvQueuePolicy
from server.kv_setup import routing_with_kv
from tests.kv.kvkit import request, worker

FIX = Path(__file__).parent / "fixtures"

CONFIG_YAML = """
pools:
  - {name: comp, model: llama-3-8b, gpu: L4, endpoints: {static: ["http://127.0.0.1:9"]}}
kv:
  compression:
    - {pool: comp, profile: profiles/moments.csv, heads_per_group: 2, prefill_chunk: 64}
"""


def test_relative_profile_path_is_resolved_against_the_config_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "conf"
    (conf / "profiles").mkdir(parents=True)
    shutil.copy(FIX / "moments.csv", conf / "profiles" / "moments.csv")
    (conf / "mosaic.yaml").write_text(CONFIG_YAML)
    monkeypatch.chdir(tmp_path)  # not the config's folder: `profiles/moments.csv` does not exist here
    cfg = load_config(conf / "mosaic.yaml")
    assert cfg.source_dir == conf.resolve()
    assert cfg.resolve_path("profiles/moments.csv") == conf.resolve() / "profiles" / "moments.csv"
    assert cfg.resolve_path(tmp_path / "abs.yaml") == tmp_path / "abs.yaml"  # absolute: as written
    gw = Gateway(cfg)
    assert gw.ledger is not None
    spec = gw.ledger.spec_for(worker(pool="comp")).compression
    assert spec is not None and spec.group_sizes == (2, 2)


def _data(kv: dict[str, object], routing: dict[str, object] | None = None) -> dict[str, object]:
    pool = {"name": "p", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"static": ["http://127.0.0.1:9"]}}
    return {"pools": [pool], "kv": kv, "routing": routing or {}}


@pytest.mark.parametrize(
    ("kv", "routing", "weights"),
    [
        pytest.param(
            {}, None, (KV_BEST_FIT_WEIGHT, KV_BEST_FIT_WEIGHT, None), id="ledger on: mosaic scores best fit"
        ),
        pytest.param({"enabled": False}, None, (None, None, None), id="ledger off: no kv-best-fit"),
        pytest.param(
            {},
            {"plugins": [{"type": "kv-best-fit", "enabled": False}]},
            (None, None, None),
            id="the user disabled it: left off",
        ),
        pytest.param(
            {}, {"weights": {"kv-best-fit": 5}}, None, id="routing.weights names it before it exists"
        ),
        pytest.param({}, {"policy": "least-loaded"}, (None, None, None), id="other policies: unchanged"),
    ],
)
def test_kv_best_fit_joins_the_mosaic_policy_when_the_ledger_is_on(
    kv: dict[str, object], routing: dict[str, object] | None, weights: tuple[float | None, ...] | None
) -> None:
    if weights is None:  # a weight for a scorer the config does not enable is refused at load
        with pytest.raises(Exception, match="kv-best-fit: not an enabled scorer"):
            validate_config(_data(kv, routing))
        return
    gw = Gateway(validate_config(_data(kv, routing)))
    profiles = gw.router.describe()["profiles"]
    got = tuple(profiles[p]["weights"].get("kv-best-fit") for p in ("mixed", "decode", "prefill"))
    assert got == weights  # prefill's weight is 0, so the scorer is left out there


def test_routing_with_kv_keeps_user_weights() -> None:
    cfg = RoutingConfig.model_validate(
        {"plugins": [{"type": "kv-best-fit"}], "profiles": {"mixed": {"weights": {"kv-best-fit": 7}}}}
    )
    assert routing_with_kv(cfg) is cfg  # listed already: the user's weights stand


def test_prefill_reservation_is_released_at_the_decode_first_token() -> None:
    ledger = KvLedger()
    pw, dw = worker("p", role=Role.PREFILL), worker("d", role=Role.DECODE)
    req = request(prompt=160, max_out=40)
    pre = ledger.reserve(req, pw, 0.0)
    dec = ledger.reserve(req, dw, 0.0)
    assert pre is not None and dec is not None
    assert ledger.reserved("p") == 11  # ceil((160 + 1) / 16): the prompt and one token
    assert ledger.reserved("d") == 13  # ceil((160 + 40) / 16)
    for r in (pre, dec):  # the decode hop's first token reaches every reservation of the request
        r.first_token(1.0)
    assert ledger.reserved("p") == 0 and pre.outcome is Outcome.COMPLETED
    assert ledger.reserved("d") == 13 and dec.outcome is None
    for r in (dec, pre):  # the request ends: its own release of every reservation
        r.release(Outcome.COMPLETED)
    assert ledger.reserved("d") == 0
    assert ledger.stats.released == {"completed": 2}
    assert ledger.stats.double_releases == 0  # the end's release of the handed-off one is expected
    pre.release(Outcome.COMPLETED)  # a genuine second release after that is still counted
    assert ledger.stats.double_releases == 1


def test_aging_holds_the_closest_worker_and_drops_the_hold_when_the_waiter_leaves() -> None:
    ledger = KvLedger()
    a, b = worker("a", blocks=100), worker("b", blocks=100)  # capacity floor(100 · 0.98) = 98 each
    ledger.reserve(request("x", prompt=800, max_out=0), a, 0.0)  # 50 blocks on a
    ledger.reserve(request("y", prompt=480, max_out=0), b, 0.0)  # 30 blocks on b
    view = FleetView((a, b))
    policy = KvQueuePolicy(
        KvConfig(queue={"aging_s": 2.0}),  # type: ignore[arg-type]
        ledger,
        lambda: view,
        lambda req, exclude: pytest.fail("aging never routes"),
        lambda: 5.0,
    )
    big = request("big", prompt=1280, max_out=0)  # 80 blocks: fits neither now (48 and 68 free)
    policy.before_attempt(big, waited_s=1.0)
    assert policy.held == {} and ledger.free(b) == 68  # younger than aging_s: no hold
    policy.before_attempt(big, waited_s=2.5)
    assert policy.held == {"big": "b"}  # 68/80 free on b beats 48/80 on a
    assert ledger.free(b) == 68 - 80 and ledger.free(b, "big") == 68  # others lose it, big keeps it
    policy.before_attempt(big, waited_s=3.0)
    assert policy.stats.holds == 1  # renewed on the same worker, not moved
    policy.leave(big)
    assert policy.held == {} and ledger.free(b) == 68 and policy.stats.holds_dropped == 1
