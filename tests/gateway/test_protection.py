"""Auth, admin key, per-key rate limits and the admission queue, through the `openai` SDK over real sockets."""

from __future__ import annotations

import asyncio
import collections.abc
from typing import Any

import httpx
import openai
import pytest

from server.config import validate_config
from tests.gateway.serverkit import GatewayThread

MODEL = "llama-3-8b"


def _sim_pool(
    name: str = "l4", gpu: str = "L4", replicas: int = 1, time_scale: float = 200.0, **extra: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "model": MODEL,
        "gpu": gpu,
        "role": "mixed",
        "endpoints": {"simulated": {"replicas": replicas, "time_scale": time_scale}},
        **extra,
    }


@pytest.fixture(scope="module")
def secured() -> collections.abc.Iterator[GatewayThread]:
    cfg = validate_config(
        {
            "pools": [_sim_pool()],
            "auth": {"api_keys": ["sk-alice", "sk-bob"], "admin_keys": ["sk-admin"]},
            "limits": {"rate_limit": {"requests_per_s": 0.5, "burst": 2}},
        }
    )
    with GatewayThread(cfg) as thread:
        yield thread


def _client(gw: GatewayThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _chat(c: openai.OpenAI) -> Any:
    return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_api_key_required(secured: GatewayThread) -> None:
    with _client(secured, "sk-mallory") as c:
        with pytest.raises(openai.AuthenticationError) as err:
            _chat(c)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    with _client(secured, "sk-alice") as c:
        assert _chat(c).usage is not None


def test_rate_limit_per_key_with_retry_after(secured: GatewayThread) -> None:
    with _client(secured, "sk-bob") as c:
        _chat(c)
        _chat(c)  # burst of 2
        with pytest.raises(openai.RateLimitError) as err:
            _chat(c)  # refill 0.5/s: the third within a second is refused
        assert err.value.code == "rate_limit_exceeded"
        assert int(err.value.response.headers["retry-after"]) >= 1
    with _client(secured, "sk-admin") as c, pytest.raises(openai.AuthenticationError):
        _chat(c)  # an admin key is not an API key


@pytest.mark.parametrize(
    ("key", "status"),
    [
        pytest.param(None, 401, id="no key → 401"),
        pytest.param("sk-alice", 401, id="API key on /admin → 401"),
        pytest.param("sk-admin", 200, id="admin key → 200"),
    ],
)
def test_admin_endpoints_need_the_admin_key(secured: GatewayThread, key: str | None, status: int) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=secured.url, headers=headers) as http:
        for path in ("/admin/workers", "/admin/routing"):
            assert http.get(path).status_code == status


def test_admission_queue_full_and_deadline_are_429() -> None:
    """One L4 slot (max_num_seqs 1, at-capacity factor 1): one request runs, one waits, the rest are refused."""
    cfg = validate_config(
        {
            "pools": [_sim_pool(time_scale=2.0, max_num_seqs=1)],
            "routing": {"plugins": [{"type": "at-capacity", "params": {"inflight_factor": 1.0}}]},
            "limits": {"queue_size": 1, "queue_deadline_s": 0.4},
        }
    )

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {
                "model": MODEL,
                "prompt": [1] * 16,
                "max_tokens": 40,
                "ignore_eos": True,
            }  # ≈ 40 × 66 ms / 2 on an L4
            first = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)
            rest = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(3)]
            return [await first, *[await t for t in rest]]

    with GatewayThread(cfg) as gw:
        results = asyncio.run(burst(gw.url))
        statuses = sorted(r.status_code for r in results)
        assert statuses == [200, 429, 429, 429]
        codes = sorted(r.json()["error"]["code"] for r in results if r.status_code == 429)
        assert codes == [
            "queue_full",
            "queue_full",
            "queue_timeout",
        ]  # 1 waits out its deadline, 2 find it full
        assert all(int(r.headers["retry-after"]) >= 1 for r in results if r.status_code == 429)
        assert gw.metric("mosaic_rejections_total", reason="queue_full") == 2
