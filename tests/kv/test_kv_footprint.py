"""Footprint formulas on hand-computed cases (arithmetic beside each expected number)."""

from __future__ import annotations

import pytest

from placement.kv_profile import kept_tokens
from scheduler.kv.footprint import CompressionSpec, WorkerKvSpec, clamp_output, need, oracle_units
from tests.kv.kvkit import two_group_spec


@pytest.mark.parametrize(
    ("prompt", "out", "bs", "max_len", "blocks", "reserved_out"),
    [
        pytest.param(100, 50, 16, None, 10, 50, id="stock: ceil(150/16) = 10 blocks"),
        pytest.param(96, 0, 16, None, 6, 0, id="stock: exact multiple 96/16 = 6"),
        pytest.param(
            97, 0, 16, None, 7, 0, id="stock: one token past a block opens another: ceil(97/16) = 7"
        ),
        pytest.param(
            100, 1000, 16, 512, 32, 412, id="stock: context limit min(1100, 512)/16 = 32, output cut to 412"
        ),
        pytest.param(1, 1, 1, None, 2, 1, id="stock: block size 1 counts tokens"),
    ],
)
def test_stock_worker_needs_ceil_of_tokens_over_block_size(
    prompt: int, out: int, bs: int, max_len: int | None, blocks: int, reserved_out: int
) -> None:
    fp = need(prompt, out, WorkerKvSpec(bs, max_len))
    assert (fp.peak, fp.steady, fp.group_pages, fp.reserved_output) == (blocks, blocks, blocks, reserved_out)
    assert fp.transient == 0


def test_compression_worker_footprint_by_hand() -> None:
    # sink 4, window 8, bs 4, P = 100, O = 10, chunk C = 16:
    # K_1 = 4 + 8 + ceil(0.5 · 96) = 60;  K_2 = 12 + ceil(0.1 · 96 = 9.6) = 22
    # prefill_1 = min(100, 60 + 16) = 76 → 19 pages; steady_1 = 70 → 18 pages  → max 19
    # prefill_2 = min(100, 22 + 16) = 38 → 10 pages; steady_2 = 32 → 8 pages   → max 10
    fp = need(100, 10, WorkerKvSpec(4, None, two_group_spec()))
    assert fp.kept_prompt_tokens == (60, 22)
    assert fp.group_pages == 18 + 8  # Σ_g ceil((K_g + O)/bs), the formula
    assert fp.steady == 4 * 18 + 4 * 8  # 104 head-pages
    assert fp.peak == 4 * 19 + 4 * 10  # 116 head-pages
    assert fp.transient == 12


def test_short_prompt_inside_sink_and_window_is_kept_whole() -> None:
    # P = 10 ≤ sink + window = 12 → K_g = 10 for both groups; steady = ceil((10 + 2)/4) = 3 pages each
    fp = need(10, 2, WorkerKvSpec(4, None, two_group_spec()))
    assert fp.kept_prompt_tokens == (10, 10)
    assert fp.steady == 4 * 3 + 4 * 3
    assert fp.peak == fp.steady  # prefill of 10 ≤ chunk holds ceil(10/4) = 3 ≤ steady pages


def test_tensor_parallel_footprint_is_tp_times_the_most_loaded_rank() -> None:
    spec = CompressionSpec((4, 4), (0.5, 0.1), sink=4, window=8, prefill_chunk=16, rank_groups=((0,), (1,)))
    fp = need(100, 10, WorkerKvSpec(4, None, spec))
    assert fp.steady == 2 * max(4 * 18, 4 * 8)  # 144: rank 0 holds the heavy group
    assert fp.peak == 2 * max(4 * 19, 4 * 10)  # 152


def test_uniform_ratio_spec_is_one_group_of_all_heads() -> None:
    spec = CompressionSpec.uniform(8, 0.1, sink=4, window=8, prefill_chunk=16)
    fp = need(100, 10, WorkerKvSpec(4, None, spec))
    assert fp.steady == 8 * 8  # K = 22, ceil(32/4) = 8 pages for 8 heads


def test_context_limit_clamps_the_compressed_output_too() -> None:
    fp = need(100, 50, WorkerKvSpec(4, 120, two_group_spec()))
    assert fp.reserved_output == 20  # 120 − 100
    assert clamp_output(130, 5, 120) == 0


@pytest.mark.parametrize(
    ("ratio", "tokens", "kept"),
    [
        pytest.param(0.0, 20_000, 32 + 4096, id="ratio 0 keeps sink + window"),
        pytest.param(1.0, 20_000, 20_000, id="ratio 1 keeps everything"),
        pytest.param(0.25, 20_032, 32 + 4096 + 5000, id="0.25 of the 20,000 non-sink tokens"),
        pytest.param(0.5, 100, 100, id="a context shorter than sink + window is kept whole"),
    ],
)
def test_kept_tokens_inverts_tangrams_ratio_definition(ratio: float, tokens: int, kept: int) -> None:
    assert kept_tokens(ratio, tokens, 32, 4096) == kept


def test_oracle_units_sum_group_pages() -> None:
    assert oracle_units((4, 2), (17, 16), 16) == 4 * 2 + 2 * 1


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        CompressionSpec((4,), (1.5,))
    with pytest.raises(ValueError):
        CompressionSpec((), ())
    with pytest.raises(ValueError):
        need(-1, 0, WorkerKvSpec())
