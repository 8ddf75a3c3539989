"""`launch: vllm` pools under supervision: which GPUs and ports a replica gets, what environment vLLM sees,
what happens when the gateway dies or fails to start, when starts fail, crash or hang, and what the
controller-only `mosaic autoscale` does with such pools.

Unmarked (runs everywhere, no vLLM): processes are the stand-in `fixtures/fake_vllm.py`, which records its
argv, environment and pid (`FAKE_VLLM_OUT`) and can crash or hang (`FAKE_VLLM_MODE`). Every process a test
starts is stopped by the test, and the `spawned` fixture kills any the stand-in recorded that is still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from server.config import ConfigError, MosaicConfig, validate_config
from server.gateway import Gateway
from server.vllm_launcher import (
    LaunchError,
    VllmLaunchSpec,
    VllmProcess,
    build_command,
    build_env,
    default_advertise_host,
    free_port,
    health_ok,
)
from server.vllm_pool import (
    Backoff,
    GpuAllocator,
    LaunchVllmConfig,
    VllmActuator,
    VllmPoolLauncher,
    pool_template,
    reserved_ports,
)
from server.vllm_source import LaunchedPoolSource

REPO = Path(__file__).resolve().parents[2]
FAKE_SCRIPT = Path(__file__).parent / "fixtures" / "fake_vllm.py"
FAKE = f"{sys.executable} {FAKE_SCRIPT}"
MOSAIC = str(Path(sys.executable).with_name("mosaic"))
MODEL = "llama-3-8b"


# ---------------------------------------------------------------- helpers


def launched_pool_config(replicas: int, autoscaler: dict[str, Any]) -> MosaicConfig:
    """A gateway config with one launched pool `p` of `replicas` stand-in vLLMs (no GPU) and `autoscaler`."""
    return validate_config(
        {
            "models": [{"name": MODEL}],
            "pools": [
                {
                    "name": "p",
                    "model": MODEL,
                    "gpu": "H100",
                    "endpoints": {"launch": {"replicas": replicas, "use_gpus": False, "vllm_command": FAKE}},
                }
            ],
            "autoscaler": autoscaler,
        }
    )


def _mixed_source(launch: LaunchVllmConfig) -> LaunchedPoolSource:
    """Pool `p` serving `m`, mixed role, TP 1, on no GPUs: what most of these tests launch."""
    return LaunchedPoolSource.for_pool(
        "p",
        served_model="m",
        role="mixed",
        tp=1,
        max_model_len=None,
        gpu_memory_utilization=None,
        launch=launch,
        allocator=GpuAllocator([]),
    )


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that may never come in a container counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def recorded(out: Path) -> list[dict[str, Any]]:
    """What each stand-in started so far wrote about itself."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


@pytest.fixture
def spawned(tmp_path: Path) -> Iterator[Path]:
    """A folder the stand-in records itself in; after the test, any stand-in still alive is killed."""
    out = tmp_path / "spawned"
    out.mkdir()
    yield out
    for record in recorded(out):
        if alive(record["pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record["pid"], signal.SIGKILL)


def config(launch: dict[str, Any], **pool: Any) -> MosaicConfig:
    return validate_config(
        {
            "models": [{"name": MODEL}],
            "pools": [{"name": "p", "model": MODEL, "gpu": "H100", **pool, "endpoints": {"launch": launch}}],
            "auth": {"api_keys": ["sk-client"]},
        }
    )


def fake_launch(out: Path, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    launch: dict[str, Any] = {
        "replicas": 1,
        "use_gpus": False,
        "vllm_command": FAKE,
        "log_dir": str(tmp_path / "logs"),
        "env": {"FAKE_VLLM_OUT": str(out)},
    }
    env = {**launch["env"], **extra.pop("env", {})}
    return {**launch, **extra, "env": env}


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not health_ok(url, timeout_s=1.0):
        assert time.monotonic() < deadline, f"{url} never answered /health"
        time.sleep(0.05)


class StubProcess:
    """Stands in for a `VllmProcess` where no process is needed (ports, the controller): never exits
    until terminated."""

    def __init__(self, spec: VllmLaunchSpec, log_path: Path | None = None) -> None:
        self.spec = spec
        self.log_path = log_path
        self.pid = 0
        self._code: int | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    def poll(self) -> int | None:
        return self._code

    def terminate(self) -> None:
        self._code = 0

    def stop(self, timeout_s: float = 30.0) -> int:
        self._code = 0
        return 0


# ---------------------------------------------------------------- 1: launch.gpu_ids


def test_pool_allocates_only_from_its_gpu_ids(
    spawned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    gw = Gateway(config(fake_launch(spawned, tmp_path, use_gpus=True, gpu_ids=["2", "3"])))
    source = gw.sources["p"]
    assert isinstance(source, LaunchedPoolSource)

    async def run() -> None:
        await source.start()
        try:
            launcher = source.launcher
            launcher.scale_to(2)
            assert [r.gpu_ids for r in launcher.replicas] == [("2",), ("3",)]
            with pytest.raises(LaunchError, match=r"p-3 needs 1 GPU\(s\), 0 free of 2 \(2,3\)"):
                launcher.scale_to(3)  # GPUs 0 and 1 are free, but not this pool's
            for replica in launcher.replicas:
                await asyncio.to_thread(wait_healthy, replica.url)
            envs = [get_json(f"{r.url}/launch")["env"] for r in launcher.replicas]
            assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3"]
        finally:
            await gw.stop()

    asyncio.run(run())


def test_a_data_parallel_pool_gives_each_replica_tp_times_dp_gpus(
    spawned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dp: 2, tp: 1`: one vLLM per replica with two engines, on two GPUs of the pool's (the gateway's wiring
    of the pool's dp, not only the launcher's)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4")
    gw = Gateway(config(fake_launch(spawned, tmp_path, use_gpus=True, gpu_ids=["1", "2", "3", "4"]), dp=2))
    source = gw.sources["p"]
    assert isinstance(source, LaunchedPoolSource)

    async def run() -> None:
        await source.start()
        try:
            launcher = source.launcher
            launcher.scale_to(2)
            assert [r.gpu_ids for r in launcher.replicas] == [("1", "2"), ("3", "4")]
            for replica in launcher.replicas:
                await asyncio.to_thread(wait_healthy, replica.url)
            infos = [get_json(f"{r.url}/launch") for r in launcher.replicas]
            assert [i["env"]["CUDA_VISIBLE_DEVICES"] for i in infos] == ["1,2", "3,4"]
            argv = infos[0]["argv"]
            assert argv[argv.index("--data-parallel-size") + 1] == "2"
            assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
        finally:
            await gw.stop()

    asyncio.run(run())
    # dp 1 (the default): the command line has no --data-parallel-size at all, as before pools had dp
    plain = Gateway(config(fake_launch(spawned, tmp_path, replicas=0)))
    assert "--data-parallel-size" not in build_command(plain.sources["p"].launcher.template)  # type: ignore[attr-defined]
    asyncio.run(plain.stop())


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")], ids=["A first", "B first"])
def test_pools_with_overlapping_gpu_ids_both_start_in_either_order(
    order: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pool A may use GPUs 0,1 and pool B only 0: the gateway tells its allocator every pool's GPUs before
    any starts, so A's replica takes 1 (the GPU B cannot use) even when A starts first."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pools = [
        {
            "name": name,
            "model": MODEL,
            "gpu": "H100",
            "endpoints": {"launch": {"gpu_ids": ids, "replicas": 0}},
        }
        for name, ids in (("a", ["0", "1"]), ("b", ["0"]))
    ]
    gw = Gateway(validate_config({"models": [{"name": MODEL}], "pools": pools}))
    try:
        launchers = {name: gw.sources[name].launcher for name in order}  # type: ignore[attr-defined]
        got = {name: lch.allocator.allocate(f"{name}-1", 1, lch.gpu_ids) for name, lch in launchers.items()}
        assert got == {"a": ("1",), "b": ("0",)}
    finally:
        asyncio.run(gw.stop())


@pytest.mark.parametrize(
    ("gpu_ids", "message"),
    [
        pytest.param(["2", "2"], "gpu_ids: GPU 2 is listed twice", id="repeated id"),
        pytest.param([], "gpu_ids: must list at least one GPU", id="empty list"),
        pytest.param([""], "gpu_ids: '' is not a GPU id", id="empty id"),
        pytest.param(["0,1"], "gpu_ids: '0,1' is not a GPU id", id="two ids in one item"),
    ],
)
def test_bad_gpu_ids_are_refused_at_config_load(gpu_ids: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=f"pools.0.endpoints.launch.{message}"):
        config({"gpu_ids": gpu_ids})


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        pytest.param(
            [({"gpu_ids": ["0"]}, {"tp": 2})],
            "pools.0.endpoints.launch.gpu_ids: 1 GPU(s) (0) cannot hold one replica of tp 2 × dp 1 = 2 GPUs",
            id="fewer GPUs than one replica's TP group",
        ),
        pytest.param(
            [({"gpu_ids": ["0", "1", "2"], "replicas": 0}, {"tp": 2, "dp": 2})],
            "pools.0.endpoints.launch.gpu_ids: 3 GPU(s) (0,1,2) cannot hold one replica of tp 2 × dp 2 = 4 GPUs",
            id="DP engines count: 3 GPUs for tp 2 × dp 2, even with no replica to start",
        ),
        pytest.param(
            [({"gpu_ids": ["0", "1", "2"], "replicas": 2}, {"tp": 2})],
            "pools.0.endpoints.launch.replicas: 2 replicas of tp 2 × dp 1 = 2 GPUs need 4 GPUs; gpu_ids lists 3 "
            "(0,1,2)",
            id="the replicas started with the gateway do not fit",
        ),
        pytest.param(
            [
                ({"gpu_ids": ["0", "1", "2", "3"]}, {"tp": 2}),
                ({"gpu_ids": ["2", "3", "4"], "replicas": 2}, {"tp": 2}),
            ],
            "pools.1.endpoints.launch.replicas: pools p, q share GPUs 0,1,2,3,4 and start replicas of 1 × 2 + 2 × 2 "
            "= 6 GPUs (launch.replicas × tp × dp), more than those 5; a GPU serves one replica at a time",
            id="overlapping pools whose starting replicas cannot all have GPUs",
        ),
    ],
)
def test_gpu_ids_that_cannot_hold_the_replicas_are_refused_at_load(
    pools: list[tuple[dict[str, Any], dict[str, Any]]], message: str
) -> None:
    """Refused when the config is loaded, not at the gateway's start (`p-1 needs 2 GPU(s), 1 free of 1`)."""
    data = {
        "models": [{"name": MODEL}],
        "pools": [
            {"name": name, "model": MODEL, "gpu": "H100", **shape, "endpoints": {"launch": launch}}
            for name, (launch, shape) in zip("pqr", pools, strict=False)
        ],
    }
    with pytest.raises(ConfigError) as caught:
        validate_config(data, "mosaic.yaml")
    assert str(caught.value) == f"mosaic.yaml: {message}"


def test_pools_sharing_gpu_ids_are_refused_only_when_their_starting_replicas_outnumber_them() -> None:
    """Overlapping gpu_ids are GPUs the pools share (as pools without gpu_ids share all of them): the allocator
    gives each GPU to one replica at a time, so only more starting replicas than shared GPUs is refused."""
    shared = {"gpu_ids": ["0", "1", "2", "3"], "replicas": 1}
    data = {
        "models": [{"name": MODEL}],
        "pools": [
            {"name": "p", "model": MODEL, "gpu": "H100", "tp": 2, "endpoints": {"launch": shared}},
            {"name": "q", "model": MODEL, "gpu": "H100", "tp": 2, "endpoints": {"launch": shared}},
            {"name": "r", "model": MODEL, "gpu": "H100", "tp": 2, "endpoints": {"launch": shared}},
        ],
    }
    with pytest.raises(
        ConfigError, match=r"pools.2.endpoints.launch.replicas: pools p, q, r share GPUs 0,1,2,3"
    ):
        validate_config(data, "mosaic.yaml")  # 3 × 2 GPUs on 4
    data["pools"][2]["endpoints"] = {"launch": {**shared, "replicas": 0}}  # type: ignore[index]
    validate_config(data, "mosaic.yaml")  # 2 × 2 on 4: each pool's replica gets its own pair
    data["pools"][2]["endpoints"] = {"launch": {**shared, "use_gpus": False}}  # type: ignore[index]
    validate_config(data, "mosaic.yaml")  # a CPU build takes no GPU


def test_gpu_ids_too_few_for_a_replica_make_serve_exit_2_at_load(tmp_path: Path) -> None:
    path = tmp_path / "mosaic.yaml"
    pool = {"name": "p", "model": MODEL, "gpu": "H100", "tp": 2, "endpoints": {"launch": {"gpu_ids": ["0"]}}}
    path.write_text(yaml.safe_dump({"models": [{"name": MODEL}], "pools": [pool]}), encoding="utf-8")
    done = subprocess.run(
        [MOSAIC, "serve", "--config", str(path), "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr.strip().splitlines()) == (
        2,
        [
            f"error: {path}: pools.0.endpoints.launch.gpu_ids: 1 GPU(s) (0) cannot hold one replica of tp 2 × dp 1 "
            "= 2 GPUs"
        ],
    ), done.stderr


def test_gpu_ids_outside_the_visible_gpus_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match=r"pools\[p\].endpoints.launch.gpu_ids: GPU 7 is not among"):
        Gateway(config({"gpu_ids": ["1", "7"], "replicas": 0}))


# ---------------------------------------------------------------- 2: environment


def test_vllm_gets_no_gateway_secrets_and_the_pools_key(
    spawned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "MOSAIC_API_KEYS": "sk-client",
        "VLLM_ADMIN_KEYS": "sk-admin",  # the gateway's admin keys, under a name the allowlist would pass
        "AWS_SECRET_ACCESS_KEY": "aws-secret",
        "VLLM_API_KEY": "sk-stray",  # would switch vLLM's auth on with a key the gateway never sends
        "POOL_VLLM_KEY": "sk-pool",
        "HF_TOKEN": "hf-token",
        "UCX_TLS": "rc,cuda_copy",
    }.items():
        monkeypatch.setenv(name, value)
    cfg = validate_config(
        {
            "models": [{"name": MODEL}],
            "pools": [
                {
                    "name": "p",
                    "model": MODEL,
                    "gpu": "H100",
                    "api_key_env": "POOL_VLLM_KEY",
                    "endpoints": {"launch": fake_launch(spawned, tmp_path)},
                }
            ],
            "auth": {"api_keys_env": "MOSAIC_API_KEYS", "admin_keys_env": "VLLM_ADMIN_KEYS"},
        }
    )
    gw = Gateway(cfg)

    async def run() -> dict[str, str]:
        await gw.sources["p"].start()
        try:
            (replica,) = gw.sources["p"].launcher.replicas  # type: ignore[attr-defined]
            await asyncio.to_thread(wait_healthy, replica.url)
            return dict(get_json(f"{replica.url}/environ"))
        finally:
            await gw.stop()

    env = asyncio.run(run())
    for secret in ("MOSAIC_API_KEYS", "VLLM_ADMIN_KEYS", "AWS_SECRET_ACCESS_KEY", "POOL_VLLM_KEY"):
        assert secret not in env
    assert env["VLLM_API_KEY"] == "sk-pool"  # the key the gateway sends this pool
    assert env["HF_TOKEN"] == "hf-token" and env["UCX_TLS"] == "rc,cuda_copy"  # what vLLM needs stays
    assert env["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize(
    "name",
    ["PYTORCH_CUDA_ALLOC_CONF", "ROCR_VISIBLE_DEVICES", "HUGGINGFACE_HUB_CACHE", "TIKTOKEN_ENCODINGS_BASE",
     "FI_PROVIDER", "NVSHMEM_DIR", "MODELSCOPE_CACHE", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"],
)  # fmt: skip
def test_what_torch_the_hub_and_gpu_stacks_read_is_inherited(name: str) -> None:
    """The allowlist's TORCH prefix missed PYTORCH_CUDA_ALLOC_CONF (vLLM and torch read it), and others."""
    assert build_env(VllmLaunchSpec(model="m", port=8000), base={name: "v"}).get(name) == "v"


def test_stray_vllm_api_key_is_not_inherited() -> None:
    spec = VllmLaunchSpec(model="m", port=8000)
    env = build_env(spec, base={"PATH": "/bin", "VLLM_API_KEY": "x", "VLLM_LOGGING_LEVEL": "DEBUG"})
    assert "VLLM_API_KEY" not in env and env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    # launch.pass_env names what else to inherit; launch.env sets values outright
    named = VllmLaunchSpec(model="m", port=8000, pass_env=("AWS_PROFILE",), env={"X": "1"})
    assert build_env(named, base={"AWS_PROFILE": "models", "AWS_SECRET_ACCESS_KEY": "s"}) == {
        "AWS_PROFILE": "models",
        "X": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    # `mosaic worker --engine vllm` is the user's own command: their environment goes through unfiltered
    assert build_env(spec, base={"VLLM_API_KEY": "x"}, filtered=False)["VLLM_API_KEY"] == "x"


# ---------------------------------------------------------------- 3: orphans and failed startup

PARENT = """
import sys, time
from pathlib import Path
from server.vllm_launcher import VllmLaunchSpec, VllmProcess
spec = VllmLaunchSpec(model="m", port=int(sys.argv[1]), vllm_command=(sys.executable, sys.argv[2]))
process = VllmProcess.start(spec, log_path=Path(sys.argv[3]))
print(process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_vllm_dies_with_a_sigkilled_parent(tmp_path: Path) -> None:
    port = free_port()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(port), str(FAKE_SCRIPT), str(tmp_path / "v.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        wait_healthy(f"http://127.0.0.1:{port}")
        parent.kill()  # SIGKILL: no handler, no stop() — only the kernel can tell the child
        parent.wait(timeout=10)
        assert wait_gone(child), "vLLM outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if parent.stdout is not None:
            parent.stdout.close()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize(
    ("launch", "line"),
    [
        pytest.param(
            {"replicas": 2, "use_gpus": True},  # the machine's one GPU (with gpu_ids: ["0"], refused at load)
            "error: gateway startup failed: pool p: cannot start its 2 vLLM replica(s) (endpoints.launch): "
            "p-2 needs 1 GPU(s), 0 free of 1 (in use: 0→p-1)",
            id="second replica finds no GPU",
        ),
        pytest.param(
            {"vllm_command": "/nonexistent/vllm serve"},
            "error: gateway startup failed: pool p: cannot start its 1 vLLM replica(s) (endpoints.launch): "
            "cannot run '/nonexistent/vllm': No such file or directory (is vLLM installed? `mosaic worker "
            "--vllm-command`, or a pool's launch.vllm_command, names it)",
            id="vLLM not installed",
        ),
    ],
)
def test_serve_startup_failure_stops_replicas_and_exits_2(
    spawned: Path, tmp_path: Path, launch: dict[str, Any], line: str
) -> None:
    cfg = {
        "models": [{"name": MODEL}],
        "pools": [
            {
                "name": "p",
                "model": MODEL,
                "gpu": "H100",
                "endpoints": {"launch": fake_launch(spawned, tmp_path, **launch)},
            }
        ],
        "auth": {"api_keys": ["sk-client"]},
    }
    path = tmp_path / "mosaic.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    done = subprocess.run(
        [MOSAIC, "serve", "--config", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [line]), done.stderr
    for record in recorded(spawned):  # the replica that did start was stopped with the gateway
        assert wait_gone(record["pid"]), f"replica pid {record['pid']} left running"


# ---------------------------------------------------------------- 4: mosaic autoscale only observes


def test_standalone_controller_launches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from server.commands.autoscale import standalone

    starts: list[VllmLaunchSpec] = []

    def record(cls: type, spec: VllmLaunchSpec, *args: Any, **kwargs: Any) -> StubProcess:
        starts.append(spec)
        return StubProcess(spec)

    monkeypatch.setattr(VllmProcess, "start", classmethod(record))
    cfg = launched_pool_config(2, {"actuator": "dry-run", "interval_s": 3600})

    async def run() -> None:
        async with standalone(cfg) as ctl:
            assert "p" in ctl.managed
            await ctl.controller.cycle()  # decides (dry-run) without a vLLM of its own

    asyncio.run(run())
    assert starts == []


# ---------------------------------------------------------------- 6 and 12: backoff, launch logs, kept logs


def test_failed_scale_up_backs_off_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    attempts: list[float] = []  # when each start tried to allocate its GPU

    class CountingAllocator(GpuAllocator):
        def allocate(self, owner: str, count: int, *args: Any) -> tuple[str, ...]:
            attempts.append(time.monotonic())
            return super().allocate(owner, count, *args)

    template = pool_template(
        model="m", served_model_name="m", role="mixed", tp=1, max_model_len=None, gpu_memory_utilization=None
    )
    launcher = VllmPoolLauncher("p", template, CountingAllocator([]), tmp_path)  # no GPU: every start fails
    source = LaunchedPoolSource(launcher, replicas=0, restart_backoff_s=0.05)
    launcher.desired = 1  # what the autoscaler asked for

    async def run() -> None:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            await source.list()
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.DEBUG, logger="mosaic.vllm"):
        asyncio.run(run())
    # 0.05, 0.1, 0.2, 0.4 s apart: ≤ 5 tries in a second (retrying at every resync made ~80)
    assert 2 <= len(attempts) <= 5, attempts
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot start vLLM replicas of p" in warnings[0].getMessage()


def test_the_autoscaler_hears_of_a_failed_start_once_not_at_every_cycle_of_the_backoff(
    tmp_path: Path,
) -> None:
    """While a pool backs off, a scale-up is not applied but is no new error (the controller warned and
    counted an error at every 15 s cycle)."""
    template = pool_template(
        model="m", served_model_name="m", role="mixed", tp=1, max_model_len=None, gpu_memory_utilization=None
    )
    now = [0.0]
    launcher = VllmPoolLauncher("p", template, GpuAllocator([]), tmp_path, clock=lambda: now[0])  # no GPU
    actuator = VllmActuator({"p": launcher})
    first = actuator.scale("p", 1, 0.0)
    assert not first.applied and first.error is not None and "GPU" in first.error
    now[0] = 5.0  # within the first 10 s backoff
    again = actuator.scale("p", 1, 5.0)
    assert (again.applied, again.error, again.after) == (False, None, 0)
    now[0] = 11.0  # backoff over: tried again, and reported
    assert actuator.scale("p", 1, 11.0).error is not None


def test_backoff_doubles_up_to_its_cap() -> None:
    backoff = Backoff(10.0, 60.0)
    assert [backoff.fail(0.0) for _ in range(5)] == [10.0, 20.0, 40.0, 60.0, 60.0]
    assert not backoff.ready(59.0) and backoff.ready(60.0)
    backoff.succeed()
    assert backoff.ready(0.0) and backoff.fail(0.0) == 10.0


def _clocked_stub_launcher(tmp_path: Path, now: list[float]) -> VllmPoolLauncher:
    """A launcher of stub processes on the clock `now[0]`, backing off 10 s doubling to 300, reset after 600."""
    template = pool_template(
        model="m", served_model_name="m", role="mixed", tp=1, max_model_len=None, gpu_memory_utilization=None
    )
    stub: Any = StubProcess
    launcher = VllmPoolLauncher(
        "p", template, GpuAllocator([]), tmp_path, use_gpus=False, starter=stub, clock=lambda: now[0]
    )
    launcher.backoff = Backoff(10.0, 300.0, reset_after_s=600.0)
    return launcher


def test_a_replica_that_serves_and_then_crashes_keeps_backing_off(tmp_path: Path) -> None:
    """/health ended the failure streak, so a replica that loads, answers and then crashes was restarted every
    10 s forever; the streak now ends only after `restart_backoff_reset_s` of service (the kubelet's rule)."""
    now = [0.0]
    launcher = _clocked_stub_launcher(tmp_path, now)

    def serve_then_crash(serve_s: float) -> float:
        """Start a replica, see it healthy, let it serve `serve_s`, crash it: the wait before the next start."""
        launcher.scale_to(1)
        assert launcher.check_ready(lambda url: True)
        now[0] += serve_s
        launcher.replicas[0].process._code = 1
        assert len(launcher.prune_dead()) == 1
        wait = launcher.backoff.retry_at - now[0]
        now[0] += wait
        return wait

    assert [serve_then_crash(30.0) for _ in range(4)] == [10.0, 20.0, 40.0, 80.0]
    assert serve_then_crash(600.0) == 10.0  # ten minutes of service: a new streak
    assert serve_then_crash(599.0) == 20.0
    launcher.stop_all()


def test_the_streak_ends_while_a_replica_keeps_serving(tmp_path: Path) -> None:
    now = [0.0]
    launcher = _clocked_stub_launcher(tmp_path, now)
    launcher.backoff.fail(0.0)
    launcher.backoff.fail(0.0)
    now[0] = 20.0
    launcher.scale_to(1)
    launcher.check_ready(lambda url: True)
    now[0] = 619.0
    assert launcher.prune_dead() == [] and launcher.backoff.failures == 2
    now[0] = 620.0
    assert launcher.prune_dead() == [] and launcher.backoff.failures == 0
    launcher.stop_all()


def test_crash_loop_backs_off_logs_each_launch_and_keeps_failed_logs(
    spawned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    launch = LaunchVllmConfig.model_validate(
        {
            **fake_launch(spawned, tmp_path, env={"FAKE_VLLM_MODE": "crash"}),
            "log_dir": None,  # the default folder, under the user's cache
            "restart_backoff_s": 0.05,
        }
    )
    source = _mixed_source(launch)

    async def run() -> None:
        await source.start()
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                await source.list()
                await asyncio.sleep(0.02)
        finally:
            await source.stop()

    with caplog.at_level(logging.INFO, logger="mosaic.vllm"):
        asyncio.run(run())
    launches = len(recorded(spawned))
    # backoff 0.05, 0.1, 0.2, 0.4, 0.8 s: at most 6 starts in 2 s (a fixed 0.05 s made a dozen or more)
    assert 2 <= launches <= 6, launches
    launched = [r for r in caplog.records if r.getMessage().startswith("launched vLLM p-")]
    # restarts are logged as launches too; one started just before the stop may die before it records itself
    assert launches <= len(launched) <= launches + 1
    logs = sorted((tmp_path / "cache" / "mosaic" / "vllm-logs" / "p").glob("p-*.log"))
    assert len(logs) >= launches - 1  # failed replicas' logs outlive the gateway (the last may still run)
    assert "fake vllm crash" in logs[0].read_text()


def test_default_log_dir_drops_logs_of_clean_stops(
    spawned: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    launch = LaunchVllmConfig.model_validate({**fake_launch(spawned, tmp_path), "log_dir": None})
    source = _mixed_source(launch)

    async def run() -> Path:
        await source.start()
        try:
            (replica,) = source.launcher.replicas
            await asyncio.to_thread(wait_healthy, replica.url)
            assert replica.process.log_path is not None and replica.process.log_path.is_file()
            return replica.process.log_path
        finally:
            await source.stop()

    log_path = asyncio.run(run())
    assert log_path.parent == tmp_path / "cache" / "mosaic" / "vllm-logs" / "p"
    assert not log_path.exists()


# ---------------------------------------------------------------- 7: ports stay reserved


def test_a_port_handed_out_is_not_handed_out_again_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import server.vllm_pool

    first, second = free_port(), free_port()
    probes = iter([first, first, second, first])  # the OS reports `first` free again while vLLM loads
    monkeypatch.setattr(server.vllm_pool, "free_port", lambda host="127.0.0.1": next(probes))
    template = pool_template(
        model="m", served_model_name="m", role="mixed", tp=1, max_model_len=None, gpu_memory_utilization=None
    )
    stub: Any = StubProcess  # duck-typed VllmProcess: nothing is spawned
    launcher = VllmPoolLauncher("p", template, GpuAllocator([]), tmp_path, use_gpus=False, starter=stub)
    launcher.scale_to(2)
    urls = [r.url for r in launcher.replicas]
    assert urls == [f"http://127.0.0.1:{first}", f"http://127.0.0.1:{second}"]
    assert {first, second} <= reserved_ports()
    launcher.stop_all()
    assert not {first, second} & reserved_ports()  # released once the replicas have exited
    launcher.scale_to(1)
    assert launcher.replicas[0].url == f"http://127.0.0.1:{first}"
    launcher.stop_all()


# ---------------------------------------------------------------- 8: a hung start is replaced


def test_replica_never_ready_is_stopped_and_replaced(spawned: Path, tmp_path: Path) -> None:
    launch = LaunchVllmConfig.model_validate(
        {
            **fake_launch(spawned, tmp_path, env={"FAKE_VLLM_MODE": "hang"}),  # /health: 503 forever
            "start_timeout_s": 1.0,
            "restart_backoff_s": 0.05,
        }
    )
    source = _mixed_source(launch)

    async def run() -> list[str]:
        await source.start()
        try:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                ids = [e.name for e in await source.list()]
                if ids and ids[0] != "p-1":
                    return ids
                await asyncio.sleep(0.1)
            return ids
        finally:
            await source.stop()

    assert asyncio.run(run()) == ["p-2"]
    first = recorded(spawned)[0]
    assert wait_gone(first["pid"])  # stopped: its GPUs (and ports) are free again


# ---------------------------------------------------------------- 9: engine settings


def test_pool_engine_settings_reach_the_command_line(spawned: Path, tmp_path: Path) -> None:
    gw = Gateway(config(fake_launch(spawned, tmp_path, replicas=0), max_num_seqs=64, block_size=32))
    argv = build_command(gw.sources["p"].launcher.template)  # type: ignore[attr-defined]
    assert argv[argv.index("--max-num-seqs") + 1] == "64"
    assert argv[argv.index("--block-size") + 1] == "32"
    asyncio.run(gw.stop())
    # A value the operator gives in extra_args wins, and vLLM does not see the flag twice.
    spec = VllmLaunchSpec(model="m", port=1, block_size=16, extra_args=("--block-size=128",))
    assert [a for a in build_command(spec) if a.startswith("--block-size")] == ["--block-size=128"]


# ---------------------------------------------------------------- 10: advertised NIXL host


def test_nixl_side_channel_host_is_advertisable() -> None:
    wildcard = VllmLaunchSpec(model="m", port=1, host="0.0.0.0", role="prefill")
    advertised = build_env(wildcard, base={})["VLLM_NIXL_SIDE_CHANNEL_HOST"]
    assert advertised not in ("0.0.0.0", "::") and advertised == default_advertise_host("0.0.0.0")
    assert default_advertise_host("10.0.0.5") == "10.0.0.5"
    launch = LaunchVllmConfig.model_validate({"host": "0.0.0.0", "advertise_host": "10.1.2.3"})
    source = LaunchedPoolSource.for_pool(
        "p",
        served_model="m",
        role="decode",
        tp=1,
        max_model_len=None,
        gpu_memory_utilization=None,
        launch=launch,
        allocator=GpuAllocator([]),
    )
    assert build_env(source.launcher.template, base={})["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"


# ---------------------------------------------------------------- 11: config errors are one line


@pytest.mark.parametrize(
    ("launch", "message"),
    [
        pytest.param({"vllm_command": ""}, "vllm_command: must not be empty", id="empty command"),
        pytest.param({"vllm_command": "'x"}, 'vllm_command: "\'x": No closing quotation', id="bad quoting"),
        pytest.param({"host": "[::1]"}, "host: '[::1]' is not an address", id="bracketed IPv6"),
        pytest.param(
            {"stop_grace_s": float("inf")}, "stop_grace_s: Input should be a finite", id="inf grace"
        ),
        pytest.param(
            {"restart_backoff_s": float("nan")},
            "restart_backoff_s: Input should be a finite",
            id="NaN backoff",
        ),
        pytest.param(
            {"env": {"VLLM_API_KEY": "k"}}, "env: VLLM_API_KEY: set the pool's api_key_env", id="key in env"
        ),
        pytest.param(
            {"extra_args": ["--enforce-eager", "--data-parallel-size", "2"]},
            "extra_args: --data-parallel-size: set the pool's dp instead",
            id="DP size in extra_args",
        ),
        pytest.param(
            {"extra_args": ["-dp=2"]}, "extra_args: -dp=2: set the pool's dp instead", id="DP short flag"
        ),
        pytest.param(
            {"extra_args": ["-tp", "2"]}, "extra_args: -tp: set the pool's tp instead", id="TP short flag"
        ),
        pytest.param(
            {"extra_args": ["--tensor_parallel_size=2"]},
            "extra_args: --tensor_parallel_size=2: set the pool's tp instead",
            id="TP size with underscores (vLLM reads them as dashes)",
        ),
        pytest.param(
            {"extra_args": ["--enforce-eager", "--pipeline-parallel-size", "2"]},
            "extra_args: --pipeline-parallel-size: vLLM's --pipeline-parallel-size is not supported: Mosaic does "
            "not model pipeline parallelism, so the replica would need tp × pp × dp GPUs while the gateway gives "
            "it tp × dp and books its capacity from them; use the pool's tp instead",
            id="PP size: not modelled",
        ),
        pytest.param(
            {"extra_args": ["-pp", "2"]},
            "extra_args: -pp: vLLM's --pipeline-parallel-size is not supported",
            id="PP short flag",
        ),
        pytest.param(
            {"extra_args": ["--pipeline_parallel=2"]},
            "extra_args: --pipeline_parallel=2: vLLM's --pipeline-parallel-size is not supported",
            id="PP abbreviation with underscores (argparse takes the prefix)",
        ),
        pytest.param(
            {"extra_args": ["--enforce-eager", "--prefill-context-parallel-size", "2"]},
            "extra_args: --prefill-context-parallel-size: vLLM's --prefill-context-parallel-size is not "
            "supported: Mosaic does not model prefill context parallelism, so the replica would need tp × pcp × "
            "dp GPUs while the gateway gives it tp × dp and books its capacity from them; use the pool's tp "
            "instead",
            id="PCP size: not modelled",
        ),
        pytest.param(
            {"extra_args": ["-pcp=2"]},
            "extra_args: -pcp=2: vLLM's --prefill-context-parallel-size is not supported",
            id="PCP short flag",
        ),
        pytest.param(
            {"extra_args": ["-pc", "2"]},
            "extra_args: -pc: vLLM's --prefill-context-parallel-size is not supported",
            id="PCP short flag abbreviated (argparse takes -pc for -pcp)",
        ),
        pytest.param(
            {"extra_args": ["--prefill_c=2"]},
            "extra_args: --prefill_c=2: vLLM's --prefill-context-parallel-size is not supported",
            id="PCP shortest abbreviation, underscores",
        ),
    ],
)
def test_bad_launch_config_is_one_line(launch: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(launch)
    assert f"pools.0.endpoints.launch.{message}" in str(caught.value)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- 11b: vLLM's --config FILE in extra_args


@pytest.mark.parametrize(
    ("key", "refusal"),
    [
        pytest.param(
            "tensor_parallel_size",
            "set the pool's tp instead (the gateway gives each replica tp × dp GPUs",
            id="tp",
        ),
        pytest.param(
            "tensor-parallel", "set the pool's tp instead", id="tp, abbreviated (vLLM reads it as --KEY)"
        ),
        pytest.param("data-parallel-size", "set the pool's dp instead", id="dp"),
        pytest.param(
            "pipeline_parallel_size",
            "vLLM's --pipeline-parallel-size is not supported: Mosaic does not model pipeline parallelism",
            id="pp",
        ),
        pytest.param(
            "prefill-context",
            "vLLM's --prefill-context-parallel-size is not supported: Mosaic does not model prefill context "
            "parallelism",
            id="pcp, abbreviated",
        ),
    ],
)
def test_a_vllm_config_file_setting_a_parallel_size_is_refused_when_the_gateway_is_built(
    tmp_path: Path, key: str, refusal: str
) -> None:
    """vLLM reads `--config FILE` (a YAML of its options) before its command line: a size there escapes the
    extra_args rule. The file is where the replicas run, so the gateway reads it when it is built (`mosaic
    serve` exits 2), not the config loader (`mosaic autoscale` may load the config elsewhere)."""
    file = tmp_path / "vllm.yaml"
    file.write_text("max-num-seqs: 8\nenforce-eager: true\n", encoding="utf-8")
    cfg = config({"replicas": 0, "use_gpus": False, "extra_args": ["--config", str(file)]})
    asyncio.run(Gateway(cfg).stop())  # other options pass
    file.write_text(f"max-num-seqs: 8\n{key}: 2\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        Gateway(cfg)
    assert str(caught.value).startswith(
        f"pools[p].endpoints.launch.extra_args: --config {file} sets {key}: {refusal}"
    ), caught.value


@pytest.mark.parametrize(
    ("args", "text", "message"),
    [
        pytest.param(
            ["--config", "{file}"], None, "cannot read vLLM's config file: No such file", id="missing"
        ),
        pytest.param(["--config", "{file}"], "tp: [2\n", "not valid YAML at line 2", id="not YAML"),
        pytest.param(
            ["--config", "{file}"], "- -tp\n- 2\n", "must be a mapping of vLLM options", id="a list"
        ),
        pytest.param(["--config", "{file}"], "", "must be a mapping of vLLM options", id="empty"),
        pytest.param(["--config"], None, "--config: no file follows it", id="no file"),
        pytest.param(
            ["--config={file}"],
            "pipeline_parallel_size: 2\n",
            "sets pipeline_parallel_size",
            id="--config=FILE: vLLM 0.32 ignores the file; read all the same",
        ),
        pytest.param(
            ["--config", "{file}.json"], "{}", "vLLM reads only .yaml or .yml config files", id="JSON"
        ),
    ],
)
def test_a_vllm_config_file_that_cannot_be_checked_is_refused(
    tmp_path: Path, args: list[str], text: str | None, message: str
) -> None:
    file = tmp_path / "vllm.yaml"
    args = [a.format(file=file) for a in args]
    if text is not None:
        Path(args[-1].removeprefix("--config=")).write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        Gateway(config({"replicas": 0, "use_gpus": False, "extra_args": args}))
    line = str(caught.value)
    assert line.startswith("pools[p].endpoints.launch.extra_args: --config") and message in line, line
    assert "\n" not in line


def test_a_replica_start_reads_the_vllm_config_file_again(tmp_path: Path) -> None:
    """vLLM reads the file at each start: one changed since the gateway was built fails that start (a failure,
    backed off like any other), not a replica on GPUs it was not given."""
    file = tmp_path / "vllm.yaml"
    file.write_text("max-num-seqs: 8\n", encoding="utf-8")
    template = pool_template(
        model="m",
        served_model_name="m",
        role="mixed",
        tp=1,
        max_model_len=None,
        gpu_memory_utilization=None,
        extra_args=["--config", str(file)],
    )
    stub: Any = StubProcess
    launcher = VllmPoolLauncher("p", template, GpuAllocator([]), tmp_path, use_gpus=False, starter=stub)
    launcher.scale_to(1)
    file.write_text("pipeline_parallel_size: 2\n", encoding="utf-8")
    with pytest.raises(LaunchError) as caught:
        launcher.scale_to(2)
    assert str(caught.value).startswith(
        f"p-2: extra_args: --config {file} sets pipeline_parallel_size: vLLM's"
    )
    assert [r.id for r in launcher.replicas] == ["p-1"] and launcher.backoff.failures == 1


def test_a_vllm_config_file_setting_a_parallel_size_makes_serve_exit_2(tmp_path: Path) -> None:
    file = tmp_path / "vllm.yaml"
    file.write_text("data_parallel_size: 2\n", encoding="utf-8")
    launch = {"replicas": 1, "use_gpus": False, "vllm_command": FAKE, "extra_args": ["--config", str(file)]}
    path = tmp_path / "mosaic.yaml"
    pool = {"name": "p", "model": MODEL, "gpu": "H100", "endpoints": {"launch": launch}}
    path.write_text(yaml.safe_dump({"models": [{"name": MODEL}], "pools": [pool]}), encoding="utf-8")
    done = subprocess.run(
        [MOSAIC, "serve", "--config", str(path), "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr.strip().splitlines()) == (
        2,
        [
            f"error: {path}: pools[p].endpoints.launch.extra_args: --config {file} sets data_parallel_size: set the "
            "pool's dp instead (the gateway gives each replica tp × dp GPUs and books its capacity from them)"
        ],
    ), done.stderr


def test_ipv6_host_makes_a_valid_url() -> None:
    spec = VllmLaunchSpec(model="m", port=8123, host="::")
    assert spec.url == "http://[::1]:8123" and httpx.URL(spec.url).port == 8123
    assert VllmLaunchSpec(model="m", port=8123, host="fe80::1").url == "http://[fe80::1]:8123"


# ---------------------------------------------------------------- 9: soft scale-in


def _stub_launcher(tmp_path: Path, now: list[float], **kw: Any) -> VllmPoolLauncher:
    template = pool_template(
        model="m", served_model_name="m", role="mixed", tp=1, max_model_len=None, gpu_memory_utilization=None
    )
    stub: Any = StubProcess
    return VllmPoolLauncher(
        "p", template, GpuAllocator([]), tmp_path, use_gpus=False, starter=stub, clock=lambda: now[0], **kw
    )


def test_scale_in_drains_a_replica_before_its_sigterm(tmp_path: Path) -> None:
    """With the gateway watching (`idle` set), the newest replica leaves service at once but gets SIGTERM
    only once nothing routed to it is unfinished; a scale-out takes a draining replica back before starting
    one; a drain past `drain_timeout_s` is stopped anyway (forced)."""
    now = [0.0]
    busy = {"p-2"}
    launcher = _stub_launcher(tmp_path, now, drain_timeout_s=600.0)
    launcher.idle = lambda rid: rid not in busy
    launcher.scale_to(2)
    first, second = launcher.replicas
    assert launcher.scale_to(1) == ([], ["p-2"])
    assert [r.id for r in launcher.replicas] == ["p-1"] and [r.id for r in launcher.draining] == ["p-2"]
    assert second.process.poll() is None  # still running its requests
    assert launcher.finish_drains() == [] and second.process.poll() is None
    launcher.scale_to(2)  # taken back warm: no third start
    assert [r.id for r in launcher.replicas] == ["p-1", "p-2"] and not launcher.draining
    launcher.scale_to(1)
    busy.clear()
    now[0] = 1.0
    assert launcher.finish_drains() == [(second, False)]
    assert second.process.poll() == 0 and not launcher.draining and first.process.poll() is None
    launcher.scale_to(2)  # p-2 is gone: a new replica
    assert [r.id for r in launcher.replicas] == ["p-1", "p-3"]
    busy.add("p-3")
    launcher.scale_to(1)
    now[0] = 602.0  # drained 601 s > 600
    ((stopped, forced),) = launcher.finish_drains()
    assert (stopped.id, forced, stopped.process.poll()) == ("p-3", True, 0)
    launcher.stop_all()


def test_without_a_watcher_scale_in_stops_at_once(tmp_path: Path) -> None:
    now = [0.0]
    launcher = _stub_launcher(tmp_path, now)
    launcher.scale_to(2)
    second = launcher.replicas[1]
    launcher.scale_to(1)
    assert second.process.poll() == 0 and not launcher.draining
    launcher.stop_all()


def test_a_draining_replica_is_listed_as_terminating_until_stopped(spawned: Path, tmp_path: Path) -> None:
    """The registry keeps the books of its in-flight requests and the router stops choosing it."""
    source = _mixed_source(LaunchVllmConfig.model_validate({**fake_launch(spawned, tmp_path), "replicas": 2}))
    busy = {"p-2"}
    source.launcher.idle = lambda rid: rid not in busy

    async def run() -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
        await source.start()
        try:
            source.launcher.scale_to(1)
            while_busy = [(e.name, e.terminating) for e in await source.list()]
            busy.clear()
            after = [(e.name, e.terminating) for e in await source.list()]
            return while_busy, after
        finally:
            await source.stop()

    while_busy, after = asyncio.run(run())
    assert while_busy == [("p-1", False), ("p-2", True)]
    assert after == [("p-1", False)]


def test_launched_vllm_drains_on_sigterm_for_the_grace_period() -> None:
    """vLLM 0.32 aborts what is running on SIGTERM unless given --shutdown-timeout: a launched replica gets
    stop_grace_s − 5 s (then SIGKILL), unless extra_args sets its own."""
    launch = LaunchVllmConfig.model_validate({"stop_grace_s": 40})
    cmd = build_command(_mixed_source(launch).launcher.template)
    assert cmd[cmd.index("--shutdown-timeout") + 1] == "35"
    own = LaunchVllmConfig.model_validate({"extra_args": ["--shutdown-timeout=90"]})
    cmd = build_command(_mixed_source(own).launcher.template)
    assert [a for a in cmd if a.startswith("--shutdown-timeout")] == ["--shutdown-timeout=90"]


def test_the_embedded_autoscaler_drains_launched_pools(tmp_path: Path) -> None:
    """`mosaic serve` with the embedded actuator gives each launched pool the gateway's idleness check and
    its drain_timeout_s: a replica with an open request is not idle, one without is."""
    gw = Gateway(launched_pool_config(0, {"enabled": True, "actuator": "embedded", "drain_timeout_s": 45}))
    assert gw.autoscaler is not None
    gw.autoscaler.build()  # the actuator, built once the fleet is listed, wires the launcher
    launcher = gw.sources["p"].launcher  # type: ignore[attr-defined]
    assert launcher.idle is not None and launcher.drain_timeout_s == 45
    assert launcher.idle("p-1")  # unknown to the registry, no open decision
    assert gw.open_decisions is not None
    gw.open_decisions._open["p/p-1"] = 1  # a routing decision still open on it
    assert not launcher.idle("p-1")
