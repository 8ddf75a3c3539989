"""Pooling pools (embeddings, `runner: pooling`) are never the autoscaler's: its signal, decode tokens/s, is
one they never produce, so managing one would only ever scale it down (a reviewer saw `mosaic autoscale`
patch an embedding Deployment of 2 to 0 on its first cycle). Left unmanaged, they are pinned at their count."""

from __future__ import annotations

import asyncio
from typing import Any

from scheduler.actuators.kubernetes import KubernetesActuator
from server.autoscaler_setup import controller_for
from server.commands.autoscale import kubernetes_deployments, observer_config
from server.config import validate_config
from server.discovery import StaticSource
from server.gateway import Gateway
from tests.autoscaling.test_controller import FakeAppsApi


def _config(**autoscaler: Any) -> Any:
    def k8s(selector: str) -> dict[str, Any]:
        return {"kubernetes": {"label_selector": selector, "in_cluster": False}}

    return validate_config(
        {
            "models": [{"name": "llama-3-8b"}, {"name": "e5", "spec": "mistral-7b"}],
            "pools": [
                {
                    "name": "chat",
                    "model": "llama-3-8b",
                    "gpu": "L4",
                    "endpoints": k8s("app=chat"),
                    "max_replicas": 4,
                },
                {
                    "name": "embed",
                    "model": "e5",
                    "gpu": "L4",
                    "runner": "pooling",
                    "endpoints": k8s("app=embed"),
                },
            ],
            "autoscaler": {"enabled": True, **autoscaler},
        }
    )


def test_the_default_deployment_map_leaves_pooling_pools_out() -> None:
    assert kubernetes_deployments(_config(actuator="kubernetes")) == {"chat": "chat"}


def test_a_controller_given_a_pooling_pool_leaves_it_at_its_count() -> None:
    """Even when the caller hands it the pooling pool to manage (dry-run manages every pool), the controller
    does not: no read or patch of its Deployment, and it stays at the two replicas it has."""
    cfg = _config(actuator="kubernetes", policy="mosaic")
    deployments = {"chat": "chat", "embed": "embed"}
    api = FakeAppsApi(replicas=2)

    async def run() -> tuple[list[Any], list[Any], frozenset[str]]:
        sources = {
            "chat": StaticSource(["http://127.0.0.1:1"]),
            "embed": StaticSource(["http://127.0.0.1:2", "http://127.0.0.1:3"]),
        }
        gw = Gateway(observer_config(cfg), sources=sources)
        try:
            ctl = controller_for(
                cfg,
                gw.registry,
                gw.metrics.registry,
                managed=frozenset(deployments),
                offload=True,
                actuator_factory=lambda initial: KubernetesActuator(api, "llm", deployments, {}),
            )
            await ctl.cycle()
            return list(api.calls), list(ctl.actions), ctl.managed
        finally:
            await gw.stop()

    calls, actions, managed = asyncio.run(run())
    assert managed == frozenset({"chat"})
    assert not [c for c in calls if c[1] == "embed"]
    assert all(a["pool"] == "chat" for a in actions)
