"""A compression worker's reservation holds its prefill peak until the stream's first token, whatever API
streams it: a Responses stream opens with `response.created` (and three more events) before the engine has
run, and the gateway dropped the transient prefill pages there, under-reserving the worker for the whole
prefill (~1.1 s here), the very window the peak covers. Real sockets, one simulated L4 at model time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from server.config import validate_config
from server.gateway import Gateway
from tests.gateway.serverkit import GatewayThread
from tests.kv.kvkit import simulated_l4_pool

FIX = Path(__file__).parent / "fixtures"
PROMPT = "hello " * 3000  # ≈ 4,500 tokens: ~1.1 s of prefill on an L4 at time scale 1


def _config() -> Any:
    pool = {**simulated_l4_pool(), "endpoints": {"simulated": {"replicas": 1, "time_scale": 1.0, "seed": 20}}}
    return validate_config(
        {
            "pools": [pool],
            "kv": {
                "enabled": True,
                "compression": [
                    {
                        "pool": "l4",
                        "profile": str(FIX / "samples.json"),
                        "heads_per_group": 2,
                        "prefill_chunk": 256,
                    }
                ],
            },
            "limits": {"queue_deadline_s": 10},
        }
    )


def _reservations(gw: GatewayThread) -> list[tuple[int, bool]]:
    async def read(g: Gateway) -> list[tuple[int, bool]]:
        assert g.ledger is not None
        return [(r.units, r.prefilled) for r in g.ledger.active()]

    return gw.call(read(gw.gateway))


@pytest.mark.parametrize(
    ("path", "body", "first_token"),
    [
        pytest.param(
            "/v1/responses",
            {"input": PROMPT, "max_output_tokens": 16},
            "event: response.output_text.delta",
            id="responses",
        ),
        pytest.param(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16},
            "data: ",
            id="chat",
        ),
    ],
)
def test_the_prefill_peak_is_held_until_the_first_token(
    path: str, body: dict[str, Any], first_token: str
) -> None:
    with GatewayThread(_config()) as gw, httpx.Client(base_url=gw.url, timeout=60) as http:
        before: list[list[tuple[int, bool]]] = []
        after: list[tuple[int, bool]] | None = None
        with http.stream("POST", path, json={"model": "llama-3-8b", "stream": True, **body}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():  # read to the end (the gateway then releases at once)
                if after is not None:
                    continue
                if line.startswith(first_token):
                    after = _reservations(gw)
                elif line.startswith(("event: ", "data: ")):  # an opening event: prefill has not run yet
                    before.append(_reservations(gw))
    assert path != "/v1/responses" or len(before) >= 4  # created, in_progress, output_item, content_part
    assert all(held == before[0] and [p for _, p in held] == [False] for held in before)
    assert after is not None and len(after) == 1 and after[0][1] is True
    if before:
        assert after[0][0] < before[0][0][0]  # the transient prefill pages dropped at the first token
