"""Scale from zero with a real vLLM: a `launch: vllm` pool at zero replicas under the embedded autoscaler.
The first request waits in the admission queue, its arrival makes the policy start one vLLM (CPU build,
tiny model), and the request is answered once that server is up. (With the only pool at zero the router's
reject is `no_workers`/`empty_pool`, both retryable; the cases only `empty_pool` holds — decode at zero
behind a running prefill pool, one model at zero beside another's workers — are tested with simulated
workers in tests/autoscaling/test_scale_from_zero_live.py and tests/scheduler/routing/test_profiles.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import vllm_env
from gateway_harness import MosaicGateway, launch_endpoints, static_config

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


def test_a_request_to_a_pool_at_zero_is_held_until_its_vllm_is_up(tmp_path: Path) -> None:
    reason = vllm_env.missing_reason()
    if reason is not None:
        pytest.skip(reason)
    config = static_config(
        vllm_env.SERVED_MODEL_NAME,
        [],
        pool="launched",
        extra={
            "autoscaler": {"enabled": True, "actuator": "embedded", "interval_s": 1.0},
            "limits": {"queue_deadline_s": 500},
        },
    )
    pool = config["pools"][0]
    pool.update({"min_replicas": 0, "max_replicas": 1})
    pool["endpoints"] = launch_endpoints(tmp_path / "vllm-logs", replicas=0)
    with MosaicGateway(config, tmp_path) as gateway:
        gateway.wait_ready()
        assert gateway.admin_get("/admin/workers")["workers"] == []  # nothing launched yet
        started = time.monotonic()
        with gateway.target(vllm_env.SERVED_MODEL_NAME).openai() as client:
            resp = client.with_options(timeout=540, max_retries=0).completions.create(
                model=vllm_env.SERVED_MODEL_NAME,
                prompt=[7, 8, 9],
                max_tokens=4,
                extra_body={"ignore_eos": True},
            )
        waited_s = time.monotonic() - started
        assert resp.usage is not None and resp.usage.completion_tokens == 4
        # held for a decision and a real vLLM start, not answered at once
        assert waited_s > 2.0
        decisions = gateway.admin_get("/admin/autoscaler")["decisions"]
        assert any(d["targets"].get("launched") == 1 for d in decisions)
    print(f"\nscale from zero: answered after {waited_s:.1f} s (decision + vLLM start)")
