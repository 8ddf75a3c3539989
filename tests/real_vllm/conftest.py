"""Fixtures for tests against a real vLLM server (CPU build, tiny local model).

`real_vllm`: one server per test session (started on first use, 25-80 s, stopped at the end).
`real_vllm_kv`: a second server with `--max-num-seqs 2 --num-gpu-blocks-override 8` (KV pressure), started for
the tests that ask for it, kept while they run one after another, and stopped after them; `real_vllm_dp`
is started for the module that asks for it and stopped after it, with two data-parallel engines;
`real_vllm_pooling` likewise, an embedding server (`--runner pooling --convert embed`; `sim_pooling_url` is the
simulated worker with `--runner pooling`); `real_vllm_lora` likewise, with two LoRA adapters built at test time (build_lora.py), `--max-loras 1` and runtime
adapter loading on (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; `sim_lora_url` is the simulated worker set up the
same way). All
skip with the reason from `vllm_env.missing_reason()` when `.venv-vllm` or the model is absent (`make test-vllm`
sets them up). `sim_url`: Mosaic's simulated worker
serving the same tiny model (`mosaic worker`, one per module), which the fidelity and differential tests diff
against `real_vllm`; `sim_dp_url`: the same with `real_vllm_dp`'s engines (`--data-parallel-size 2`).

`MOSAIC_REAL_VLLM_URL=http://127.0.0.1:P` makes `real_vllm` use a server already running (e.g. one from
`bash scripts/real_vllm.sh start`) instead of starting one: handy while developing; tests assert deltas, so
a used server is fine.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_env
from build_lora import RANK as LORA_RANK
from build_lora import write_adapters
from engine_processes import yield_cpu_to_api_server
from gateway_harness import CATALOG, MosaicGateway, Target, static_config

from server.vllm_launcher import LaunchError, VllmProcess, free_port, health_ok, log_tail

SIM_MODEL = vllm_env.SERVED_MODEL_NAME  # the simulated worker serves the tiny model under the same name
START_TIMEOUT_S = 420.0  # cold start is ~120 s alone; on a loaded 2-core machine allow well beyond
LORA_ADAPTERS = {"tiny-lora-a": 1, "tiny-lora-b": 2}  # `real_vllm_lora`'s adapters: served name → build seed
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # vLLM's reading: "1" or "true", any case
# an adapter built beside `LORA_ADAPTERS` but not loaded: `real_vllm_lora`'s filesystem resolver loads it when a
# request first names it (VLLM_LORA_RESOLVER_CACHE_DIR = their folder)
RESOLVABLE_ADAPTER = "tiny-lora-resolvable"


# CI's whole run has a hard time limit (.ci/run sets MOSAIC_TESTS_DEADLINE, seconds since the epoch). A
# real-vLLM test that would begin with less than DEADLINE_RESERVE_S left (a server start and its checks) is
# skipped with that reason and counted in the summary, so a slow machine runs fewer of them, not none.
DEADLINE_ENV = "MOSAIC_TESTS_DEADLINE"
DEADLINE_RESERVE_S = 150.0
# The order real-vLLM modules run in, so a budget spent early costs the least coverage: first the gateway
# against the session's server (the OpenAI surface, the scrape, the simulated worker's fidelity) and the
# KV-pressure server (stuck workers, KV reservation), then the rest in collection order, and last the modules
# that start servers of their own for one or two checks (~45-100 s each on 2 cores).
FIRST_MODULES = (
    "test_openai_surface.py",
    "test_admin_stats.py",
    "test_fidelity.py",
    "test_differential.py",
    "test_ejection_limit_vllm.py",
    "test_responses_api.py",
    "test_profile_url_vllm.py",
    "test_frozen_worker.py",
    "test_kv_pressure.py",
)
LAST_MODULES = (
    "test_env_skips.py",
    "test_vllm_worker.py",
    "test_scale_from_zero_vllm.py",
    "test_launch_pool.py",
)
_over_budget: list[str] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-vLLM tests of FIRST_MODULES move to the front and those of LAST_MODULES to the end, in those
    orders (each module's tests stay together and in their order, so module-scoped servers start once); every
    other test keeps its place."""

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        if item.get_closest_marker("real_vllm") is not None:
            if name in FIRST_MODULES:
                return 0, FIRST_MODULES.index(name)
            if name in LAST_MODULES:
                return 2, LAST_MODULES.index(name)
        return 1, 0

    items[:] = sorted(items, key=rank)  # stable: ties keep collection order


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = os.environ.get(DEADLINE_ENV)
    if not deadline or item.get_closest_marker("real_vllm") is None:
        return
    left = float(deadline) - time.time()
    if left < DEADLINE_RESERVE_S:
        _over_budget.append(item.nodeid)
        pytest.skip(f"not run: {left:.0f} s of the CI time budget left ({DEADLINE_ENV})")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _over_budget:
        terminalreporter.write_line(
            f"CI time budget spent: {len(_over_budget)} real-vLLM test(s) not run, from {_over_budget[0]}",
            yellow=True,
            bold=True,
        )


@dataclass(frozen=True, slots=True)
class RealServer:
    url: str
    model: str
    process: VllmProcess | None  # None when MOSAIC_REAL_VLLM_URL points at a server started elsewhere
    max_model_len: int = vllm_env.MAX_MODEL_LEN
    adapters: tuple[str, ...] = ()  # served names of its LoRA adapters (`--lora-modules`), in start order


def _skip_if_absent() -> None:
    reason = vllm_env.missing_reason()
    if reason is not None:
        pytest.skip(reason)


def _serve(
    name: str,
    extra_args: tuple[str, ...],
    adapters: tuple[str, ...] = (),
    extra_env: dict[str, str] | None = None,
) -> Iterator[RealServer]:
    proc = vllm_env.start_process(name, extra_args, extra_env=extra_env)
    try:
        proc.wait_healthy(START_TIMEOUT_S)
        # /health answers 200 even when the engine process died during start-up: one real completion proves it.
        vllm_env.smoke_test(proc.url, extra_args=extra_args)
        yield_cpu_to_api_server(proc.pid)
    except (LaunchError, RuntimeError) as exc:
        proc.stop()
        pytest.fail(f"real vLLM server {name!r} did not start: {exc}\n{log_tail(proc.log_path, 40)}")
    try:
        yield RealServer(url=proc.url, model=vllm_env.SERVED_MODEL_NAME, process=proc, adapters=adapters)
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[RealServer]:
    _skip_if_absent()
    external = os.environ.get("MOSAIC_REAL_VLLM_URL")
    if external:
        if not health_ok(external):
            pytest.fail(f"MOSAIC_REAL_VLLM_URL={external} does not answer /health")
        yield RealServer(url=external.rstrip("/"), model=vllm_env.SERVED_MODEL_NAME, process=None)
        return
    yield from _serve("pytest-main", ())


# Servers kept from one test to the next while the next one asks for the same fixture too, and stopped as soon
# as it does not (`pytest_runtest_teardown`): a module's server that the adjacent module shares (one start).
_kept: dict[str, tuple[RealServer, Iterator[RealServer]]] = {}


def _keep(fixture: str, serve: Callable[[], Iterator[RealServer]]) -> RealServer:
    if fixture not in _kept:
        running = serve()
        _kept[fixture] = (next(running), running)
    return _kept[fixture][0]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for fixture in list(_kept):
        if nextitem is None or fixture not in getattr(nextitem, "fixturenames", ()):
            _kept.pop(fixture)[1].close()  # `_serve`'s finally: the server stops


@pytest.fixture
def real_vllm_kv() -> RealServer:
    """A server with `--max-num-seqs 2 --num-gpu-blocks-override 8` (KV pressure), kept while the tests that
    ask for it run one after another (test_frozen_worker.py, which stops and resumes it, then
    test_kv_pressure.py, which counts deltas) and stopped after them."""
    _skip_if_absent()
    external = os.environ.get("MOSAIC_REAL_VLLM_KV_URL")  # e.g. `real_vllm.sh start --name kv --kv-pressure`
    if external:
        if not health_ok(external):
            pytest.fail(f"MOSAIC_REAL_VLLM_KV_URL={external} does not answer /health")
        return RealServer(url=external.rstrip("/"), model=vllm_env.SERVED_MODEL_NAME, process=None)
    return _keep("real_vllm_kv", lambda: _serve("pytest-kv", vllm_env.KV_PRESSURE_ARGS))


@pytest.fixture(scope="module")
def real_vllm_dp() -> Iterator[RealServer]:
    """A data-parallel server: two engines of 8 blocks, two sequences each (`--data-parallel-size 2` plus the
    KV-pressure arguments); started for the module that asks for it and stopped after it."""
    _skip_if_absent()
    external = os.environ.get("MOSAIC_REAL_VLLM_DP_URL")  # e.g. `real_vllm.sh start --name dp --kv-pressure
    if external:  # -- --data-parallel-size 2`
        if not health_ok(external):
            pytest.fail(f"MOSAIC_REAL_VLLM_DP_URL={external} does not answer /health")
        yield RealServer(url=external.rstrip("/"), model=vllm_env.SERVED_MODEL_NAME, process=None)
        return
    yield from _serve("pytest-dp", ("--data-parallel-size", "2", *vllm_env.KV_PRESSURE_ARGS))


@pytest.fixture(scope="module")
def real_vllm_lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    """A server with the LoRA adapters of `LORA_ADAPTERS` (rank 8, q_proj/v_proj, written by build_lora.py into a
    tmp dir, ~2 s) and `--max-loras 1`: one adapter per batch, so a request for another adapter waits in vLLM's
    queue. `--enable-per-request-metrics` adds engine timings (`queue_time_ms`...) to each answer's `metrics`.
    Started for the module that asks for it and stopped after it (~20 s warm). Runtime loading is on
    (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`): a test that loads an adapter unloads it again, so the others see
    only these two. vLLM's filesystem resolver serves their folder (`VLLM_LORA_RESOLVER_CACHE_DIR`), where
    `RESOLVABLE_ADAPTER` waits for a request naming it (a test that names it unloads it again too)."""
    _skip_if_absent()
    cache = tmp_path_factory.mktemp("lora")
    try:
        built = write_adapters(cache, {**LORA_ADAPTERS, RESOLVABLE_ADAPTER: 3})
        dirs = {name: built[name] for name in LORA_ADAPTERS}
    except RuntimeError as exc:
        pytest.fail(f"could not build the LoRA adapters: {exc}")
    args = (
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        str(LORA_RANK),
        "--enable-per-request-metrics",
        "--lora-modules",
        *(f"{name}={path}" for name, path in dirs.items()),
    )
    env = RUNTIME_LORA_ENV | {"VLLM_LORA_RESOLVER_CACHE_DIR": str(cache)}
    yield from _serve("pytest-lora", args, adapters=tuple(dirs), extra_env=env)


POOLING_ARGS = ("--runner", "pooling", "--convert", "embed")  # an embedding server of the tiny Llama


@pytest.fixture
def real_vllm_pooling() -> RealServer:
    """A pooling (embedding) server, `--runner pooling --convert embed`: /v1/embeddings, no completions.
    Kept while the tests that ask for it run one after another (test_embeddings_fidelity.py, its scoring twin
    test_embeddings_scoring_fidelity.py, then the gateway in front of it, test_embeddings_vllm.py: one start;
    the module names keep them adjacent) and stopped after them; `MOSAIC_REAL_VLLM_POOLING_URL`
    points it at one already running (`real_vllm.sh start --name emb -- --runner pooling --convert embed`)."""
    _skip_if_absent()
    external = os.environ.get("MOSAIC_REAL_VLLM_POOLING_URL")
    if external:
        if not health_ok(external):
            pytest.fail(f"MOSAIC_REAL_VLLM_POOLING_URL={external} does not answer /health")
        return RealServer(url=external.rstrip("/"), model=vllm_env.SERVED_MODEL_NAME, process=None)
    return _keep("real_vllm_pooling", lambda: _serve("pytest-pooling", POOLING_ARGS))


# a reranker (cross-encoder) of the tiny Llama: one score from the classify head, vLLM's scoring API needs one label
RERANKER_ARGS = ("--runner", "pooling", "--convert", "classify", "--hf-overrides", '{"num_labels": 1}')


@pytest.fixture(scope="module")
def real_vllm_reranker() -> Iterator[RealServer]:
    """A reranker server (`--runner pooling --convert classify`, one label): /score and /rerank run each
    (query, document) pair as one prompt, and it has no /v1/embeddings; started for the module that asks for
    it. `MOSAIC_REAL_VLLM_RERANKER_URL` points it at one already running."""
    _skip_if_absent()
    external = os.environ.get("MOSAIC_REAL_VLLM_RERANKER_URL")
    if external:
        if not health_ok(external):
            pytest.fail(f"MOSAIC_REAL_VLLM_RERANKER_URL={external} does not answer /health")
        yield RealServer(url=external.rstrip("/"), model=vllm_env.SERVED_MODEL_NAME, process=None)
        return
    yield from _serve("pytest-reranker", RERANKER_ARGS)


def gateway_available() -> str | None:
    """Why the gateway cannot be put in front of the real server yet, or None when it can."""
    for module in ("server.app", "server.config"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"Mosaic gateway not importable yet ({exc})"
    return None


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mosaic worker` (the simulator) serving the same tiny model: its catalog row, name, block size, length."""
    yield from _sim_worker(tmp_path_factory)


@pytest.fixture(scope="module")
def sim_dp_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The simulated worker configured as `real_vllm_dp`: two engines of 8 blocks, two sequences each."""
    yield from _sim_worker(
        tmp_path_factory, "--data-parallel-size", "2", "--num-gpu-blocks", "8", "--max-num-seqs", "2"
    )


@pytest.fixture(scope="module")
def sim_lora_url(real_vllm_lora: RealServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The simulated worker set up as `real_vllm_lora`: its adapters (names and directories, read from its
    /v1/models), `--max-loras 1`, and runtime loading on through vLLM's own variable."""
    cards = httpx.get(f"{real_vllm_lora.url}/v1/models", timeout=30).json()["data"]
    modules = [f"{c['id']}={c['root']}" for c in cards if c["parent"] is not None]
    yield from _sim_worker(
        tmp_path_factory, "--max-loras", "1", "--lora-modules", *modules, env=RUNTIME_LORA_ENV
    )


@pytest.fixture(scope="module")
def sim_pooling_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The simulated worker as an embedding server (`--runner pooling`), the tiny model's 128 hidden floats."""
    yield from _sim_worker(tmp_path_factory, "--runner", "pooling")


def _sim_worker(
    tmp_path_factory: pytest.TempPathFactory, *extra_args: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    if importlib.util.find_spec("simulator.worker_app") is None:
        pytest.skip("simulated worker (simulator/worker_app.py) not present yet")
    port = free_port()
    log_path = tmp_path_factory.mktemp("sim") / "worker.log"
    cmd = [
        str(Path(sys.executable).with_name("mosaic")),
        "worker",
        "--gpu",
        "CPU-AVX2",
        "--model",
        SIM_MODEL,
        "--catalog",
        str(CATALOG),
        "--served-model-name",
        SIM_MODEL,
        "--max-model-len",
        "512",
        "--block-size",
        "128",
        "--port",
        str(port),
        *extra_args,
    ]
    with log_path.open("wb") as log:
        # this checkout's code first: the venv's `mosaic` may be an editable install of another worktree
        path = os.pathsep.join(p for p in (str(vllm_env.REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **(env or {}), "PYTHONPATH": path}
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while not health_ok(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"simulated worker did not start:\n{log_tail(log_path)}")
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=20)


@pytest.fixture(scope="session")
def mosaic_gateway(
    real_vllm: RealServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MosaicGateway]:
    """`mosaic serve` with one static pool in front of the session's real vLLM server."""
    reason = gateway_available()
    if reason is not None:
        pytest.skip(reason)
    config = static_config(real_vllm.model, [real_vllm.url])
    with MosaicGateway(config, tmp_path_factory.mktemp("mosaic-gw")) as gateway:
        gateway.wait_ready()
        yield gateway


@pytest.fixture(params=["vllm", "mosaic"], ids=["vllm direct", "through mosaic"])
def target(request: pytest.FixtureRequest, real_vllm: RealServer) -> Target:
    if request.param == "vllm":
        return Target("vllm", real_vllm.url, real_vllm.model)
    gateway: MosaicGateway = request.getfixturevalue("mosaic_gateway")
    return gateway.target(real_vllm.model)
