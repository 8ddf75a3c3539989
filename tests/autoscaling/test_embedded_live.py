"""The embedded actuator in a live gateway (real HTTP on 127.0.0.1, simulated workers at a high time scale):
the Mosaic policy scales a pool up under load and back down after it with every request served in full, and
a soft scale-in lets in-flight streams finish on the draining worker while new requests go elsewhere."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from server.config import validate_config
from server.runner import RunningGateway, start_gateway_server

MODEL = "llama-3-8b"


@dataclass(slots=True)
class StreamResult:
    status: int
    tokens: int  # completion tokens the usage chunk reports
    events: int  # text events relayed
    errors: int  # error events in the stream
    done: bool  # ended with [DONE]


async def stream(client: httpx.AsyncClient, max_tokens: int) -> StreamResult:
    body = {
        "model": MODEL,
        "prompt": "the quick brown fox " * 4,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    tokens = events = errors = 0
    done = False
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            chunk: dict[str, Any] = json.loads(data)
            errors += "error" in chunk
            events += bool(chunk.get("choices"))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        return StreamResult(resp.status_code, tokens, events, errors, done)


def _config(replicas: int, time_scale: float, **autoscaler: Any) -> Any:
    return validate_config(
        {
            "pools": [
                {
                    "name": "l4",
                    "model": MODEL,
                    "gpu": "L4",
                    "role": "mixed",
                    "max_num_seqs": 4,
                    "min_replicas": 1,
                    "max_replicas": 4,
                    "endpoints": {"simulated": {"replicas": replicas, "time_scale": time_scale, "seed": 3}},
                }
            ],
            "slo": {"tpot_ms": 100},
            "scrape": {"interval_s": 0.2, "stale_after_s": 2},
            "autoscaler": {"enabled": True, "actuator": "embedded", **autoscaler},
        }
    )


def _counts(running: RunningGateway) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in running.gateway.registry.records():
        out[rec.state().value] = out.get(rec.state().value, 0) + 1
    return out


# ---------------------------------------------------------------------------------------------- up and down


async def _up_and_down() -> dict[str, Any]:
    # One L4 worker holds 4 sequences (max_num_seqs): ≈ 4 / 69 ms ≈ 58 decode tokens/s within the 100 ms TPOT
    # SLO. Twelve clients keep ~8 requests queued, so demand (tokens/s + backlog) needs ≥ 2 workers.
    # The latency net's SLOs are loosened: at time scale 10 the gateway's own wall-clock jitter on a busy
    # test machine counts ten times in model time, and a breach blocks scale-in (the policy's own tests cover the net).
    cfg = _config(
        1,
        10.0,
        interval_s=0.5,
        cold_start_s=0.5,
        context_tokens=128,
        knobs={"scale_down_window_s": 2.0, "queue_drain_s": 2.0, "tpot_slo_s": 1.0, "ttft_slo_s": 30.0},
    )
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    results: list[StreamResult] = []
    peak_ready = 0
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            clients = 12
            stop_at: list[float] = [time.monotonic() + 5.0]

            async def worker(i: int) -> None:
                # client 0 keeps a trickle going through the scale-in; the others stop after the burst
                while time.monotonic() < (stop_at[0] if i else stop_at[0] + 60):
                    results.append(await stream(client, 16))

            tasks = [asyncio.create_task(worker(i)) for i in range(clients)]
            deadline = time.monotonic() + 22.0
            while time.monotonic() < deadline:
                counts = _counts(running)
                peak_ready = max(peak_ready, counts.get("ready", 0))
                if (
                    time.monotonic() > stop_at[0] + 1
                    and len(running.gateway.registry.records()) == 1
                    and peak_ready > 1
                ):
                    break  # scaled back in to one worker
                await asyncio.sleep(0.1)
            stop_at[0] = 0.0  # the trickle client stops too
            await asyncio.gather(*tasks)
        ctl = running.gateway.autoscaler
        assert ctl is not None and ctl.actuator is not None
        metric = running.gateway.metrics.registry.get_sample_value
        return {
            "results": results,
            "peak_ready": peak_ready,
            "final": _counts(running),
            "desired": ctl.actuator.replicas("l4"),
            "events": list(ctl.actuator.events),
            "outcomes": dict(running.gateway.dispatcher.outcomes),
            "up": metric("mosaic_autoscaler_scale_events_total", {"pool": "l4", "direction": "up"}) or 0.0,
            "down": metric("mosaic_autoscaler_scale_events_total", {"pool": "l4", "direction": "down"})
            or 0.0,
        }
    finally:
        await running.stop()


def test_embedded_actuator_scales_a_live_fleet_up_under_load_and_down_after_with_no_failed_request() -> None:
    out = asyncio.run(_up_and_down())
    results: list[StreamResult] = out["results"]
    assert len(results) > 50
    assert all(
        r.status == 200 and r.tokens == 16 and r.events == 16 and r.errors == 0 and r.done for r in results
    )
    assert out["outcomes"] == {"completed": len(results)}
    assert out["peak_ready"] >= 2 and out["up"] >= 1  # scaled out under load
    assert out["final"] == {"ready": 1} and out["desired"] == 1 and out["down"] >= 1  # and back in after it
    started = [e for e in out["events"] if e["event"] == "started"]
    stopped = [e for e in out["events"] if e["event"] == "stopped"]
    assert len(started) == len(stopped) >= 1
    assert not any(e["forced"] for e in stopped)  # every stop waited for an idle worker


# ---------------------------------------------------------------------------------------------- soft scale-in


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


async def _soft_scale_in() -> dict[str, Any]:
    cfg = _config(
        2, 4.0, interval_s=3600, drain_timeout_s=30
    )  # the loop never fires: the test drives the actuator
    running = await start_gateway_server(cfg, "127.0.0.1", 0)
    gw = running.gateway
    try:
        ctl = gw.autoscaler
        assert ctl is not None and ctl.actuator is not None
        act = ctl.actuator

        def events() -> list[dict[str, Any]]:
            return list(act.events)  # type: ignore[attr-defined]

        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            # Long streams until both workers hold one (the router may stack a few on one worker first).
            # 100 tokens at ≈ 69 ms per step ≈ 7 s of model time ≈ 1.7 s of wall time at time scale 4.
            long: list[asyncio.Task[StreamResult]] = []
            while not all(r.inflight_requests for r in gw.registry.records()) and len(long) < 6:
                long.append(asyncio.create_task(stream(client, 100)))
                await until(lambda: sum(r.inflight_requests for r in gw.registry.records()) == len(long))
            inflight = {r.id: r.inflight_requests for r in gw.registry.records()}
            act.scale("l4", 1, time.monotonic())  # every worker is busy: the one with fewer streams drains
            await until(lambda: any(e["event"] == "draining" for e in events()))
            victim = next(e["worker"] for e in events() if e["event"] == "draining")
            keeper = next(w for w in inflight if w != victim)
            await until(
                lambda: (rec := gw.registry.get(victim)) is not None and rec.state().value == "draining"
            )
            dispatched = {r.id: r.dispatched_total for r in gw.registry.records()}
            during = [await stream(client, 4) for _ in range(3)]
            after_short = {r.id: r.dispatched_total for r in gw.registry.records()}
            still_listed = gw.registry.get(victim) is not None
            results = [await t for t in long]
        await until(lambda: any(e["event"] == "stopped" for e in events()))
        await until(lambda: gw.registry.get(victim) is None)
        return {
            "inflight": inflight,
            "victim": victim,
            "keeper": keeper,
            "dispatched": dispatched,
            "after_short": after_short,
            "during": during,
            "still_listed": still_listed,
            "long": results,
            "events": events(),
            "workers": sorted(r.id for r in gw.registry.records()),
            "outcomes": dict(gw.dispatcher.outcomes),
        }
    finally:
        await running.stop()


def test_soft_scale_in_never_aborts_an_in_flight_stream() -> None:
    out = asyncio.run(_soft_scale_in())
    victim, keeper = out["victim"], out["keeper"]
    assert out["inflight"][victim] >= 1 and out["inflight"][keeper] >= 1  # the drained worker was streaming
    # while the victim drains, new requests all go to the other worker and the victim stays listed
    assert all(r.status == 200 and r.tokens == 4 for r in out["during"])
    assert out["after_short"][keeper] == out["dispatched"][keeper] + 3
    assert out["after_short"][victim] == out["dispatched"][victim]
    assert out["still_listed"]
    # every long stream ran to the end: all 100 tokens, no error event, [DONE]
    assert all(
        r.status == 200 and r.tokens == 100 and r.events == 100 and r.errors == 0 and r.done
        for r in out["long"]
    )
    stopped = [e for e in out["events"] if e["event"] == "stopped"]
    assert [(e["worker"], e["forced"]) for e in stopped] == [(victim, False)]
    assert stopped[0]["drained_s"] > 0.2  # it waited for its streams rather than stopping at once
    assert out["workers"] == [keeper]
    assert out["outcomes"] == {"completed": len(out["long"]) + 3}
