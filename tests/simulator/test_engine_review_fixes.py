"""Engine defects a review found (each test failed before its fix): a landed one-token prompt leaking its
block, a preempted recompute ahead of a landed P/D request preempting itself forever, the prefix cache
evicting a freed request's head first (vLLM frees tail first), `run_offline` stopping while a P/D hold's
expiry would free blocks, and prefix-cache queries not counting prompts shorter than a block."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from simulator.engine import Engine, EngineConfig, run_offline
from simulator.prefix_cache import block_hashes
from simulator.requests import EngineRequest, KvTransfer

CATALOG = load_catalog()
H100 = PerfModel(CATALOG.gpu("H100"), CATALOG.model("llama-3-8b"))


@pytest.fixture
def deadline() -> Iterator[None]:
    """A loop that never ends fails the test after 20 s instead of hanging the suite."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError("the engine made no progress")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_landed_one_token_prompt_frees_its_block() -> None:
    """Its KV landed with 0 tokens computed (prompt − 1), so it went through the prefix-cache admission,
    which overwrote the block the transfer had allocated: one block leaked per such request."""
    cfg = EngineConfig(
        max_num_seqs=1,
        max_num_batched_tokens=1,
        block_size=1,
        num_gpu_blocks=4,
        max_model_len=2,
        enable_prefix_caching=True,
    )
    eng = Engine(H100, cfg, seed=1)
    for i in range(6):
        eng.add_request(EngineRequest(f"r{i}", [0], 1), 0.0)
    eng.add_request(EngineRequest("r6", [0], 1, kv_transfer=KvTransfer(remote_prefilled=True)), 0.0)
    records = run_offline(eng, [])
    assert sorted(r.request_id for r in records) == [f"r{i}" for i in range(7)]
    assert eng.kv.used == 0


def preempted_as_remote_kv_lands() -> Engine:
    """A (64 + 200 tokens) decodes alone and needs a block in the very step R's remote KV (240 tokens)
    lands, R holding the rest of the pool: that step preempts A and, as in vLLM, admits nothing."""
    cfg = EngineConfig(
        block_size=16, num_gpu_blocks=21, max_model_len=320, max_num_seqs=4, max_num_batched_tokens=64
    )
    probe = Engine(H100, cfg)
    probe.add_request(EngineRequest("A", 64, 200, ignore_eos=True), 0.0)
    starts, now = [], 0.0
    for _ in range(18):
        r = probe.step(now)
        starts.append(r.start)
        now = r.end
    delay = (starts[16] + starts[17]) / 2 - starts[1]  # lands in A's step that preempts it
    eng = Engine(H100, cfg)
    eng.add_request(EngineRequest("A", 64, 200, ignore_eos=True), 0.0)
    transfer = KvTransfer(remote_prefilled=True, transfer_delay_s=delay)
    eng.add_request(EngineRequest("R", 240, 50, ignore_eos=True, kv_transfer=transfer), 0.0)
    return eng


def test_a_preempted_recompute_does_not_starve_a_landed_request(deadline: None) -> None:
    """A decode preempted itself (pool full) in the step a remote KV landed; requeued ahead of the landed
    request, its recompute took the whole budget, could not grow while the landed one held the rest of the
    pool, preempted itself again, and so on forever (run_offline never returned)."""
    eng = preempted_as_remote_kv_lands()
    records = run_offline(eng, [])
    assert sorted(r.request_id for r in records) == ["A", "R"]
    assert eng.kv.used == 0 and not eng.has_work()


def test_the_prefix_cache_evicts_a_freed_requests_tail_first() -> None:
    """vLLM frees a request's blocks in reverse order, so its reusable prefix outlives its tail."""
    cfg = EngineConfig(
        block_size=16, num_gpu_blocks=7, max_model_len=96, enable_prefix_caching=True
    )  # 6 usable
    eng = Engine(H100, cfg, seed=0)
    prompt = list(range(64))  # 4 full blocks, cached and then freed
    now = 0.0
    eng.add_request(EngineRequest("a", prompt, 1, ignore_eos=True), now)
    now = eng.step(now).end
    # 48 unrelated tokens: 3 blocks where 2 are free, so one of a's cached blocks is evicted
    eng.add_request(EngineRequest("b", list(range(5000, 5048)), 1, ignore_eos=True), now)
    now = eng.step(now).end
    assert [h in eng._pc.refs for h in block_hashes(prompt, 16)] == [True, True, True, False]
    eng.add_request(EngineRequest("c", prompt, 1, ignore_eos=True), now)
    assert eng.step(now).num_prefill_tokens == 16 and eng.counters.prefix_cache_hits == 48


def test_run_offline_waits_for_a_hold_to_expire() -> None:
    """p's prefill-only KV is held for a decode peer that never pulls it; q needs those blocks. run_offline
    returned at once with q unfinished; the hold's expiry (1 s) frees them."""
    cfg = EngineConfig(
        block_size=16, num_gpu_blocks=5, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64
    )
    held = KvTransfer(prefill_only=True, hold_timeout_s=1.0)
    arrivals = [
        (0.0, EngineRequest("p", 48, 1, ignore_eos=True, kv_transfer=held)),
        (0.0, EngineRequest("q", 40, 4, ignore_eos=True)),
    ]
    records = {r.request_id: r for r in run_offline(Engine(H100, cfg), arrivals)}
    assert sorted(records) == ["p", "q"]
    assert records["q"].first_token is not None and records["q"].first_token > 1.0


def test_every_new_prompt_is_a_prefix_cache_query() -> None:
    """vLLM counts every new request's tokens as queried; prompts shorter than one block were left out,
    which overstated the exported hit rate."""
    eng = Engine(H100, EngineConfig(enable_prefix_caching=True))
    run_offline(
        eng,
        [
            (0.0, EngineRequest("short", list(range(10)), 4, ignore_eos=True)),
            (0.0, EngineRequest("long", list(range(100)), 4, ignore_eos=True)),
        ],
    )
    assert eng.counters.prefix_cache_queries == 110 == eng.counters.prompt_tokens
