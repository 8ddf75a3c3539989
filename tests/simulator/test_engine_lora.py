"""The engine's LoRA admission: vLLM 0.32's `max_loras` rule (v1/core/sched/scheduler.py, `scheduled_loras`)."""

from __future__ import annotations

import pytest

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from simulator.engine import Engine, EngineConfig, StepResult
from simulator.requests import EngineRequest

CATALOG = load_catalog()
H100 = PerfModel(CATALOG.gpu("H100"), CATALOG.model("llama-3-8b"))


def engine(**cfg: object) -> Engine:
    return Engine(H100, EngineConfig(**cfg), seed=0)  # type: ignore[arg-type]


def req(rid: str, lora: str | None, prompt: int = 32, max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(rid, prompt, max_tokens, ignore_eos=True, lora=lora)


def drain(eng: Engine) -> list[StepResult]:
    steps, now = [], 0.0
    while eng.has_work():
        res = eng.step(now)
        steps.append(res)
        now = res.end
    return steps


def first_step(steps: list[StepResult], rid: str) -> int:
    """The step that scheduled `rid`'s prompt (its first chunk): it emits its first token there (prompts fit)."""
    return next(i for i, s in enumerate(steps) if rid in s.first_tokens)


def last_step(steps: list[StepResult], rid: str) -> int:
    return next(i for i, s in enumerate(steps) if any(r.request_id == rid for r in s.finished))


def test_max_loras_1_runs_one_adapter_at_a_time_while_base_requests_still_batch() -> None:
    eng = engine(max_loras=1)
    for r in (req("a1", "a"), req("b1", "b"), req("a2", "a"), req("base", None), req("b2", "b")):
        eng.add_request(r, 0.0)
    steps = drain(eng)
    # step 0: a1 admitted (adapter a scheduled: 1 of max_loras 1), b1 skipped, a2 (adapter a) and base
    # admitted behind it, b2 skipped; b's requests wait until a's two are done (4 tokens each: steps 0–3)
    assert steps[0].first_tokens == ("a1", "a2", "base")
    assert last_step(steps, "a1") == last_step(steps, "a2") == 3
    assert first_step(steps, "b1") == first_step(steps, "b2") == 4  # both b, together, once a is gone
    assert steps[4].first_tokens == ("b1", "b2")  # the skipped ones kept their order
    assert eng._loras == {}  # every adapter's count back to none


def test_max_loras_2_batches_both_adapters() -> None:
    eng = engine(max_loras=2)
    for r in (req("a1", "a"), req("b1", "b"), req("c1", "c"), req("a2", "a")):
        eng.add_request(r, 0.0)
    steps = drain(eng)
    # a and b fill the two slots; c waits, a2 (a: already scheduled) does not
    assert steps[0].first_tokens == ("a1", "b1", "a2")
    assert first_step(steps, "c1") == 4


def test_a_skipped_request_stays_at_the_front_of_waiting() -> None:
    """vLLM prepends the step's skipped requests to WAITING: b1 goes before base requests that arrive later."""
    eng = engine(max_loras=1, max_num_seqs=2)
    for r in (req("a1", "a", max_tokens=2), req("b1", "b")):
        eng.add_request(r, 0.0)
    res = eng.step(0.0)
    assert res.first_tokens == ("a1",)
    eng.add_request(req("late", None), res.end)
    steps = [res, *drain(eng)]
    # a1 runs 2 tokens (steps 0–1); `late` is admitted beside it at step 1 (a base request is never held
    # back); b1 waits for a1, then at step 2 goes before anything queued behind it
    assert first_step(steps, "late") == 1
    assert first_step(steps, "b1") == 2


def test_base_model_requests_are_not_limited_by_max_loras() -> None:
    eng = engine(max_loras=1)
    for i in range(4):
        eng.add_request(req(f"base{i}", None), 0.0)
    eng.add_request(req("a1", "a"), 0.0)
    assert eng.step(0.0).first_tokens == ("base0", "base1", "base2", "base3", "a1")


def test_an_aborted_request_frees_its_adapters_slot() -> None:
    eng = engine(max_loras=1)
    eng.add_request(req("a1", "a", max_tokens=50), 0.0)
    eng.add_request(req("b1", "b"), 0.0)
    res = eng.step(0.0)
    assert res.first_tokens == ("a1",)
    eng.abort("a1", res.end)
    assert eng._loras == {}
    assert eng.step(res.end).first_tokens == ("b1",)


def test_a_preempted_request_leaves_the_scheduled_adapters() -> None:
    # 5 blocks (4 usable: one is vLLM's null block): a1 and a2 take 2 each for their 32-token prompts; at
    # step 1 each needs a third block for token 33, so a2 (the most recently admitted) is preempted
    eng = engine(max_loras=1, num_gpu_blocks=5, block_size=16)
    for r in (req("a1", "a", max_tokens=8), req("a2", "a", max_tokens=8)):
        eng.add_request(r, 0.0)
    s0 = eng.step(0.0)
    assert s0.first_tokens == ("a1", "a2") and eng._loras == {"a": 2}
    s1 = eng.step(s0.end)
    assert s1.preempted == ("a2",) and eng._loras == {"a": 1}
    drain(eng)
    assert eng._loras == {}


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_max_loras_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="max_loras must be an integer ≥ 1"):
        EngineConfig(max_loras=bad)  # type: ignore[arg-type]


def test_an_adapters_prompt_blocks_are_cached_apart_from_the_base_models() -> None:
    """vLLM puts the adapter in each block's hash: the same 100-token prompt under adapter `a` reuses nothing
    the base model cached (6 full blocks), then its own 6 blocks the second time; `b` none of `a`'s."""
    eng = engine(enable_prefix_caching=True, block_size=16, max_loras=2)
    prompt = list(range(1000, 1100))
    now = 0.0
    hits = []
    for rid, lora in (("base", None), ("a1", "a"), ("a2", "a"), ("b1", "b")):
        eng.add_request(EngineRequest(rid, prompt, 4, ignore_eos=True, lora=lora), now)  # type: ignore[arg-type]
        before = eng.counters.prefix_cache_hits
        while eng.has_work():
            now = eng.step(now).end
        hits.append(eng.counters.prefix_cache_hits - before)
    assert hits == [0, 0, 96, 0]
