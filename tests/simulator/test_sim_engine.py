"""Engine model semantics: token budget, chunked prefill, paged KV, preemption by recompute, finish rules."""

from __future__ import annotations

import pytest

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from simulator.engine import Engine, EngineConfig, StepResult, run_offline
from simulator.engine_types import LONG_MAX_MODEL_LEN_ENV, vllm_env_flag
from simulator.requests import EngineRequest, FinishReason

CATALOG = load_catalog()
H100 = PerfModel(CATALOG.gpu("H100"), CATALOG.model("llama-3-8b"))


def engine(**cfg: object) -> Engine:
    return Engine(H100, EngineConfig(**cfg), seed=0)  # type: ignore[arg-type]


def req(rid: str, prompt: int, max_tokens: int, **kw: object) -> EngineRequest:
    kw.setdefault("ignore_eos", True)
    return EngineRequest(rid, prompt, max_tokens, **kw)  # type: ignore[arg-type]


def drain(eng: Engine, now: float = 0.0, limit: int = 100_000) -> list[StepResult]:
    steps = []
    while eng.has_work() and len(steps) < limit:
        res = eng.step(now)
        steps.append(res)
        assert_kv_consistent(eng)
        now = res.end
    return steps


def assert_kv_consistent(eng: Engine) -> None:
    """Blocks in use = Σ blocks the requests hold, and each holds blocks_for(its KV tokens) (stock paging)."""
    if eng._pc is not None:
        assert_cache_consistent(eng)
        return
    views = eng.requests()
    assert eng.kv.used == sum(v.blocks for v in views)
    for v in views:
        if v.state in ("prefill", "decoding", "held"):
            assert v.blocks == -(-v.computed_tokens // eng.block_size), v
    assert eng.kv_usage == eng.kv.used / (eng.num_gpu_blocks - 1)  # less vLLM's null block


def test_token_budget_is_shared_by_decodes_and_prefill_chunks() -> None:
    eng = engine(max_num_batched_tokens=32, max_num_seqs=4)
    for i in range(3):
        eng.add_request(req(f"r{i}", 50, 5), 0.0)
    steps = drain(eng)
    # step 0: r0 gets 32 of its 50 prompt tokens; step 1: r0's last 18, then r1 gets 32 − 18 = 14;
    # step 2: r0 decodes (1 token), r1 gets 31 of its remaining 36;
    # step 3: r0 decodes (1), r1 its last 5, r2 gets 32 − 1 − 5 = 26.
    assert [s.num_prefill_tokens for s in steps[:4]] == [32, 18 + 14, 31, 5 + 26]
    assert [s.num_decodes for s in steps[:4]] == [0, 0, 1, 1]
    assert all(s.num_tokens <= 32 for s in steps)
    assert steps[1].first_tokens == ("r0",)
    assert steps[3].first_tokens == ("r1",)


def test_chunk_timing_uses_the_perf_model_totals() -> None:
    eng = engine(max_num_batched_tokens=64, max_num_seqs=4)
    eng.add_request(req("a", 100, 2), 0.0)
    s0, s1 = eng.step(0.0), None
    s1 = eng.step(s0.end)
    # chunk 1: 64 new tokens, 0 cached → pairs 64·(0 + 32) = 2048; chunk 2: 36 after 64 → 36·(64 + 18)
    assert s0.duration_s == pytest.approx(H100.step_time_totals(64, 64 * 32, 0, 0, 1))
    assert s1.duration_s == pytest.approx(H100.step_time_totals(36, 36 * (64 + 18), 0, 0, 1))
    s2 = eng.step(s1.end)  # one decode over 101 tokens of KV (100 prompt + the first output)
    assert s2.duration_s == pytest.approx(H100.step_time_totals(0, 0.0, 1, 101, 1))
    assert s2.finished[0].output_tokens == 2


def test_preemption_happens_exactly_when_blocks_run_out() -> None:
    # 6 usable blocks of 4 tokens (7 less vLLM's null block). A and B: 8-token prompts (2 blocks each), 10
    # output tokens, ignore_eos.
    eng = engine(block_size=4, num_gpu_blocks=7, max_model_len=24, max_num_seqs=4, max_num_batched_tokens=64)
    eng.add_request(req("A", 8, 10), 0.0)
    eng.add_request(req("B", 8, 10), 0.0)
    steps = drain(eng)
    # step 0: both prefilled (4 blocks). step 1: both decode position 8 → third block each: 6/6 used.
    # steps 2–4: positions 9–11 fit. step 5: both need a 4th block, none free → B (admitted last) is
    # preempted after 5 tokens; A takes one of the 3 freed blocks.
    assert [i for i, s in enumerate(steps) if s.preempted] == [5]
    assert steps[5].preempted == ("B",)
    assert eng.counters.preemptions == 1
    assert steps[5].decoded == ("A",)
    # step 6–9: B needs ceil(13/4) = 4 blocks to recompute 8 + 5 tokens but only 2 are free while A runs.
    assert all(s.num_prefill_tokens == 0 for s in steps[6:10])
    # A emits its 10th token in step 9 and frees its 5 blocks; step 10 recomputes B's 13 tokens.
    assert [r.request_id for r in steps[9].finished] == ["A"]
    assert steps[10].num_prefill_tokens == 13 and steps[10].prefilled == ("B",)
    assert steps[10].first_tokens == ()  # B's 6th token, not its first
    recs = {r.request_id: r for s in steps for r in s.finished}
    assert recs["B"].output_tokens == 10 and recs["B"].num_preemptions == 1
    assert eng.counters.recomputed_tokens == 8 + 5 - 1  # B's KV when preempted: its 5th token had no KV yet
    assert eng.counters.generation_tokens == 20


def test_kv_usage_equals_blocks_used_over_usable_blocks() -> None:
    """vLLM keeps one of num_gpu_blocks as its null block and reports usage over the rest (BlockPool's
    get_usage): 7 blocks hold 6 blocks of KV. Over all 7, usage read 6/7 with the cache full, and
    preemption came one block later than vLLM's."""
    eng = engine(block_size=4, num_gpu_blocks=7, max_model_len=24, max_num_seqs=4, max_num_batched_tokens=64)
    eng.add_request(req("A", 8, 10), 0.0)
    eng.add_request(req("B", 8, 10), 0.0)
    usages = []
    now = 0.0
    for _ in range(2):
        res = eng.step(now)
        now = res.end
        usages.append(eng.kv_usage)
    assert usages == [4 / 6, 6 / 6]  # 2+2 prompt blocks, then a third block each


def test_waiting_requests_never_preempt_and_max_num_seqs_caps_running() -> None:
    eng = engine(max_num_seqs=2, max_num_batched_tokens=1024)
    for i in range(5):
        eng.add_request(req(f"r{i}", 10, 3), 0.0)
    res = eng.step(0.0)
    assert res.first_tokens == ("r0", "r1")
    assert eng.num_running == 2 and eng.num_waiting == 3


@pytest.mark.parametrize(
    ("kw", "expected_out", "reason"),
    [
        pytest.param(
            {"ignore_eos": True}, 7, FinishReason.LENGTH, id="ignore_eos runs to max_tokens → length"
        ),
        pytest.param(
            {"natural_output_tokens": 3}, 3, FinishReason.STOP, id="natural EOS before max_tokens → stop"
        ),
        pytest.param(
            {"natural_output_tokens": 3, "min_tokens": 5}, 5, FinishReason.STOP, id="min_tokens delays EOS"
        ),
        pytest.param(
            {"natural_output_tokens": 7}, 7, FinishReason.LENGTH, id="EOS exactly at max_tokens → length"
        ),
        pytest.param(
            {"natural_output_tokens": 50}, 7, FinishReason.LENGTH, id="EOS after max_tokens → length"
        ),
    ],
)
def test_finish_rules(kw: dict, expected_out: int, reason: FinishReason) -> None:
    eng = engine()
    eng.add_request(EngineRequest("x", 12, 7, **kw), 0.0)
    recs = [r for s in drain(eng) for r in s.finished]
    assert (recs[0].output_tokens, recs[0].finish_reason) == (expected_out, reason)
    assert eng.counters.success[reason.value] == 1


def test_max_tokens_is_clamped_to_max_model_len() -> None:
    eng = engine(max_model_len=64)
    eng.add_request(req("x", 60, 100), 0.0)
    recs = [r for s in drain(eng) for r in s.finished]
    assert recs[0].output_tokens == 4 and recs[0].finish_reason is FinishReason.LENGTH  # 64 − 60


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        pytest.param(EngineRequest("p", 64, 5), "no room for output", id="prompt = max_model_len → refused"),
        pytest.param(EngineRequest("p", 0, 5), "at least one token", id="empty prompt → refused"),
        pytest.param(EngineRequest("p", 5, 0), "max_tokens", id="max_tokens 0 → refused"),
        pytest.param(
            EngineRequest("p", 5, 5, min_tokens=6), "min_tokens", id="min_tokens > max_tokens → refused"
        ),
    ],
)
def test_bad_requests_raise(request_: EngineRequest, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine(max_model_len=64).add_request(request_, 0.0)


def test_duplicate_id_and_bad_config_raise() -> None:
    eng = engine()
    eng.add_request(req("a", 5, 5), 0.0)
    with pytest.raises(ValueError, match="already"):
        eng.add_request(req("a", 5, 5), 0.0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=512, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="exceeds the KV cache capacity"):
        Engine(H100, EngineConfig(num_gpu_blocks=4, block_size=16, max_model_len=100))


def test_a_max_model_len_past_the_models_context_needs_vllms_long_max_model_len_flag() -> None:
    """vLLM refuses a --max-model-len over the model's max_position_embeddings at start-up unless env
    VLLM_ALLOW_LONG_MAX_MODEL_LEN is set; the simulated worker started with any length that fit the KV."""
    context = H100.model.max_context
    with pytest.raises(ValueError, match=rf"User-specified max_model_len \({context + 1}\) is greater"):
        Engine(H100, EngineConfig(max_model_len=context + 1))
    assert Engine(H100, EngineConfig(max_model_len=context)).max_model_len == context
    allowed = Engine(H100, EngineConfig(max_model_len=context + 1, allow_long_max_model_len=True))
    assert allowed.max_model_len == context + 1
    on = [vllm_env_flag({LONG_MAX_MODEL_LEN_ENV: v}, LONG_MAX_MODEL_LEN_ENV) for v in ("1", " TRUE ", "true")]
    off = [vllm_env_flag({LONG_MAX_MODEL_LEN_ENV: v}, LONG_MAX_MODEL_LEN_ENV) for v in ("0", "yes", "on", "")]
    assert on == [True] * 3 and off == [False] * 4 and not vllm_env_flag({}, LONG_MAX_MODEL_LEN_ENV)


def test_determinism_for_a_seed_and_natural_lengths_follow_the_prompt() -> None:
    def run(seed: int) -> list[tuple]:
        eng = Engine(H100, EngineConfig(max_num_seqs=8, num_gpu_blocks=64), seed=seed)
        arrivals = [(0.01 * i, EngineRequest(f"r{i}", list(range(i, i + 20 + i)), 400)) for i in range(30)]
        return [
            (r.request_id, r.output_tokens, r.finished, r.num_preemptions) for r in run_offline(eng, arrivals)
        ]

    first = run(0)
    assert first == run(0)
    assert first != run(1)
    # the same token ids give the same natural length whatever the request id (temperature-0 model)
    e = Engine(H100, EngineConfig(), seed=3)
    e.add_request(EngineRequest("a", [1, 2, 3], 10_000), 0.0)
    e.add_request(EngineRequest("b", [1, 2, 3], 10_000), 0.0)
    assert e.inspect("a").stop_at == e.inspect("b").stop_at  # type: ignore[union-attr]


def test_abort_frees_blocks_and_counts_no_success() -> None:
    eng = engine(block_size=4)
    eng.add_request(req("a", 10, 50), 0.0)
    eng.add_request(req("b", 10, 50), 0.0)
    now = 0.0
    for _ in range(5):
        now = eng.step(now).end
    rec = eng.abort("a", now)
    assert rec is not None and rec.finish_reason is FinishReason.ABORT and rec.output_tokens == 5
    assert eng.inspect("a") is None and eng.num_running == 1
    assert_kv_consistent(eng)
    drain(eng, now)
    assert eng.kv.used == 0
    assert eng.counters.success == {"stop": 0, "length": 1}
    assert eng.abort("nope", now) is None


def test_prefill_only_holds_blocks_until_released_or_expired() -> None:
    from simulator.requests import KvTransfer

    eng = engine(block_size=16)
    eng.add_request(req("p", 100, 1, kv_transfer=KvTransfer(prefill_only=True, hold_timeout_s=5.0)), 0.0)
    eng.add_request(req("q", 40, 1, kv_transfer=KvTransfer(prefill_only=True, hold_timeout_s=5.0)), 0.0)
    res = eng.step(0.0)
    held = {r.request_id: r.held_blocks for r in res.finished}
    assert held == {"p": 7, "q": 3}  # ceil(100/16), ceil(40/16)
    assert eng.kv.used == 10 and not eng.has_work() and eng.num_held == 2
    assert eng.release_held("p") == 7 and eng.kv.used == 3
    assert eng.expire_held(res.end + 4.9) == 0
    assert eng.expire_held(res.end + 5.0) == 1 and eng.kv.used == 0


def test_remote_prefilled_request_pays_the_transfer_then_computes_one_token() -> None:
    from simulator.requests import KvTransfer

    eng = engine(block_size=16)
    eng.add_request(
        req("d", 100, 3, kv_transfer=KvTransfer(remote_prefilled=True, transfer_delay_s=0.05)), 0.0
    )
    res = eng.step(0.0)
    assert res.idle and eng.num_waiting == 1 and eng.kv.used == 7  # prompt blocks allocated for the pull
    assert eng.next_event_time() == pytest.approx(0.05)
    res = eng.step(0.05)
    assert res.kv_received == ("d",) and res.num_prefill_tokens == 1 and res.first_tokens == ("d",)
    # the one computed token is the prompt's last: 1 new token after 99 cached
    assert res.duration_s == pytest.approx(H100.step_time_totals(1, 1 * (99 + 0.5), 0, 0, 1))
    recs = [r for s in drain(eng, res.end) for r in s.finished]
    assert recs[0].output_tokens == 3 and recs[0].ttft == pytest.approx(res.end)


# ---------------------------------------------------------------- prefix caching
def cached_engine(**cfg: object) -> Engine:
    return Engine(H100, EngineConfig(enable_prefix_caching=True, block_size=16, **cfg), seed=0)  # type: ignore[arg-type]


def assert_cache_consistent(eng: Engine) -> None:
    """In use = private blocks of every request + cached blocks someone references (each once)."""
    pc = eng._pc
    assert pc is not None
    views = {v.request_id: v for v in eng.requests()}
    shared = sum(len(eng._seqs[r].shared) if r in eng._seqs else len(eng._held[r].shared) for r in views)
    private = sum(v.blocks for v in views.values()) - shared
    referenced = sum(1 for n in pc.refs.values() if n > 0)
    assert eng.kv.used == private + referenced
    assert set(pc.evictable) == {h for h, n in pc.refs.items() if n == 0}


def test_prefix_cache_reuses_full_prompt_blocks() -> None:
    eng = cached_engine()
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks (96 tokens) + 4
    eng.add_request(req("a", prompt, 50), 0.0)  # type: ignore[arg-type]
    first = eng.step(0.0)
    assert first.num_prefill_tokens == 100
    eng.add_request(req("b", prompt, 50), first.end)  # type: ignore[arg-type]
    second = eng.step(first.end)
    # b reuses a's 6 registered blocks: only its last 4 tokens are prefilled (after 96 cached)
    assert (second.num_prefill_tokens, second.first_tokens) == (4, ("b",))
    assert second.duration_s == pytest.approx(H100.step_time_totals(4, 4 * (96 + 2), 1, 101, 2))
    assert (eng.counters.prefix_cache_queries, eng.counters.prefix_cache_hits) == (200, 96)
    # a holds 7 blocks (6 cached + 1); b holds the same 6 by reference + 1 private: 8 blocks in use
    assert eng.kv.used == 8
    assert_cache_consistent(eng)
    drain(eng, second.end)
    assert eng.kv.used == 0 and eng.kv_usage == 0.0  # cached but unreferenced blocks count as free
    assert len(eng._pc.evictable) == 6  # type: ignore[union-attr]


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    eng = cached_engine()
    prompt = list(range(96))  # exactly 6 blocks
    eng.add_request(req("a", prompt, 1), 0.0)  # type: ignore[arg-type]
    end = eng.step(0.0).end
    eng.add_request(req("b", prompt, 1), end)  # type: ignore[arg-type]
    # at most (96 − 1) // 16 = 5 blocks are reused, so 16 tokens are computed for the logits
    assert eng.step(end).num_prefill_tokens == 16
    assert eng.counters.prefix_cache_hits == 80


def test_unreferenced_cached_blocks_are_evicted_lru_when_room_is_needed() -> None:
    from simulator.prefix_cache import block_hashes

    eng = cached_engine(num_gpu_blocks=11, max_model_len=160)  # 10 usable
    p0, p1, big = list(range(64)), list(range(1000, 1064)), list(range(5000, 5096))
    now = 0.0
    for i, prompt in enumerate((p0, p1)):  # two 64-token prompts (4 full blocks each) prefilled and finished
        eng.add_request(req(f"p{i}", prompt, 1), now)  # type: ignore[arg-type]
        now = eng.step(now).end
    pc = eng._pc
    assert pc is not None and len(pc.evictable) == 8 and eng.kv.used == 0 and eng.kv_usage == 0.0
    eng.add_request(req("big", big, 1), now)  # type: ignore[arg-type]
    eng.step(now)
    # big needs 6 blocks: 10 − 8 cached = 2 truly free, so the 4 least recently freed (p0's) are evicted;
    # then big's own 6 blocks are cached as it finishes: p1's 4 + big's 6 remain.
    assert not set(block_hashes(p0, 16)) & set(pc.refs)
    assert set(pc.refs) == set(block_hashes(p1, 16)) | set(block_hashes(big, 16))
    assert len(pc.evictable) == 10 and eng.kv.used == 0


def test_prefix_cache_stays_consistent_under_preemption() -> None:
    eng = cached_engine(num_gpu_blocks=41, max_model_len=640, max_num_seqs=8)  # 40 usable
    shared = list(range(64))
    for i in range(8):
        eng.add_request(req(f"r{i}", shared + list(range(1000 * (i + 1), 1000 * (i + 1) + 40)), 60), 0.0)  # type: ignore[arg-type]
    now = 0.0
    while eng.has_work():
        res = eng.step(now)
        assert_cache_consistent(eng)
        now = res.end
    assert eng.counters.preemptions > 0
    assert eng.counters.prefix_cache_hits >= 7 * 64  # the shared 4 blocks, once per later admission
    assert eng.kv.used == 0
