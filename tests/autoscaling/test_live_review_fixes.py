"""Defects of the live autoscaling path (review): per-model signals, placement slots, stale and unhealthy
workers, pinned pools, unreadable replica counts, duplicate Deployments, embedded start failures, NaN
gauges, counter resets, stale signal gauges, and another scaler on the same Deployment."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client import ApiException
from prometheus_client import CollectorRegistry

from scheduler.actuators.dry_run import DryRunActuator
from scheduler.actuators.kubernetes import KubernetesActuator
from scheduler.autoscaler.baselines import HpaPolicy
from scheduler.autoscaler.policy import AutoscalerConfig, MosaicAutoscaler
from scheduler.autoscaler.signals import (
    ModelObservation,
    Observation,
    PoolObservation,
    PoolSpec,
    ScalingDecision,
)
from server.autoscale_signals import UNHEALTHY_GRACE_S, _rate
from server.autoscaler_setup import controller_for
from server.autoscaling import AutoscalerController
from server.config import ConfigError, validate_config
from server.discovery import Endpoint
from server.embedded_actuator import EmbeddedActuator
from server.gateway import Gateway
from server.gateway_signals import QUEUE, RECEIVED, GatewayWindow, Merged, Snapshot, gateway_signals
from server.scrape import WorkerStats


class FakeAppsApi:
    """AppsV1Api's scale subresource; `refuse` fails patches (403), `unreadable` fails reads with a status."""

    def __init__(self, replicas: int, refuse: bool = False, unreadable: int | None = None) -> None:
        self.replicas = replicas
        self.refuse = refuse
        self.unreadable = unreadable
        self.calls: list[tuple[Any, ...]] = []

    def read_namespaced_deployment_scale(
        self, name: str, namespace: str, _request_timeout: Any = None
    ) -> Any:
        self.calls.append(("read", name))
        if self.unreadable is not None:
            raise ApiException(
                status=self.unreadable, reason="Forbidden" if self.unreadable == 403 else "Not Found"
            )
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas))

    def patch_namespaced_deployment_scale(
        self,
        name: str,
        namespace: str,
        body: dict[str, Any],
        field_manager: str | None = None,
        _request_timeout: Any = None,
    ) -> Any:
        self.calls.append(("patch", name, body["spec"]["replicas"]))
        if self.refuse:
            raise ApiException(status=403, reason="Forbidden")
        self.replicas = body["spec"]["replicas"]


def _kubernetes_controller(
    cfg: Any, gw: Gateway, api: FakeAppsApi, deployments: dict[str, str], namespace: str = "ns", **extra: Any
) -> AutoscalerController:
    """The live controller over `gw`'s registry, scaling `deployments` through `api` (recorded responses)."""
    return controller_for(
        cfg,
        gw.registry,
        gw.metrics.registry,
        managed=frozenset(deployments),
        actuator_factory=lambda i: KubernetesActuator(api, namespace, deployments),
        **extra,
    )


def _pool(name: str, gpu: str = "A100-80GB", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model": "llama-3-8b",
        "gpu": gpu,
        "role": "mixed",
        "max_replicas": 8,
        "endpoints": {"static": ["http://127.0.0.1:9"]},
        **extra,
    }


def _one(_: str) -> float:
    return 1.0


def _spec(name: str, model: str, **kw: Any) -> PoolSpec:
    return PoolSpec(
        name, model, "mixed", "L4", 1.0, **{"min_replicas": 1, "decode_tps_capacity": 1000.0, **kw}
    )


# ------------------------------------------------------------------ 1. per-model signals
def _merged_for_model_a() -> Merged:
    key = (RECEIVED, (("model", "a"),))
    return Merged({key: 50.0}, {key: 5.0}, {}, gateways=1, counted=1)


def test_a_configured_model_without_series_reads_zero_not_the_fleet() -> None:
    out = gateway_signals(_merged_for_model_a(), _one, _one, ["a", "b"])
    assert out["request_rate"] == 5.0
    assert out["models"]["a"].request_rate == 5.0
    assert out["models"]["b"] == ModelObservation()  # before: absent, so b read the fleet's 5 req/s


def test_a_single_model_fleet_without_labelled_series_reads_the_fleet() -> None:
    key = (RECEIVED, ())  # an older gateway: no model label
    merged = Merged({key: 30.0}, {key: 3.0}, {}, gateways=1, counted=1)
    assert gateway_signals(merged, _one, _one, ["a"])["models"]["a"].request_rate == 3.0


def test_for_model_falls_back_to_the_fleet_only_without_per_model_entries() -> None:
    obs = Observation(0.0, {}, request_rate=7.0, models={"a": ModelObservation(2.0)})
    assert obs.for_model("b") == ModelObservation()
    assert dataclasses.replace(obs, models={}).for_model("b").request_rate == 7.0  # the simulator's shape


def test_an_idle_model_does_not_scale_on_another_models_load() -> None:
    policy = MosaicAutoscaler([_spec("a-l4", "a"), _spec("b-a100", "b", max_replicas=8)], AutoscalerConfig())
    pools = {"a-l4": PoolObservation(ready=1), "b-a100": PoolObservation(ready=1)}
    obs = Observation(
        0.0,
        pools,
        request_rate=10.0,
        mean_output_tokens=256.0,
        models={"a": ModelObservation(10.0, 1024.0, 256.0)},  # b: no series yet
    )
    assert policy.decide(obs).targets == {"a-l4": 4, "b-a100": 1}  # b was 1 → 3 on a's load before


# ------------------------------------------------------------------ 8. NaN queue gauge
def test_a_non_finite_queue_depth_is_skipped() -> None:
    window = GatewayWindow()
    good = Snapshot(1.0, {(QUEUE, (("model", "a"),)): 3.0})
    bad = Snapshot(1.0, {(QUEUE, (("model", "a"),)): math.nan})
    merged = window.step({"g1": good, "g2": bad})
    assert gateway_signals(merged, _one, _one, ["a"])["admission_queue"] == {"a": 3}
    direct = Merged({}, {}, {(QUEUE, (("model", "a"),)): math.inf}, gateways=1, counted=0)
    assert gateway_signals(direct, _one, _one)["admission_queue"] == {}


# ------------------------------------------------------------------ 9. counter reset
def test_a_counter_reset_counts_from_zero() -> None:
    assert _rate(1000.0, 30.0, 10.0, None) == 3.0  # before: the fallback, 0
    assert _rate(1000.0, 1100.0, 10.0, None) == 10.0
    assert _rate(None, 30.0, 10.0, 2.0) == 2.0


# ------------------------------------------------------------------ 3. stale worker metrics
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _stale_fleet(policy: str = "mosaic") -> list[tuple[int, int, str]]:
    """4 ready L4 workers decoding 300 tok/s each; from the third cycle 3 of them stop answering /metrics."""
    clock = Clock()
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]
    cfg = validate_config(
        {
            "pools": [_pool("dec", "L4", min_replicas=1, endpoints={"static": urls})],
            "scrape": {"stale_after_s": 10},
            "autoscaler": {
                "actuator": "dry-run",
                "policy": policy,
                "interval_s": 15,
                "scale_down_window_s": 60,
            },
        }
    )
    gw = Gateway(cfg)
    gw.registry.sync_pool("dec", [Endpoint(f"w{i}", u) for i, u in enumerate(urls)])
    for r in gw.registry.records():
        r.health_ok = True
    ctl = controller_for(
        cfg,
        gw.registry,
        gw.metrics.registry,
        managed=frozenset({"dec"}),
        clock=clock,
        actuator_factory=lambda init: DryRunActuator(init),
        gateway=dict,
    )
    tokens = {r.id: 0.0 for r in gw.registry.records()}

    def scrape(dead: set[str]) -> None:
        for r in gw.registry.records():
            if r.id in dead:
                continue
            tokens[r.id] += 300.0 * 5
            r.stats = WorkerStats(
                num_running=8, num_waiting=0, generation_tokens_total=tokens[r.id], prompt_tokens_total=0.0
            )
            r.stats_at = clock.t

    scrape(set())
    ctl.build()
    out = []
    dead: set[str] = set()
    try:
        for cycle in range(12):
            if cycle == 2:
                dead = {"dec/w1", "dec/w2", "dec/w3"}
            for _ in range(3):
                clock.t += 5
                scrape(dead)
            d = await ctl.cycle()
            po = ctl.decisions[-1]["observation"]["pools"]["dec"]
            out.append((po["ready"], d.targets["dec"], d.reasons["dec"]))
    finally:
        await gw.stop()
    return out


def test_stale_worker_metrics_block_scale_in() -> None:
    seen = asyncio.run(_stale_fleet())
    assert [t for _, t, _ in seen] == [4] * 12  # before: 4 → 3 → 2 on three workers' unknown load
    assert all("signal incomplete: stale worker metrics in dec; no scale-in" in why for _, _, why in seen[2:])
    assert all("signal incomplete" not in why for _, _, why in seen[:2])


def test_incomplete_signal_allows_scale_up_but_not_scale_in() -> None:
    cfg = AutoscalerConfig(scale_down_window_s=0.0)
    spec = _spec("p", "m", max_replicas=16)
    idle = PoolObservation(ready=4, signal_complete=False)
    policy = MosaicAutoscaler([spec], cfg)
    assert [policy.decide(Observation(t, {"p": idle})).targets["p"] for t in (0.0, 1.0, 2.0)] == [4, 4, 4]
    complete = dataclasses.replace(idle, signal_complete=True)
    assert policy.decide(Observation(3.0, {"p": complete})).targets == {"p": 3}
    busy = PoolObservation(ready=1, decode_tokens_per_s=4000.0, signal_complete=False)
    assert MosaicAutoscaler([spec], cfg).decide(Observation(0.0, {"p": busy})).targets == {"p": 5}


def test_hpa_does_not_scale_in_on_an_incomplete_signal() -> None:
    spec = _spec("p", "m")
    po = PoolObservation(ready=4, gpu_utilization=0.1, signal_complete=False)
    assert HpaPolicy([spec], "gpu_utilization", 0.7).decide(Observation(0.0, {"p": po})).targets == {"p": 4}
    complete = dataclasses.replace(po, signal_complete=True)
    assert HpaPolicy([spec], "gpu_utilization", 0.7).decide(Observation(0.0, {"p": complete})).targets == {
        "p": 1
    }


# ------------------------------------------------------------------ 10. unhealthy workers
def test_unhealthy_workers_stop_counting_as_arriving_capacity_after_the_grace() -> None:
    async def run() -> list[tuple[int, int]]:
        clock = Clock()
        urls = [f"http://127.0.0.1:{9000 + i}" for i in range(3)]
        cfg = validate_config({"pools": [_pool("p", "L4", endpoints={"static": urls})]})
        gw = Gateway(cfg)
        gw.registry.sync_pool("p", [Endpoint(f"w{i}", u) for i, u in enumerate(urls)])
        recs = gw.registry.records()
        for r in recs:
            r.health_ok = True
        recs[2].health_ok = False  # crash-looping
        ctl = controller_for(
            cfg,
            gw.registry,
            gw.metrics.registry,
            managed=frozenset(),
            clock=clock,
            actuator_factory=lambda init: DryRunActuator(init),
            gateway=dict,
        )
        out = []
        try:
            for dt in (0.0, UNHEALTHY_GRACE_S - 1, 1.0):
                clock.t += dt
                po = ctl.reader.observe(clock.t, {}).pools["p"]
                out.append((po.ready, po.starting))
            pinned = ctl.reader.observe(clock.t, {"p": 3}).pools["p"]  # managed at 3: one of them broken
            out.append((pinned.ready, pinned.starting))
            assert ctl.reader.broken == {"p": 1}
        finally:
            await gw.stop()
        return out

    # before: (2, 1) forever
    assert asyncio.run(run()) == [(2, 1), (2, 1), (2, 0), (2, 0)]


# ------------------------------------------------------------------ 2. placement slots
async def _slot_cycles() -> tuple[list[tuple[int, int, int | None]], FakeAppsApi]:
    cfg = validate_config(
        {
            "pools": [_pool("dec")],
            "autoscaler": {
                "actuator": "kubernetes",
                "policy": "static:dec=3",
                "kubernetes": {"deployments": {"dec": "mosaic-dec"}},
                "nodes": {"nodes": [{"name": "a1", "gpu": "A100-80GB", "gpus": 4, "domain": "r1"}]},
            },
        }
    )
    gw = Gateway(cfg)
    api = FakeAppsApi(1, refuse=True)
    ctl = _kubernetes_controller(cfg, gw, api, {"dec": "mosaic-dec"}, namespace="llm")
    out = []
    try:
        for i in range(6):
            if i == 3:
                api.refuse = False  # RBAC fixed
            if i == 5:
                api.replicas = 2  # scaled by hand
            await ctl.cycle()
            d = ctl.decisions[-1]
            assert "shortfall" not in d["placement"]
            assert ctl.placement is not None
            out.append((i, d["placement"]["fleet"]["used_gpus"], len(ctl.placement.placer.instances("dec"))))
    finally:
        await gw.stop()
    return out, api


def test_refused_actions_leave_no_phantom_slots_and_slots_follow_the_real_count() -> None:
    seen, api = asyncio.run(_slot_cycles())
    # 403 for three cycles: one slot (the running replica), not 3 then 4 GPUs and a shortfall forever;
    # then 1 → 3 applied; then the Deployment scaled to 2 by hand and back to 3 by the static policy
    assert [(i, used) for i, used, _ in seen] == [(0, 1), (1, 1), (2, 1), (3, 3), (4, 3), (5, 3)]
    assert [n for _, _, n in seen] == [1, 1, 1, 3, 3, 3]
    assert api.replicas == 3


def test_reconcile_releases_slots_beyond_the_real_count() -> None:
    cfg = validate_config(
        {
            "pools": [_pool("dec")],
            "autoscaler": {
                "actuator": "dry-run",
                "nodes": {"nodes": [{"name": "a1", "gpu": "A100-80GB", "gpus": 4, "domain": "r1"}]},
            },
        }
    )
    gw = Gateway(cfg)
    ctl = controller_for(
        cfg, gw.registry, gw.metrics.registry, managed=frozenset({"dec"}), actuator_factory=DryRunActuator
    )
    book = ctl.placement
    assert book is not None
    book.seed({"dec": 4}, lambda pool: False)
    assert len(book.placer.instances("dec")) == 4
    book.reconcile({"dec": 1}, lambda pool: False)
    assert len(book.placer.instances("dec")) == 1
    asyncio.run(gw.stop())


# ------------------------------------------------------------------ 4. unmapped and unreadable pools pinned
def test_unmapped_kubernetes_pools_are_pinned_at_their_observed_count() -> None:
    async def run() -> tuple[Any, ...]:
        def kpool(name: str, gpu: str) -> dict[str, Any]:
            return {
                "name": name,
                "model": "llama-3-8b",
                "gpu": gpu,
                "role": "mixed",
                "min_replicas": 1,
                "max_replicas": 8,
                "endpoints": {"kubernetes": {"label_selector": f"app={name}", "domain_label": None}},
            }

        deployments = {"managed-l4": "mosaic-managed-l4"}
        cfg = validate_config(
            {
                "pools": [kpool("managed-l4", "L4"), kpool("other-h100", "H100-SXM")],
                "autoscaler": {
                    "actuator": "kubernetes",
                    "policy": "mosaic",
                    "kubernetes": {"deployments": deployments},
                },
            }
        )
        gw = Gateway(cfg)
        api = FakeAppsApi(replicas=1)
        ctl = _kubernetes_controller(cfg, gw, api, deployments)
        inner = ctl.reader.observe

        def observe(now: float, desired: dict[str, int]) -> Observation:
            obs = inner(now, desired)
            pools = dict(obs.pools)
            pools["managed-l4"] = dataclasses.replace(pools["managed-l4"], ready=1, decode_tokens_per_s=900.0)
            pools["other-h100"] = dataclasses.replace(
                pools["other-h100"], ready=1, decode_tokens_per_s=7000.0
            )
            return dataclasses.replace(obs, pools=pools)

        ctl.reader = SimpleNamespace(observe=observe)  # type: ignore[assignment]
        try:
            d = await ctl.cycle()
        finally:
            await gw.stop()
        other = next(s for s in ctl.specs if s.name == "other-h100")
        return d.targets, (other.min_replicas, other.max_replicas), api.replicas

    targets, bounds, replicas = asyncio.run(run())
    # before: other-h100 had free bounds 1..8: the policy bought 1 → 2 there (never applied) and nothing
    # in the managed pool; now it is pinned at its 1 and the managed L4 pool buys the capacity
    assert bounds == (1, 1)
    assert targets == {"managed-l4": 5, "other-h100": 1}
    assert replicas == 5


async def _unreadable(status: int) -> tuple[AutoscalerController, Gateway, FakeAppsApi]:
    cfg = validate_config(
        {
            "pools": [_pool("dec")],
            "autoscaler": {
                "actuator": "kubernetes",
                "policy": "mosaic",
                "kubernetes": {"deployments": {"dec": "mosaic-dec"}},
            },
        }
    )
    gw = Gateway(cfg)
    api = FakeAppsApi(2)
    ctl = _kubernetes_controller(cfg, gw, api, {"dec": "mosaic-dec"}, namespace="llm", offload=True)
    await ctl.cycle()  # read fine: 2 replicas known
    api.unreadable = status
    return ctl, gw, api


@pytest.mark.parametrize(("status", "reason"), [(403, "Forbidden"), (404, "Not Found")])
def test_an_unreadable_replica_count_is_a_counted_failed_action_and_pins_the_pool(
    status: int, reason: str
) -> None:
    async def run() -> None:
        ctl, gw, api = await _unreadable(status)
        try:
            for _ in range(3):
                d = await ctl.cycle()
            g = gw.metrics.registry.get_sample_value
            assert g("mosaic_autoscaler_scale_errors_total", {"pool": "dec"}) == 3.0  # before: None
            assert ctl.decisions[-1]["actions"] == [
                {
                    "at": ctl.decisions[-1]["actions"][0]["at"],
                    "pool": "dec",
                    "before": 2,
                    "after": 2,
                    "applied": False,
                    "error": "replica count unreadable: reading deployments/mosaic-dec/scale in namespace llm: "
                    f"{status} {reason}",
                }
            ]
            # pinned at its last known count: the policy wants what it has, the gauge shows no phantom
            assert d.targets == {"dec": 2}
            assert g("mosaic_autoscaler_desired_replicas", {"pool": "dec"}) == 2.0
            assert [c for c in api.calls if c[0] == "patch"] == []
            assert ctl.decisions[-1]["observation"]["pools"]["dec"]["starting"] == 2
        finally:
            await gw.stop()

    asyncio.run(run())


# ------------------------------------------------------------------ 6. one Deployment, two pools
def test_a_deployment_mapped_to_two_pools_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(
            {
                "pools": [_pool("a", "L4"), _pool("b", "L4")],
                "autoscaler": {
                    "actuator": "kubernetes",
                    "kubernetes": {"deployments": {"a": "mosaic-l4", "b": "mosaic-l4"}},
                },
            }
        )
    assert str(err.value) == (
        "config: autoscaler.kubernetes.deployments.b: Deployment 'mosaic-l4' is already mapped by pool 'a'; "
        "each Deployment can scale one pool only"
    )


# ------------------------------------------------------------------ 7. embedded workers that cannot start
class _FailingSource:
    def __init__(self) -> None:
        self.workers = {0: object()}
        self.draining: set[int] = set()

    async def start_replica(self, cold_start_s: float) -> int:
        raise OSError("no free port")

    def endpoint_name(self, index: int) -> str:
        return f"sim-{index}"


class _Registry:
    async def resync(self, pool: str) -> None:
        return None

    def get(self, wid: str) -> None:
        return None


def test_an_embedded_worker_that_cannot_start_is_a_counted_warning(caplog: pytest.LogCaptureFixture) -> None:
    errors: list[str] = []

    async def run() -> tuple[Any, int]:
        act = EmbeddedActuator(
            {"p": _FailingSource()},  # type: ignore[dict-item]
            _Registry(),  # type: ignore[arg-type]
            on_error=errors.append,
        )
        action = act.scale("p", 3, 0.0)
        await act.settle()
        return action, act.replicas("p")

    with caplog.at_level(logging.WARNING, logger="mosaic.autoscaler"):
        action, replicas = asyncio.run(run())
    assert (action.before, action.after, action.applied) == (1, 3, True)
    assert replicas == 1
    assert errors == ["p"]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "pool p: scale-up to 3 stopped at 1: start_failed: no free port")
    ]


# ------------------------------------------------------------------ 11. absent signals cleared
def test_absent_signals_are_removed_from_the_signal_gauge() -> None:
    async def run() -> tuple[float | None, float | None]:
        cfg = validate_config({"pools": [_pool("dec")], "autoscaler": {"actuator": "dry-run"}})
        gw = Gateway(cfg)
        registry = CollectorRegistry()
        ctl = controller_for(
            cfg,
            gw.registry,
            registry,
            managed=frozenset({"dec"}),
            actuator_factory=DryRunActuator,
            gateway=dict,
        )
        pools = {"dec": PoolObservation(ready=1)}
        ctl._record(Observation(0.0, pools, ttft_p90_s=0.5), ScalingDecision(0.0, {"dec": 1}), [])
        first = registry.get_sample_value("mosaic_autoscaler_signal", {"name": "ttft_p90_s"})
        ctl._record(Observation(1.0, pools), ScalingDecision(1.0, {"dec": 1}), [])
        second = registry.get_sample_value("mosaic_autoscaler_signal", {"name": "ttft_p90_s"})
        await gw.stop()
        return first, second

    assert asyncio.run(run()) == (0.5, None)  # before: 0.5 kept


# ------------------------------------------------------------------ 12. another scaler on the Deployment
def test_a_count_changed_by_another_scaler_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    api = FakeAppsApi(2)
    act = KubernetesActuator(api, "ns", {"dec": "mosaic-dec"})
    with caplog.at_level(logging.WARNING, logger="mosaic.autoscaler"):
        assert act.replicas("dec") == 2
        api.replicas = 5  # an HPA scaled it between the read and the patch
        assert act.scale("dec", 3, 0.0).before == 5
        api.replicas = 4  # and again between cycles
        assert act.replicas("dec") == 4
        act.scale("dec", 4, 0.0)
        assert act.replicas("dec") == 4  # nobody else changed it: no warning
    assert [r.getMessage() for r in caplog.records] == [
        "autoscaler: pool dec: its Deployment changed from 2 to 5 since this cycle's read (another scaler on "
        "it?); patching it to 3 overwrites that",
        "autoscaler: pool dec: its Deployment holds 4 replicas, the autoscaler last set 3: something else "
        "scales it (an HPA, kubectl scale?); the next patch overwrites it",
    ]


@dataclasses.dataclass
class _Wants:
    """A policy that asks for the same count of every pool, whatever its bounds."""

    count: int

    def decide(self, obs: Observation) -> ScalingDecision:
        return ScalingDecision(obs.now, dict.fromkeys(obs.pools, self.count))


@pytest.mark.parametrize(
    ("wants", "start", "patched"),
    [
        pytest.param(100, 2, 8, id="over max_replicas → max (was patched to 100)"),
        pytest.param(0, 2, 2, id="under min_replicas → no scale-in (was 0)"),
    ],
)
def test_the_controller_keeps_any_policys_targets_within_the_pool_bounds(
    wants: int, start: int, patched: int
) -> None:
    """Whatever the policy asks (a `static:` count is refused outside the bounds when the config loads, but
    the controller must not rely on every policy honouring them), the actuator gets a target within them."""

    async def run() -> int:
        deployments = {"managed-l4": "mosaic-managed-l4"}
        pool = {
            "name": "managed-l4",
            "model": "llama-3-8b",
            "gpu": "L4",
            "role": "mixed",
            "min_replicas": 2,
            "max_replicas": 8,
            "endpoints": {"kubernetes": {"label_selector": "app=l4", "domain_label": None}},
        }
        cfg = validate_config(
            {
                "pools": [pool],
                "autoscaler": {
                    "actuator": "kubernetes",
                    "policy": "mosaic",
                    "kubernetes": {"deployments": deployments},
                },
            }
        )
        gw = Gateway(cfg)
        api = FakeAppsApi(replicas=start)
        ctl = _kubernetes_controller(cfg, gw, api, deployments)
        ctl.build()
        ctl.policy = _Wants(wants)  # type: ignore[assignment]
        try:
            await ctl.cycle()
        finally:
            await gw.stop()
        return api.replicas

    assert asyncio.run(run()) == patched


@pytest.mark.parametrize("count", [0, 9])
def test_static_counts_outside_the_pool_bounds_are_refused_at_load(count: int) -> None:
    """`static:pool=N` outside the pool's min_replicas..max_replicas (2..8) is one line at load, exit 2 for
    the CLI (it loaded, and the controller patched the Deployment to N)."""
    pool = {**_pool("dec"), "min_replicas": 2, "max_replicas": 8}
    with pytest.raises(ConfigError) as caught:
        validate_config(
            {"pools": [pool], "autoscaler": {"actuator": "dry-run", "policy": f"static:dec={count}"}}
        )
    assert f"({count}) is outside its min_replicas..max_replicas (2..8)" in str(caught.value)
