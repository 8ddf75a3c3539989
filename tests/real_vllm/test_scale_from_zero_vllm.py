"""Scale from zero with a real vLLM: a `launch: vllm` pool at zero replicas under the embedded autoscaler.
The first request waits in the admission queue, its arrival makes the policy start one vLLM (CPU build,
tiny model), the gateway routes to it once /health answers and reads its KV capacity from its metrics, the
request is answered once that server is up, and the launched vLLM stops when the gateway stops. (A pool
launched at start, `replicas: 1`, goes through the same launcher: test_launch_supervision.py runs it
with a stand-in `vllm serve`; one real start is enough here, each costs ~40 s on 2 cores.) (With the only
pool at zero the router's reject is `no_workers`/`empty_pool`, both retryable; the cases only `empty_pool` holds — decode at zero
behind a running prefill pool, one model at zero beside another's workers — are tested with simulated
workers in tests/autoscaling/test_scale_from_zero_live.py and tests/scheduler/routing/test_profiles.py.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import vllm_env
from gateway_harness import MosaicGateway, launch_endpoints, static_config

from server.vllm_launcher import health_ok, stop_pid

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
        (worker,) = gateway.admin_get("/admin/workers")["workers"]
        assert worker["pool"] == "launched"
        assert worker["stats"]["num_gpu_blocks"] == 16384 and worker["stats"]["block_size"] == 128
        vllm_url = worker["url"]
        assert health_ok(vllm_url)
    # Gateway stopped → its launched vLLM stopped with it.
    deadline = time.monotonic() + 60
    while health_ok(vllm_url) and time.monotonic() < deadline:
        time.sleep(0.5)
    if health_ok(vllm_url):  # do not leak a server (it runs in its own session) before failing
        port = vllm_url.rsplit(":", 1)[1]
        pids = subprocess.run(
            ["pgrep", "-f", "--", f"--port {port}"], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            stop_pid(int(pid), timeout_s=10)
        pytest.fail(f"launched vLLM at {vllm_url} still up after the gateway stopped")
    print(f"\nscale from zero: answered after {waited_s:.1f} s (decision + vLLM start)")
