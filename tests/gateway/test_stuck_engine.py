"""`health.stuck_engine_s`: a vLLM whose engine hangs in a step keeps answering `/health` 200 (it asks only
whether the engine process died), its scheduler gauges freeze with requests running and its token counters stop.
Such a worker now fails its health checks, so the breaker keeps new requests off it, its silent connections are
severed (`health.sever_silent_requests`) and its probes fail until its engine steps again. Before, every request
sent there waited its first-token or stall timeout (60 s each), and each probe's `/health` 200 let more in."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from types import SimpleNamespace

import httpx
import pytest

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from scheduler.fleet import Role, capacity_for
from server.config import HealthConfig, ScrapeConfig
from server.discovery import StaticSource
from server.gateway import Gateway
from server.metrics import GatewayMetrics
from server.registry import PoolInfo, Registry, WorkerRecord, _engine_stalls
from server.scrape import EngineMarks, WorkerStats
from tests.gateway.fakes import config, pool
from tests.gateway.scripted_http import SSE_HEAD, chunk
from tests.gateway.test_faults import CHAT, metric
from tests.gateway.test_sever_silent import ScriptedWorker, _chat, _token, fleet


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _metrics(running: int, prompt: float | None, generation: float | None) -> str:
    lines = [f'vllm:num_requests_running{{engine="0"}} {running}']
    if prompt is not None:
        lines.append(f'vllm:prompt_tokens_total{{engine="0"}} {prompt}')
    if generation is not None:
        lines.append(f'vllm:generation_tokens_total{{engine="0"}} {generation}')
    return "\n".join(lines) + "\n"


class _Engine:
    """What a worker's `/health` and `/metrics` answer: health always 200 (as a vLLM whose engine hangs)."""

    def __init__(self) -> None:
        self.running = 2
        self.prompt: float | None = 500.0
        self.generation: float | None = 100.0
        self.waiting = 0
        self.kv_usage = 0.25
        self.scrapes = 0
        self.paused: dict[str, bool] = {}  # what a dev-mode vLLM's /is_paused and /is_sleeping say
        self.metrics_down = False
        self.completions: list[dict[str, object]] = []  # the 1-token completions its probes asked for
        self.generates = False  # whether it answers them (else they time out, as on a hung engine)
        self.completions_status: int | None = None  # a status it answers them with instead
        self.embeddings: list[dict[str, object]] = []  # a pooling worker's probes: one-word embeddings
        self.reranker = False  # a cross-encoder: no /v1/embeddings (404), /score instead
        self.scores: list[dict[str, object]] = []  # a reranker's probes: the score of one pair
        self.classifier = False  # several labels: no /v1/embeddings nor /score (404s), /classify instead
        self.classifications: list[dict[str, object]] = []  # a classifier's probes: one word's labels

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            if self.metrics_down:
                return httpx.Response(500)
            self.scrapes += 1
            text = _metrics(self.running, self.prompt, self.generation)
            text += f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
            text += f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv_usage}\n'
            return httpx.Response(200, text=text)
        if path == "/v1/completions":
            self.completions.append(json.loads(request.content))
            if self.completions_status is not None:
                return httpx.Response(self.completions_status, json={"error": {"message": "no"}})
            if not self.generates:
                raise httpx.ReadTimeout("no answer", request=request)
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "!"}]})
        if path == "/classify" and self.classifier:
            self.classifications.append(json.loads(request.content))
            if not self.generates:
                raise httpx.ReadTimeout("no answer", request=request)
            return httpx.Response(200, json={"data": [{"index": 0, "probs": [0.5, 0.5]}]})
        if path == "/score" and not self.classifier:
            self.scores.append(json.loads(request.content))
            if not self.generates:
                raise httpx.ReadTimeout("no answer", request=request)
            return httpx.Response(200, json={"data": [{"index": 0, "score": 0.5}]})
        if path == "/v1/embeddings" and not (self.reranker or self.classifier):
            self.embeddings.append(json.loads(request.content))
            if not self.generates:
                raise httpx.ReadTimeout("no answer", request=request)
            return httpx.Response(200, json={"data": [{"index": 0, "embedding": [1.0]}]})
        if path.removeprefix("/") in self.paused:
            return httpx.Response(200, json={path.removeprefix("/"): self.paused[path.removeprefix("/")]})
        return httpx.Response(404)


async def _registry(
    engine: _Engine, clock: _Clock, window: Callable[[int | None], float] | None, pooling: bool = False
) -> tuple[httpx.AsyncClient, Registry, WorkerRecord]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(engine.handler))
    reg = Registry(
        ScrapeConfig(stale_after_s=5.0), HealthConfig(), GatewayMetrics(), client=client, clock=clock
    )
    info = PoolInfo(
        "p",
        "llama-3-8b",
        "L4",
        Role.MIXED,
        capacity_for("L4", "llama-3-8b"),
        stuck_window=window,
        pooling=pooling,
    )
    reg.add_pool(info, StaticSource(["http://w1:8000"]))
    await reg.resync("p")
    return client, reg, reg.records()[0]


async def _judged_after_the_window(reg: Registry, rec: WorkerRecord, clock: _Clock, before_s: float) -> None:
    """A stall began at the last scrape (window 10 s): `before_s` later a check still passes; then a scrape and a
    check every 2 s, each failing, the third making the worker unhealthy."""
    clock.t += before_s
    await reg.scrape_once()
    await reg.health_once()
    assert (rec.health_ok, rec.health_failures) == (True, 0)
    for failures in (1, 2, 3):
        clock.t += 2.0
        await reg.scrape_once()
        await reg.health_once()
        assert rec.health_failures == failures


def test_a_worker_whose_counters_stand_still_with_requests_running_fails_its_checks_then_recovers() -> None:
    """Window 10 s, 3 failed checks to go unhealthy: stalled from t=1 (the first scrape is no evidence), no
    verdict at t=9, a failed check from t=11 on (every 2 s) with the reason in `last_error`, unhealthy (and `on_unhealthy`
    called: the gateway severs its silent connections) at the third; once a counter moves it passes again."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        unhealthy: list[str] = []
        reg.on_unhealthy = lambda r: unhealthy.append(r.id)
        await reg.scrape_once()
        assert rec.stalled_since is None  # nothing to compare with
        clock.t += 1.0
        await reg.scrape_once()
        assert rec.stalled_since == 1001.0
        await _judged_after_the_window(reg, rec, clock, 8.0)
        assert rec.last_error == "engine stuck: 2 request(s) running and no engine step for 14 s"
        assert rec.health_ok is False and unhealthy == [rec.id]
        assert rec.engine_stuck and reg.describe()[0]["engine_stuck"] is True
        assert rec.breaker.is_open(clock.t)  # failed checks count toward failure_threshold
        engine.generation = 101.0  # the engine stepped once: it is not stuck
        clock.t += rec.breaker.open_s
        await reg.health_once()  # the probe scrapes it first: the breaker kept it out of the scrape rounds
        assert rec.stalled_since is None
        assert rec.health_ok is True and not rec.breaker.is_open(clock.t)
        assert not rec.engine_stuck
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


def test_a_stuck_worker_fails_its_probes_while_its_counters_stand_still() -> None:
    """Its breaker open and no request of ours there, it is not scraped; each probe scrapes it before judging,
    so a `/health` 200 does not let requests back onto an engine that still counts nothing."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        for _ in range(2):
            await reg.scrape_once()
            clock.t += 11.0
        for _ in range(3):
            await reg.scrape_once()
            await reg.health_once()
        assert rec.breaker.is_open(clock.t)
        scrapes = engine.scrapes
        clock.t += 60.0  # the stats are stale now: only the probe's own scrape can judge
        await reg.scrape_once()
        assert engine.scrapes == scrapes  # an open breaker's worker is left out of the rounds
        await reg.health_once()
        assert engine.scrapes == scrapes + 1
        assert rec.breaker.is_open(clock.t) and rec.last_error is not None
        assert rec.last_error.startswith("engine stuck: 2 request(s) running")
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


def test_an_engine_hung_while_idle_is_judged_stuck_once_a_request_sent_there_is_not_taken_up() -> None:
    """An engine that hung in the first step after it was idle (a collective that never returns) leaves its
    gauges at zero running and waiting, so the running-stall rule sees nothing. A request of ours sent there
    0.5 s after a scrape, then marks unchanged at the next (0.5 s later): the stall begins then (t=1001); window
    10 s, 3 failed checks to go unhealthy, with its own reason. Once the request ends (the gateway severs it) there is
    no evidence left: the probe passes, and the next request sent there would show it again."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        engine.running = 0
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        unhealthy: list[str] = []
        reg.on_unhealthy = lambda r: unhealthy.append(r.id)
        await reg.scrape_once()
        clock.t += 0.5
        ticket = reg.track(rec.id, 100)
        clock.t += 0.5
        await reg.scrape_once()  # no step since the request: the stall begins
        assert (rec.untaken_since, rec.stalled_since) == (1001.0, 1001.0)
        await _judged_after_the_window(reg, rec, clock, 8.0)
        assert rec.last_error == (
            "engine stuck: none running or waiting, request(s) sent there not taken up, and no engine step "
            "for 14 s"
        )
        assert rec.health_ok is False and unhealthy == [rec.id] and rec.engine_stuck
        ticket.done()  # severed: nothing of ours waits there now, so its marks show nothing more
        clock.t += rec.breaker.open_s
        await reg.health_once()  # the probe: /health 200, marks unchanged, and a 1-token completion
        assert (rec.untaken_since, rec.stalled_since) == (None, None)
        assert engine.completions == [{"model": "llama-3-8b", "prompt": "ping", "max_tokens": 1}]
        assert (
            rec.last_error == "engine stuck: a 1-token completion sent as its probe had no answer within 1 s"
        )
        assert rec.breaker.is_open(clock.t) and rec.engine_stuck
        engine.generates = (
            True  # resumed: an engine whose only request was aborted unscheduled reports no step
        )
        clock.t += 2 * rec.breaker.open_s  # the backoff after a failed probe
        await reg.health_once()
        assert len(engine.completions) == 2 and rec.health_ok is True and not rec.engine_stuck
        assert not rec.breaker.is_open(clock.t) and not rec.untaken_stuck
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(
    "task", ["embed", "score", "classify"], ids=["embedding model", "reranker", "classifier"]
)
def test_a_pooling_worker_hung_while_idle_is_probed_with_a_request_of_its_task(task: str) -> None:
    """A pooling worker (`runner: pooling`) serves no completions (vLLM has no such route there: a 404 the probe
    would pass as refused), so its probe asks for the embedding of one word, or, on a reranker, which serves
    no embeddings either, the score of one pair, or on a classifier of several labels, which has neither, the
    classification of one word: unanswered → still stuck, answered → back."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        engine.running = 0
        engine.reranker, engine.classifier = task == "score", task == "classify"
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0, pooling=True)
        await reg.scrape_once()
        clock.t += 0.5
        ticket = reg.track(rec.id, 100)
        clock.t += 0.5
        await reg.scrape_once()
        await _judged_after_the_window(reg, rec, clock, 8.0)
        ticket.done()
        clock.t += rec.breaker.open_s
        await reg.health_once()
        probed = {"embed": engine.embeddings, "score": engine.scores, "classify": engine.classifications}[
            task
        ]
        asked = {"queries": "ping", "documents": "ping"} if task == "score" else {"input": "ping"}
        assert probed == [{"model": "llama-3-8b", **asked}] and engine.completions == []
        assert rec.breaker.is_open(clock.t) and rec.engine_stuck and rec.untaken_stuck
        engine.generates = True
        clock.t += 2 * rec.breaker.open_s
        await reg.health_once()
        assert len(probed) == 2 and rec.health_ok is True and not rec.untaken_stuck
        assert engine.scores == [] or task == "score"  # an embedding model is never asked for a score
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("shown_by", ["a step", "an answer", "a refused probe"])
def test_a_worker_judged_hung_while_idle_is_back_once_it_shows_it_takes_requests(shown_by: str) -> None:
    """Judged hung while idle and its request severed, a probe passes without asking for a completion once its
    marks changed (it stepped for someone) or a request of ours there was answered; a probe completion refused
    with a 4xx (refused before the engine: a name or prompt it does not take) shows nothing and passes."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        engine.running = 0
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        await reg.scrape_once()
        clock.t += 0.5
        ticket, other = reg.track(rec.id, 100), reg.track(rec.id, 100)
        clock.t += 0.5
        await reg.scrape_once()
        await _judged_after_the_window(reg, rec, clock, 8.0)
        assert rec.untaken_stuck and rec.breaker.is_open(clock.t)
        ticket.done()
        if shown_by == "a step":
            other.done()
            engine.prompt = 501.0
        elif shown_by == "an answer":
            other.answered()  # its first byte came after all
        else:
            other.done()
            engine.completions_status = 404
        clock.t += rec.breaker.open_s
        await reg.health_once()
        assert rec.health_ok is True and not rec.untaken_stuck and not rec.breaker.is_open(clock.t)
        assert len(engine.completions) == (1 if shown_by == "a refused probe" else 0)
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(
    "case",
    [
        "sent before the marks changed",
        "waiting for a connection slot",
        "answered",
        "a request waiting in the engine",
        "no token counters",
        "a gauge moved",
    ],
)
def test_no_untaken_verdict_without_evidence(case: str) -> None:
    """What does not show an engine hung while idle: a request sent before the engine last stepped (it took
    it, and the answer is on its way), one still waiting for a connection slot of the gateway's (not sent), one
    whose first byte came (`answered` also ends a stall already begun), an engine with a request waiting (its
    own queue: a P/D decode side waiting for its KV, a LoRA slot), a worker without token counters, an engine
    that steps."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        engine.running = 0
        engine.prompt, engine.generation = (None, None) if case == "no token counters" else (500.0, 100.0)
        engine.waiting = 1 if case == "a request waiting in the engine" else 0
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        await reg.scrape_once()
        clock.t += 0.5
        slot = SimpleNamespace(waiting=case == "waiting for a connection slot")
        ticket = reg.track(rec.id, 100, slot=slot)
        if case == "sent before the marks changed":
            engine.prompt = 600.0
        clock.t += 0.5
        await reg.scrape_once()
        if case == "answered":
            assert rec.untaken_since == 1001.0
            ticket.answered()
            assert (rec.untaken_since, rec.stalled_since) == (None, None)
        for _ in range(15):
            clock.t += 1.0
            if case == "a gauge moved":
                engine.kv_usage += 0.01
            await reg.scrape_once()
        assert (rec.untaken_since, reg.stuck(rec, clock.t)) == (None, None)
        await reg.health_once()
        assert (rec.health_ok, rec.health_failures) == (True, 0)
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(
    "window, running, prompt, generation, after_s",
    [
        pytest.param(None, 2, 500.0, 100.0, 60.0, id="stuck_engine_s off"),
        pytest.param(10.0, 0, 500.0, 100.0, 60.0, id="nothing running: an idle engine counts nothing"),
        pytest.param(10.0, 2, None, None, 60.0, id="no token counters: not a vLLM, no evidence"),
        pytest.param(10.0, 2, 500.0, 100.0, 9.5, id="within the window"),
    ],
)
def test_no_verdict_without_evidence(
    window: float | None, running: int, prompt: float | None, generation: float | None, after_s: float
) -> None:
    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        engine.running, engine.prompt, engine.generation = running, prompt, generation
        client, reg, rec = await _registry(
            engine, clock, None if window is None else (lambda context: window)
        )
        await reg.scrape_once()
        clock.t += 1.0
        await reg.scrape_once()
        clock.t += after_s - 1.0
        await reg.scrape_once()
        await reg.health_once()
        assert reg.stuck(rec, clock.t) is None
        assert (rec.health_ok, rec.health_failures) == (True, 0)
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


def test_stale_stats_give_no_verdict() -> None:
    """A worker whose `/metrics` stopped answering (its last stats older than `stale_after_s`) is not judged
    by stats that old: a frozen process fails `/health` on its own."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        await reg.scrape_once()
        clock.t += 1.0
        await reg.scrape_once()
        clock.t += 30.0
        assert rec.stalled_since == 1001.0
        assert reg.stuck(rec, clock.t) is None
        await reg.scrape_once()
        assert reg.stuck(rec, clock.t) == "engine stuck: 2 request(s) running and no engine step for 30 s"
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


def _stats(
    running: int | None, prompt: float | None, generation: float | None, waiting: int = 0, kv: float = 0.5
) -> WorkerStats:
    """One engine's scrape (label "0")."""
    return WorkerStats(engine_marks=(EngineMarks("0", running, waiting, kv, prompt, generation),))


@pytest.mark.parametrize(
    "before, after, was, expected",
    [
        pytest.param(_stats(1, 5, 9), _stats(1, 5, 9), None, 7.0, id="begins now"),
        pytest.param(_stats(1, 5, 9), _stats(1, 5, 9), 3.0, 3.0, id="goes on from when it began"),
        pytest.param(_stats(1, 5, 9), _stats(1, 5, 10), 3.0, None, id="a generated token ends it"),
        pytest.param(_stats(1, 5, 9), _stats(1, 6, 9), 3.0, None, id="a finished prefill ends it"),
        pytest.param(_stats(1, 5, 9), _stats(1, 0, 0), 3.0, None, id="counters reset: a restarted server"),
        pytest.param(_stats(1, 5, 9), _stats(0, 5, 9), 3.0, None, id="nothing running"),
        pytest.param(_stats(1, None, 9), _stats(1, None, 9), None, 7.0, id="only one counter exported"),
        pytest.param(_stats(1, None, 9), _stats(1, 5, 9), 3.0, None, id="a counter that appears is movement"),
        pytest.param(
            _stats(1, 5, 9), _stats(1, 5, 9, kv=0.6), 3.0, None, id="a prefill chunk's blocks end it"
        ),
        pytest.param(
            _stats(1, 5, 9), _stats(1, 5, 9, waiting=1), 3.0, None, id="a gauge that changed ends it"
        ),
        pytest.param(_stats(2, 5, 9), _stats(1, 5, 9), 3.0, None, id="fewer running: a step ended one"),
        pytest.param(_stats(1, None, None), _stats(1, None, None), None, None, id="no counter: no evidence"),
        pytest.param(None, _stats(1, 5, 9), None, None, id="first scrape"),
    ],
)
def test_engine_stalls(
    before: WorkerStats | None, after: WorkerStats, was: float | None, expected: float | None
) -> None:
    stalls = _engine_stalls({} if was is None else {"0": was}, before, after, 7.0)
    assert stalls == ({} if expected is None else {"0": expected})


def test_one_hung_engine_of_a_data_parallel_server_is_seen_beside_working_ones() -> None:
    """Two engines (`engine` 0 and 1): rank 0 steps, rank 1 stands still with a request running. Their sums
    move, which hid rank 1; each engine is judged apart, and the reason names the hung one."""

    def scrape(generated: float) -> str:
        return (
            f'vllm:num_requests_running{{engine="0"}} 3\nvllm:num_requests_running{{engine="1"}} 1\n'
            f'vllm:generation_tokens_total{{engine="0"}} {generated}\nvllm:generation_tokens_total{{engine="1"}} 40\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 0.2\n'
        )

    async def run() -> None:
        clock, generated = _Clock(), iter(range(100, 10_000, 10))

        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/metrics":
                return httpx.Response(200, text=scrape(next(generated)))
            return httpx.Response(200 if request.url.path == "/health" else 404)

        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        reg = Registry(
            ScrapeConfig(stale_after_s=5.0), HealthConfig(), GatewayMetrics(), client=client, clock=clock
        )
        info = PoolInfo(
            "p",
            "llama-3-8b",
            "L4",
            Role.MIXED,
            capacity_for("L4", "llama-3-8b", dp=2),
            stuck_window=lambda c: 10.0,
        )
        reg.add_pool(info, StaticSource(["http://w1:8000"]))
        await reg.resync("p")
        rec = reg.records()[0]
        for _ in range(12):
            await reg.scrape_once()
            clock.t += 1.0
        assert rec.engine_stalls == {"1": 1001.0}
        assert rec.stats is not None and rec.stats.generation_tokens_total == 40 + 210  # the sum moved
        await reg.scrape_once()
        assert (
            reg.stuck(rec, clock.t)
            == "engine stuck: 1 request(s) running on engine 1 and no engine step for 11 s"
        )
        (worker,) = json.loads(json.dumps(reg.describe()))  # /admin/workers shows each engine's marks
        assert [m["engine"] for m in worker["stats"]["engine_marks"]] == ["0", "1"]
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


def test_the_window_covers_the_longest_prefill_of_the_served_context() -> None:
    """`stuck_engine_s` (30 s), or twice the perf model's prefill of a whole-context prompt when that is longer
    (vLLM counts a prompt only once its prefill is done), for the context the worker serves, in wall seconds
    for a simulated pool slower than real time."""
    cfg = config(
        pool("l4", "L4", "mixed"),
        pool("slow", "H100", "mixed", endpoints={"simulated": {"replicas": 1, "time_scale": 0.5}}),
        models=[{"name": "llama-3-8b", "spec": "llama-3.1-8b"}],
    )
    gateway = Gateway(cfg)
    catalog = load_catalog()
    l4 = PerfModel(catalog.gpu("L4"), catalog.model("llama-3.1-8b"), 1)
    window = gateway._pool_info(cfg.pools[0], catalog).stuck_window
    assert window is not None
    assert window(131_072) == pytest.approx(2 * l4.prefill_time([131_072]))  # 182 s: an L4's 128k prefill
    assert 180 < window(131_072) < 185
    assert window(8192) == 30.0  # 2 × 2.1 s is shorter than stuck_engine_s
    assert window(None) == 30.0
    slow = gateway._pool_info(cfg.pools[1], catalog).stuck_window
    assert slow is not None and slow(8192) == 60.0  # half real time: twice the wall seconds
    off = config(pool("l4", "L4", "mixed"), health={"stuck_engine_s": None})
    assert Gateway(off)._pool_info(off.pools[0], catalog).stuck_window is None


async def _stalled_for(reg: Registry, clock: _Clock, seconds: float) -> None:
    """Two scrapes 1 s apart (the stall begins at the second), then one `seconds` later."""
    await reg.scrape_once()
    clock.t += 1.0
    await reg.scrape_once()
    clock.t += seconds
    await reg.scrape_once()


@pytest.mark.parametrize("endpoint", ["is_paused", "is_sleeping"])
def test_an_engine_paused_or_asleep_on_purpose_is_not_judged_stuck(endpoint: str) -> None:
    """A vLLM in dev mode paused (`POST /pause?mode=keep`, an RL framework updating weights) or asleep keeps its
    requests and steps no more: its `/is_paused` or `/is_sleeping` says so, and it is not judged stuck.
    A hung engine cannot answer them."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        engine.paused[endpoint] = True
        await _stalled_for(reg, clock, 20.0)
        assert reg.stuck(rec, clock.t) is not None  # the evidence alone says stuck
        await reg.health_once()
        assert (rec.health_ok, rec.health_failures) == (True, 0)
        engine.paused[endpoint] = False
        await reg.health_once()
        assert rec.health_failures == 1
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


def test_no_stall_is_judged_while_a_lora_load_of_ours_holds_the_engine() -> None:
    """vLLM loads a LoRA adapter in its engine loop (from slow storage or the Hub: minutes): no step meanwhile.
    The gateway's own load (`LoraAdmin`) is such an `engine_call`: no verdict while it runs, and the stall it
    caused is forgotten when it ends."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        with reg.engine_call(rec):
            await _stalled_for(reg, clock, 60.0)
            await reg.health_once()
            assert (rec.health_ok, rec.health_failures) == (True, 0)
        assert rec.stalled_since is None
        clock.t += 1.0
        await reg.scrape_once()  # still standing still: a new stall begins, judged after its own window
        await reg.health_once()
        assert rec.stalled_since == clock.t and rec.health_failures == 0
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


def test_a_probe_that_cannot_read_metrics_again_fails() -> None:
    """Judged stuck, its breaker open: a probe whose scrape fails has no sign that the engine steps again, so it
    fails (before, stale stats gave no verdict and the probe's `/health` 200 let requests back on)."""

    async def run() -> None:
        clock, engine = _Clock(), _Engine()
        client, reg, rec = await _registry(engine, clock, lambda context: 10.0)
        await _stalled_for(reg, clock, 11.0)
        for _ in range(3):
            await reg.health_once()
        assert rec.breaker.is_open(clock.t)
        engine.metrics_down = True
        clock.t += 60.0
        await reg.health_once()
        assert rec.breaker.is_open(clock.t)
        assert rec.last_error == "engine stuck: 2 request(s) running at the last scrape 71 s ago, none since"
        await reg.stop()
        await client.aclose()

    asyncio.run(run())


async def _one_of_two_retried_elsewhere(
    client: httpx.AsyncClient, gw: Gateway, hung: ScriptedWorker, stream: bool
) -> WorkerRecord:
    """Two requests at once, round robin: both answered 200 within 8 s, one of them retried for the worker being
    unhealthy (not at its first-token timeout, 20 s here). The hung worker's record."""
    started = time.monotonic()
    answers = await asyncio.gather(*(client.post(CHAT, json=_chat(stream)) for _ in range(2)))
    took = time.monotonic() - started
    assert [a.status_code for a in answers] == [200, 200]
    assert took < 8, took
    assert metric(gw, "mosaic_retries_total", model="llama-3-8b", reason="unhealthy") == 1
    return next(r for r in gw.registry.records() if r.url == hung.url)


class HungEngineWorker(ScriptedWorker):
    """A worker on a real socket whose engine hangs at its first chat request: its `/health` still answers
    200, `/metrics` shows that request running and token counters that stopped, and the request gets nothing
    more (a stream, its first `tokens_before_freeze` tokens). Before that its counters move."""

    async def answer(self, path: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        if path == b"/health":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        if path == b"/metrics":
            if not self.frozen:
                self.generated += 10
            text = _metrics(1 if self.frozen else 0, 40.0, self.generated).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(text), text))
            return
        if path != CHAT.encode():
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        self.chats += 1
        self.frozen = True
        if json.loads(body).get("stream"):
            writer.write(SSE_HEAD)
            for i in range(self.tokens_before_freeze):
                writer.write(chunk(_token(f"t{i} ")))
            await writer.drain()
        await asyncio.sleep(3600)  # the engine never steps again; the gateway's abort ends this


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_on_a_hung_engine_is_retried_elsewhere_and_the_engine_kept_out(stream: bool) -> None:
    """Two requests at once, round robin: the one sent to the worker whose engine hangs (its `/health` still
    200) is served by the other worker in a few seconds (window 0.6 s: the H100's 8k prefill, twice; then
    2 failed checks 0.2 s apart, then its connection's 0.4 s of silence), not at its first-token timeout (20 s
    here, 60 s by default). Its probes (every 0.3 s and up) keep failing, so the next requests all go to the
    other worker."""

    async def body() -> None:
        hung, healthy = HungEngineWorker(), ScriptedWorker()
        async with fleet(hung, healthy, scrape_s=0.1, health={"stuck_engine_s": 0.5, "open_s": 0.3}) as (
            client,
            running,
        ):
            gw = running.gateway
            rec = await _one_of_two_retried_elsewhere(client, gw, hung, stream)
            await asyncio.sleep(1.5)  # several probes: /health 200 each time, the engine still stuck
            assert rec.breaker.is_open(time.monotonic()) and rec.last_error is not None
            assert rec.last_error.startswith("engine stuck: 1 request(s) running and no engine step for")
            assert metric(gw, "mosaic_worker_engine_stuck", worker=rec.id, pool="p") == 1
            other = next(r for r in gw.registry.records() if r is not rec)
            assert metric(gw, "mosaic_worker_engine_stuck", worker=other.id, pool="p") == 0
            for _ in range(4):
                assert (await client.post(CHAT, json=_chat(stream))).status_code == 200
            assert (hung.chats, healthy.chats) == (1, 6)
            assert gw.dispatcher.outcomes == {"completed": 6}

    asyncio.run(asyncio.wait_for(body(), 40))


class IdleHungEngineWorker(ScriptedWorker):
    """A worker on a real socket whose engine hung while idle: `/health` 200, `/metrics` shows nothing running
    or waiting and token counters that never move, and a request gets nothing (a stream: vLLM's response head,
    sent before the engine is asked, then nothing)."""

    probes = 0

    async def answer(self, path: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        if path == b"/health":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        if path == b"/metrics":
            text = _metrics(0, 40.0, 80.0).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(text), text))
            return
        if path == b"/v1/completions":  # the gateway's probe asks for one token: never answered either
            self.probes += 1
            await asyncio.sleep(3600)
        if path != CHAT.encode():
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        self.chats += 1
        if json.loads(body).get("stream"):
            writer.write(SSE_HEAD)
            await writer.drain()
        await asyncio.sleep(3600)  # the engine never takes it; the gateway's abort ends this


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_on_an_engine_hung_while_idle_is_retried_elsewhere(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Two requests at once, round robin: the one sent to the worker whose engine hung while idle (gauges at
    zero, `/health` 200) is served by the other worker in a few seconds, not at its first-token timeout (20 s
    here, 60 s by default), with the stuck-engine reason. Before, such a worker was never judged stuck: every
    request sent there waited out its timeout, and it looked idle to the router. Its probes ask it for a
    1-token completion, which it does not answer either, so the next requests all go to the other worker."""

    async def body() -> None:
        hung, healthy = IdleHungEngineWorker(), ScriptedWorker()
        async with fleet(hung, healthy, scrape_s=0.1, health={"stuck_engine_s": 0.5, "open_s": 0.3}) as (
            client,
            running,
        ):
            gw = running.gateway
            rec = await _one_of_two_retried_elsewhere(client, gw, hung, stream)
            assert (
                f"worker {rec.id} is unhealthy: engine stuck: none running or waiting, request(s) sent"
                in (caplog.text)
            )
            deadline = time.monotonic() + 10
            while hung.probes < 2:  # two probes (0.3 s, then 0.6 s of backoff): /health 200, no completion
                assert time.monotonic() < deadline, hung.probes
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the second probe's completion times out (0.2 s)
            assert rec.breaker.is_open(time.monotonic())
            assert (
                rec.last_error
                == "engine stuck: a 1-token completion sent as its probe had no answer within 0.2 s"
            )
            for _ in range(4):
                assert (await client.post(CHAT, json=_chat(stream))).status_code == 200
            assert (hung.chats, healthy.chats) == (1, 6)
            assert gw.dispatcher.outcomes == {"completed": 6}

    asyncio.run(asyncio.wait_for(body(), 40))
