"""The ejection limit against a real vLLM bug: vLLM 0.32 answers a streamed completion with `n` > 1, `echo`
and `logprobs` with a 500 error event (a `KeyError` in its serving code), on any server. One client sending it
a few times ejected every worker of the model (the next client's request: 503 after the queue deadline);
`health.max_ejection_percent` keeps one of two in rotation. Two workers: the session's server under two URLs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from conftest import RealServer, gateway_available
from gateway_harness import API_KEY, MosaicGateway, static_config

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(300)]

POISON = {"max_tokens": 3, "n": 2, "echo": True, "logprobs": 1, "stream": True, "temperature": 1.0}


@pytest.mark.parametrize(("percent", "after"), [(50, 200), (100, 503)])
def test_a_request_that_fails_on_every_worker_leaves_the_model_in_service(
    real_vllm: RealServer, tmp_path_factory: pytest.TempPathFactory, percent: int, after: int
) -> None:
    """The bug is vLLM's `KeyError` on a token missing from a step's top logprobs, which depends on what was
    sampled: 5 to 10 in 10 such requests fail, and a success resets a worker's count, as any request's does.
    With `failure_threshold` 1 the order of successes does not matter: the client sends it up to 60 times,
    until both workers are out (without the limit; the next request then waits out its queue deadline, 503) or
    every one of the 60 was sent (with it: one worker stays in and serves the next request)."""
    reason = gateway_available()
    if reason is not None:
        pytest.skip(reason)
    urls = [real_vllm.url, real_vllm.url.replace("127.0.0.1", "localhost")]
    extra: dict[str, Any] = {
        "routing": {"policy": "round-robin"},
        "health": {"failure_threshold": 1, "open_s": 300.0, "max_ejection_percent": percent},
        "limits": {"connect_timeout_s": 15.0, "queue_deadline_s": 2.0},
    }
    config = static_config(real_vllm.model, urls, extra=extra)
    with MosaicGateway(config, tmp_path_factory.mktemp("mosaic-ejection")) as gateway:
        gateway.wait_ready()
        gateway.wait_worker_scraped()
        headers = {"authorization": f"Bearer {API_KEY}"}
        failed = 0
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as http:
            for i in range(60):
                body = {"model": real_vllm.model, "prompt": f"poison {i}", **POISON}
                resp = http.post("/v1/completions", json=body)
                if resp.status_code == 503:  # every worker ejected: the queue deadline passed
                    break
                assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
                failed += '"error"' in resp.text  # vLLM's error event, relayed
            normal = http.post(
                "/v1/completions", json={"model": real_vllm.model, "prompt": "hi", "max_tokens": 3}
            )
        workers = gateway.admin_get("/admin/workers")["workers"]
    assert failed >= 2
    ejected = sum(w["breaker"]["state"] != "closed" for w in workers)
    overflows = sum(w["breaker"]["overflows"] for w in workers)
    assert (ejected, normal.status_code) == ((1, 200) if percent == 50 else (2, 503))
    assert overflows >= 1 if percent == 50 else overflows == 0
