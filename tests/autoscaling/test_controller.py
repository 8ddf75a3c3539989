"""The controller apart from the embedded fleet: the dry-run actuator in a live gateway (decisions recorded,
nothing applied, metrics and `/admin/autoscaler`), and the kubernetes actuator's calls driven by the controller."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from kubernetes.client import ApiException

from placement.catalog import load_catalog
from scheduler.actuators.kubernetes import KubernetesActuator
from server.autoscaler_setup import controller_for
from server.config import MosaicConfig, validate_config
from server.gateway import Gateway
from server.runner import start_gateway_server

ADMIN = {"Authorization": "Bearer adm"}
USER = {"Authorization": "Bearer user"}


def simulated_config(**autoscaler: Any) -> MosaicConfig:
    return validate_config(
        {
            "pools": [
                {
                    "name": "l4",
                    "model": "llama-3-8b",
                    "gpu": "L4",
                    "role": "mixed",
                    "min_replicas": 1,
                    "max_replicas": 4,
                    "endpoints": {"simulated": {"replicas": 1, "time_scale": 50}},
                }
            ],
            "auth": {"api_keys": ["user"], "admin_keys": ["adm"]},
            "autoscaler": autoscaler,
        }
    )


async def _dry_run() -> dict[str, Any]:
    # interval 3600 s: the loop never fires on its own; the test runs cycles itself
    cfg = simulated_config(enabled=True, actuator="dry-run", policy="static:l4=3", interval_s=3600)
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    out: dict[str, Any] = {}
    try:
        ctl = running.gateway.autoscaler
        assert ctl is not None
        first = await ctl.cycle()
        second = await ctl.cycle()
        out["targets"] = [first.targets, second.targets]
        out["actions"] = list(ctl.actions)
        out["workers"] = len(running.gateway.registry.records())
        metric = running.gateway.metrics.registry.get_sample_value
        out["desired_metric"] = metric("mosaic_autoscaler_desired_replicas", {"pool": "l4"})
        out["up_events"] = metric("mosaic_autoscaler_scale_events_total", {"pool": "l4", "direction": "up"})
        out["starting"] = metric("mosaic_autoscaler_replicas", {"pool": "l4", "state": "starting"})
        out["cost"] = metric("mosaic_worker_cost_per_hour", {"worker": "l4/sim-0", "pool": "l4"})
        async with httpx.AsyncClient(base_url=running.url) as client:
            out["no_key"] = (await client.get("/admin/autoscaler")).status_code
            out["user_key"] = (await client.get("/admin/autoscaler", headers=USER)).status_code
            resp = await client.get("/admin/autoscaler", headers=ADMIN)
            out["admin"] = resp.status_code, resp.json()
            one = await client.get("/admin/autoscaler", params={"last": "1"}, headers=ADMIN)
            out["last_one"] = len(one.json()["decisions"])
            bad = [
                await client.get("/admin/autoscaler", params={"last": v}, headers=ADMIN) for v in ("0", "x")
            ]
            out["bad_last"] = [(r.status_code, r.json()["error"]["param"]) for r in bad]
    finally:
        await running.stop()
    return out


def test_dry_run_controller_records_decisions_applies_nothing_and_reports_them() -> None:
    out = asyncio.run(_dry_run())
    assert out["targets"] == [{"l4": 3}, {"l4": 3}]
    # one action: 1 → 3, not applied; the second cycle sees the dry-run's 3 (1 ready + 2 "starting") and stays
    assert [(a["before"], a["after"], a["applied"], a["error"]) for a in out["actions"]] == [
        (1, 3, False, None)
    ]
    assert out["workers"] == 1  # nothing was started
    assert (out["desired_metric"], out["up_events"], out["starting"]) == (3.0, 1.0, 2.0)
    assert out["cost"] == pytest.approx(
        load_catalog().gpu("L4").cost_per_hour
    )  # the catalog's $/GPU-h · tp 1
    assert (out["no_key"], out["user_key"]) == (401, 401)
    status, body = out["admin"]
    assert status == 200 and body["enabled"] is True
    assert body["config"]["policy"] == "static:l4=3" and body["config"]["actuator"] == "dry-run"
    assert body["managed_pools"] == ["l4"]
    assert body["pools"][0]["name"] == "l4" and body["pools"][0]["decode_tps_capacity"] > 0
    last = body["decisions"][-1]
    assert last["targets"] == {"l4": 3} and isinstance(last["reasons"]["l4"], str)
    assert last["observation"]["pools"]["l4"]["ready"] == 1 and "request_rate" in last["signals"]
    assert body["actions"][0]["applied"] is False and body["actions"][0]["after"] == 3
    assert len(body["decisions"]) == 2 and out["last_one"] == 1  # ?last=N: the newest N
    assert out["bad_last"] == [(400, "last"), (400, "last")]


async def _disabled() -> tuple[int, dict[str, Any]]:
    running = await start_gateway_server(simulated_config(), "127.0.0.1", 0)
    try:
        assert running.gateway.autoscaler is None
        async with httpx.AsyncClient(base_url=running.url) as client:
            resp = await client.get("/admin/autoscaler", headers=ADMIN)
            return resp.status_code, resp.json()
    finally:
        await running.stop()


def test_admin_endpoint_when_the_autoscaler_is_off() -> None:
    status, body = asyncio.run(_disabled())
    assert status == 200 and body["enabled"] is False and body["config"]["enabled"] is False


class FakeAppsApi:
    """AppsV1Api's scale subresource, recording calls; `refuse` makes patches fail like the API server."""

    def __init__(self, replicas: int, refuse: bool = False) -> None:
        self.replicas = replicas
        self.refuse = refuse
        self.calls: list[tuple[Any, ...]] = []

    def read_namespaced_deployment_scale(
        self, name: str, namespace: str, _request_timeout: Any = None
    ) -> Any:
        self.calls.append(("read", name, namespace))
        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas))

    def patch_namespaced_deployment_scale(
        self,
        name: str,
        namespace: str,
        body: dict[str, Any],
        field_manager: str | None = None,
        _request_timeout: Any = None,
    ) -> Any:
        self.calls.append(("patch", name, namespace, body))
        if self.refuse:
            raise ApiException(status=403, reason="Forbidden")
        self.replicas = body["spec"]["replicas"]
        return None


async def _kubernetes(api: FakeAppsApi) -> tuple[list[Any], float, float | None]:
    cfg = validate_config(
        {
            "pools": [
                {
                    "name": "dec",
                    "model": "llama-3-8b",
                    "gpu": "A100-80GB",
                    "role": "mixed",
                    "max_replicas": 8,
                    "endpoints": {"static": ["http://127.0.0.1:9"]},
                }
            ],
            "autoscaler": {
                "actuator": "kubernetes",
                "policy": "static:dec=3",
                "kubernetes": {"deployments": {"dec": "mosaic-dec"}},
            },
        }
    )
    gw = Gateway(cfg)
    try:
        ctl = controller_for(
            cfg,
            gw.registry,
            gw.metrics.registry,
            managed=frozenset({"dec"}),
            offload=True,
            actuator_factory=lambda initial: KubernetesActuator(api, "llm", {"dec": "mosaic-dec"}),
        )
        # the pool's series exists before any failure: Prometheus' increase() would miss its first step
        before = gw.metrics.registry.get_sample_value("mosaic_autoscaler_scale_errors_total", {"pool": "dec"})
        await ctl.cycle()
        await ctl.cycle()
        errors = (
            gw.metrics.registry.get_sample_value("mosaic_autoscaler_scale_errors_total", {"pool": "dec"})
            or 0.0
        )
        return list(ctl.actions), errors, before
    finally:
        await gw.stop()


def test_controller_patches_the_deployment_scale_once_then_holds() -> None:
    api = FakeAppsApi(replicas=1)
    actions, errors, _ = asyncio.run(_kubernetes(api))
    # cycle 1: read (desired), read (actuator's before), patch → 3; cycle 2: read → 3 = target, nothing to do
    assert api.calls == [
        ("read", "mosaic-dec", "llm"),
        ("read", "mosaic-dec", "llm"),
        ("patch", "mosaic-dec", "llm", {"spec": {"replicas": 3}}),
        ("read", "mosaic-dec", "llm"),
    ]
    assert [(a["before"], a["after"], a["applied"]) for a in actions] == [(1, 3, True)] and errors == 0


def test_a_refused_patch_is_recorded_and_retried_next_cycle() -> None:
    api = FakeAppsApi(replicas=1, refuse=True)
    actions, errors, before = asyncio.run(_kubernetes(api))
    assert [(a["before"], a["after"], a["applied"], a["error"]) for a in actions] == [
        (1, 1, False, "patching deployments/mosaic-dec/scale in namespace llm to 3 replicas: 403 Forbidden")
    ] * 2
    assert (before, errors) == (0.0, 2.0)
