"""The live gateway's fleet view carries each embedded worker's network domain from the node the
embedded actuator placed it on, which the router's pd-domain-affinity reads."""

from __future__ import annotations

import asyncio
from typing import Any

from server.config import validate_config
from server.runner import start_gateway_server
from tests.autoscaling.test_topology_live import pd_config


async def _scale_up_and_route() -> dict[str, Any]:
    running = await start_gateway_server(
        validate_config(pd_config("static:prefill=2,decode=3")), "127.0.0.1", 0
    )
    try:
        ctl = running.gateway.autoscaler
        assert ctl is not None
        ctl.build()
        await ctl.cycle()
        await ctl.actuator.by_pool["decode"].settle()  # type: ignore[union-attr]
        registry = running.gateway.registry
        await asyncio.gather(registry.resync("prefill"), registry.resync("decode"))
        return {"domains": {w.id: w.domain for w in registry.view().workers}}
    finally:
        await running.stop()


def test_embedded_workers_are_listed_with_their_nodes_domain() -> None:
    out = asyncio.run(_scale_up_and_route())
    # the running 1 + 1 sit in rack-a; the decision's new 1 P + 2 D in rack-b (test_topology_live)
    assert out["domains"] == {
        "prefill/sim-0": "rack-a",
        "prefill/sim-1": "rack-b",
        "decode/sim-0": "rack-a",
        "decode/sim-1": "rack-b",
        "decode/sim-2": "rack-b",
    }
