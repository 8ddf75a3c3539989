"""`launch: vllm` pools: GPU assignment without overlap, ports, scale up/down, the autoscaler actuator.

Processes are real (a stand-in `vllm serve` from fixtures/fake_vllm.py that reports the argv and environment
the launcher gave it), so spawning, /health, SIGTERM and reaping are exercised without a GPU or vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from server.vllm_launcher import LaunchError, VllmLaunchSpec
from server.vllm_pool import GpuAllocator, VllmActuator, VllmPoolLauncher, free_port_block, pool_template

FAKE_VLLM = (sys.executable, str(Path(__file__).parent / "fixtures" / "fake_vllm.py"))


def launch_info(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/launch", timeout=10) as resp:
        return dict(json.loads(resp.read()))


def template(role: str = "prefill", tp: int = 2, dp: int = 1) -> VllmLaunchSpec:
    return pool_template(
        model="/models/llama-3-8b",
        served_model_name="llama-3-8b",
        role=role,
        tp=tp,
        dp=dp,
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        vllm_command=FAKE_VLLM,
    )


@pytest.mark.parametrize(
    ("requests", "expected"),
    [
        pytest.param(
            [("a", 2), ("b", 2)], {"a": ("0", "1"), "b": ("2", "3")}, id="two TP2 replicas → GPUs 0,1 and 2,3"
        ),
        pytest.param(
            [("a", 1), ("b", 2), ("c", 1)],
            {"a": ("0",), "b": ("1", "2"), "c": ("3",)},
            id="mixed sizes fill free ids in configured order",
        ),
    ],
)
def test_allocator_assigns_free_ids_in_configured_order_without_overlap(
    requests: list[tuple[str, int]], expected: dict[str, tuple[str, ...]]
) -> None:
    alloc = GpuAllocator(["0", "1", "2", "3"])
    got = {owner: alloc.allocate(owner, n) for owner, n in requests}
    assert got == expected
    assert alloc.free == ()


def test_allocator_refuses_shortfall_and_reuses_released() -> None:
    alloc = GpuAllocator(["0", "1", "2"])
    alloc.allocate("a", 2)
    with pytest.raises(LaunchError, match=r"b needs 2 GPU\(s\), 1 free of 3 \(in use: 0→a, 1→a\)"):
        alloc.allocate("b", 2)
    assert alloc.release("a") == ("0", "1")
    assert alloc.allocate("b", 2) == ("0", "1")
    with pytest.raises(ValueError, match="listed twice"):
        GpuAllocator(["0", "0"])


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")], ids=["A first", "B first"])
def test_allocator_leaves_other_pools_the_gpus_only_they_may_use(order: tuple[str, str]) -> None:
    """Pool A may use GPUs 0,1 and pool B only 0, one GPU per replica: taking the lowest id, A would take 0 and
    B could not start although A on 1 and B on 0 fit. Either start order fits."""
    among = {"a": ("0", "1"), "b": ("0",)}
    alloc = GpuAllocator(["0", "1"], pools=among)
    got = {pool: alloc.allocate(f"{pool}-1", 1, among[pool]) for pool in order}
    assert got == {"a": ("1",), "b": ("0",)}


def test_allocator_prefers_least_contended_gpus_ties_in_configured_order() -> None:
    # contenders: GPUs 0 and 1 → a, b, c; 2 and 3 → a, c (c lists no gpu_ids: it could use every GPU)
    pools: dict[str, list[str] | None] = {"a": ["0", "1", "2", "3"], "b": ["0", "1"], "c": None}

    def run() -> list[tuple[str, ...]]:
        alloc = GpuAllocator(["0", "1", "2", "3"], pools=pools)
        assert [alloc.contenders(g) for g in alloc.gpu_ids] == [3, 3, 2, 2]
        got = [alloc.allocate("a-1", 2, pools["a"])]  # the two only b cannot use
        got.append(alloc.allocate("a-2", 1, pools["a"]))  # 0 and 1 tie: configured order
        got.append(alloc.allocate("c-1", 1))
        alloc.release("a-1")
        got.append(alloc.allocate("c-2", 2))  # 2 and 3 again, in configured order: adjacent for a TP group
        return got

    assert run() == [("2", "3"), ("0",), ("1",), ("2", "3")]
    assert run() == run()  # deterministic: the same config and starts give the same GPUs


def test_a_pool_without_gpu_ids_contends_for_every_gpu() -> None:
    alloc = GpuAllocator(["0", "1", "2"])
    assert [alloc.contenders(g) for g in alloc.gpu_ids] == [0, 0, 0]
    alloc.register("any", None)
    alloc.register("two", ["2"])
    assert [alloc.contenders(g) for g in alloc.gpu_ids] == [1, 1, 2]
    alloc.register("two", ["1"])  # registering a pool again replaces its set
    assert [alloc.contenders(g) for g in alloc.gpu_ids] == [1, 2, 1]
    assert alloc.allocate("any-1", 2) == ("0", "2")  # 1 is the one "two" can use
    with pytest.raises(LaunchError, match=r"x needs 2 GPU\(s\), 1 free of 3 \(in use: 0→any-1, 2→any-1\)"):
        alloc.allocate("x", 2)


def test_free_port_block_is_bindable() -> None:
    base = free_port_block(4)
    assert 1024 <= base <= 65535 - 3


def _wait_stopped(pool: VllmPoolLauncher, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pool.reap() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.reap() == 0


def test_prefill_pool_scales_on_disjoint_gpus(tmp_path: Path) -> None:
    alloc = GpuAllocator(["0", "1", "2", "3"])
    pool = VllmPoolLauncher("prefill-h100", template("prefill", tp=2), alloc, tmp_path, stop_grace_s=10)
    actuator = VllmActuator({"prefill-h100": pool})
    try:
        action = actuator.scale("prefill-h100", 2, now=5.0)
        assert (action.before, action.after, action.applied) == (0, 2, True)
        infos = []
        for replica in pool.replicas:
            pool.wait_ready(replica, timeout_s=30)
            infos.append(launch_info(replica.url))
        assert [i["env"]["CUDA_VISIBLE_DEVICES"] for i in infos] == ["0,1", "2,3"]  # type: ignore[index]
        side_ports = [int(i["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for i in infos]  # type: ignore[index]
        assert abs(side_ports[0] - side_ports[1]) >= 2  # TP2: each replica owns base and base + 1
        argv = infos[0]["argv"]
        assert (
            argv[argv.index("--kv-transfer-config") + 1]
            == '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
        )  # type: ignore[union-attr,index]
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"  # type: ignore[union-attr,index]

        # A third TP2 replica needs 2 more GPUs: none free → not applied, the two running stay.
        action = actuator.scale("prefill-h100", 3, now=6.0)
        assert action.applied is False and action.after == 2
        assert "needs 2 GPU(s), 0 free of 4" in (action.error or "")
        assert actuator.replicas("prefill-h100") == 2

        # Scale down stops the newest; its GPUs come back once it has exited.
        action = actuator.scale("prefill-h100", 1, now=7.0)
        assert (action.before, action.after, action.applied) == (2, 1, True)
        _wait_stopped(pool)
        assert alloc.free == ("2", "3")
        assert [r.gpu_ids for r in pool.replicas] == [("0", "1")]
    finally:
        pool.stop_all()
    assert alloc.free == ("0", "1", "2", "3")


def test_data_parallel_replicas_get_tp_times_dp_gpus_and_side_channel_ports(tmp_path: Path) -> None:
    alloc = GpuAllocator([str(g) for g in range(8)])
    pool = VllmPoolLauncher("decode-dp", template("decode", tp=2, dp=2), alloc, tmp_path, stop_grace_s=10)
    try:
        started, _ = pool.scale_to(2)
        infos = []
        for replica in started:
            pool.wait_ready(replica, timeout_s=30)
            infos.append(launch_info(replica.url))
        # Two engines of two GPUs each: four per replica, all visible to its one server.
        assert [r.gpu_ids for r in started] == [("0", "1", "2", "3"), ("4", "5", "6", "7")]
        assert [i["env"]["CUDA_VISIBLE_DEVICES"] for i in infos] == ["0,1,2,3", "4,5,6,7"]  # type: ignore[index]
        argv: list[str] = infos[0]["argv"]  # type: ignore[assignment]
        at = argv.index("--tensor-parallel-size")
        assert argv[at : at + 4] == ["--tensor-parallel-size", "2", "--data-parallel-size", "2"]
        # Ports reserved besides the server's: the side-channel block, tp × dp from the base vLLM is given
        # (engine r listens on base + r), so the two replicas' blocks do not overlap.
        for replica, info in zip(started, infos, strict=True):
            base = int(info["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"])  # type: ignore[index]
            assert replica.ports[1:] == tuple(range(base, base + 4))
        blocks = [set(r.ports[1:]) for r in started]
        assert not blocks[0] & blocks[1]

        # A third replica needs tp × dp = 4 more GPUs: none free → refused.
        with pytest.raises(LaunchError, match=r"decode-dp-3 needs 4 GPU\(s\), 0 free of 8"):
            pool.scale_to(3)
    finally:
        pool.stop_all()
    assert alloc.free == tuple(str(g) for g in range(8))


def test_unknown_pool_is_reported_not_raised() -> None:
    action = VllmActuator({}).scale("nope", 2, now=1.0)
    assert action.applied is False and action.error == "pool 'nope' is not launched here"


def test_cpu_mixed_pool_without_gpus(tmp_path: Path) -> None:
    pool = VllmPoolLauncher("cpu", template("mixed", tp=1), GpuAllocator([]), tmp_path, use_gpus=False)
    try:
        (replica,) = pool.scale_to(1)[0]
        pool.wait_ready(replica, timeout_s=30)
        info = launch_info(replica.url)
        # No GPU assignment (CUDA_VISIBLE_DEVICES as inherited) and no NIXL side channel for a mixed worker.
        assert info["env"] == {
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": None,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": None,
        }
        assert "--kv-transfer-config" not in info["argv"]  # type: ignore[operator]
    finally:
        pool.stop_all()
    assert pool.replicas == ()


def test_allocator_keeps_a_tp_group_adjacent_when_that_costs_no_fit() -> None:
    # contenders 1, 1, 1, 1 (only "a", no gpu_ids): least contended are 0 and 1 anyway
    alloc = GpuAllocator(["0", "1", "2", "3"], pools={"a": None})
    assert alloc.allocate("a-1", 1) == ("0",)
    # free 1, 2, 3 all equally contended: the lowest two would be 1 and 2, adjacent
    assert alloc.allocate("a-2", 2) == ("1", "2")
    # contenders 2, 1, 2, 1 ("b" may use 0 and 2): the least contended, 1 and 3, are not adjacent; no adjacent
    # run is as little contended, so fit wins over adjacency
    alloc = GpuAllocator(["0", "1", "2", "3"], pools={"a": None, "b": ["0", "2"]})
    assert alloc.allocate("a-1", 2) == ("1", "3")
    # contenders 1, 2, 1, 1, 1: the least contended 0, 2 are scattered, the run 2, 3 costs as little
    alloc = GpuAllocator(["0", "1", "2", "3", "4"], pools={"a": None, "b": ["1"]})
    assert alloc.allocate("a-1", 2) == ("2", "3")
