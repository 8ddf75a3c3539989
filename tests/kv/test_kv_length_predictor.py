"""Output-length predictor: per (model, input bucket) quantiles, a cold fallback, survival-based growth."""

from __future__ import annotations

import pytest

from scheduler.length_predictor import LengthPredictor


def fed(values: list[int], model: str = "m", prompt: int = 100, **kw: int | float) -> LengthPredictor:
    p = LengthPredictor(**kw)  # type: ignore[arg-type]
    for v in values:
        p.observe(model, prompt, v)
    return p


def test_cold_predictor_returns_the_worst_case() -> None:
    assert fed(list(range(1, 10)), min_samples=20).predict("m", 100, 500) == 500


def test_nearest_rank_quantile_by_hand() -> None:
    # 1..100, q = 0.9 → the ceil(0.9 · 100) = 90th smallest = 90
    p = fed(list(range(1, 101)), quantile=0.9, min_samples=10)
    assert p.predict("m", 100, 1000) == 90
    assert p.predict("m", 100, 50) == 50  # capped at max_tokens


def test_buckets_and_models_are_separate() -> None:
    p = fed([10] * 30, prompt=100, min_samples=10)  # bucket [0, 256)
    assert p.predict("m", 5000, 700) == 700  # bucket [4096, 16384): nothing seen
    assert p.predict("other", 100, 700) == 700
    assert p.bucket(255) == 0 and p.bucket(256) == 1 and p.bucket(10**6) == 5


def test_window_forgets_old_observations() -> None:
    p = fed([1000] * 20 + [10] * 20, window=20, min_samples=5)
    assert p.predict("m", 100, 5000) == 10


def test_grow_uses_the_survival_quantile() -> None:
    # seen 1..100; generated 80 → longer = 81..100 (20 values), q 0.9 → ceil(18) = 18th = 98
    p = fed(list(range(1, 101)), quantile=0.9, min_samples=20)
    assert p.grow("m", 100, 80, 1000) == 98
    assert p.grow("m", 100, 80, 90) == 90  # capped


def test_grow_doubles_past_everything_seen() -> None:
    p = fed(list(range(1, 101)), min_samples=20, min_step=16)
    assert p.grow("m", 100, 150, 10_000) == 300  # nothing longer than 150 → 150 + 150
    assert fed([]).grow("m", 100, 4, 10_000) == 20  # nothing seen: 4 + max(4, min_step 16)
    # generated 4: longer = 5..100 (96 values), q 0.9 → the ceil(86.4) = 87th = 91
    assert p.grow("m", 100, 4, 10_000) == 91


@pytest.mark.parametrize(
    "kw", [{"quantile": 0.0}, {"window": 0}, {"input_edges": (5, 10)}, {"input_edges": (0, 10, 10)}]
)
def test_bad_settings(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LengthPredictor(**kw)  # type: ignore[arg-type]


def test_a_prediction_follows_every_new_observation() -> None:
    # predict() keeps each bucket's quantile until the bucket's next observation: it must not go stale.
    p = LengthPredictor(quantile=0.5, window=4, min_samples=2)
    p.observe("m", 10, 100)
    p.observe("m", 10, 200)
    assert p.predict("m", 10, 1000) == 100  # nearest rank: ceil(0.5·2) = 1st of [100, 200]
    p.observe("m", 10, 300)
    assert p.predict("m", 10, 1000) == 200  # 2nd of [100, 200, 300]
    for _ in range(4):
        p.observe("m", 10, 50)  # the window (4) now holds only 50s
    assert p.predict("m", 10, 1000) == 50
    assert p.predict("m", 300, 1000) == 1000  # another bucket, no samples: the worst case


def test_count_is_the_number_of_samples_in_the_window() -> None:
    p = fed([5] * 7, window=4)
    assert p.count("m", 100) == len(p.samples("m", 100)) == 4  # the window keeps the last 4
    assert p.count("m", 5000) == 0 and p.count("other", 100) == 0
