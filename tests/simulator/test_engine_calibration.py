"""Engine-level calibration: the Lambda vLLM benchmark (Llama-3-8B, ShareGPT, all prompts at once) replayed
through the engine model on A100-80GB and H100, within ±25% of what vLLM measured.

Measured (../shared/data/calibration/lambda_vllm_llama3_8b_summary.csv, LambdaLabsML/vllm-benchmark,
benchmark_serving, request_rate=inf): 10 prompts = 1,369 input / 1,945 output tokens; 320 prompts = 65,578 /
65,374 tokens; max_num_seqs 256. The per-request lengths are not published, so the test draws ShareGPT-like
lengths (inputs log-normal σ 1.2 capped at 8× the mean; outputs gamma k = 2, cv 0.71 as in ShareGPT) with
a fixed seed and scales them to those exact totals. Metrics as benchmark_serving defines them: TTFT from
send (incl. the API overhead) to the first token, TPOT = (e2e − TTFT)/(output − 1), request throughput =
requests / time to the last completion.

Known margin: the H100 320-prompt TPOT comes out ≈ +23% (24.7 vs 20.0 ms): the perf model's pure decode step
at batch 256 is already 21.7 ms on H100, so the margin is the perf model's, not the scheduler's.
"""

from __future__ import annotations

import functools
import random
import statistics

import pytest

from placement.catalog import load_catalog
from placement.perf_model import PerfModel
from simulator.engine import Engine, EngineConfig, run_offline
from simulator.requests import EngineRequest

CATALOG = load_catalog()
TOLERANCE = 0.25
TOTALS = {10: (1369, 1945), 320: (65578, 65374)}


def sharegpt_like(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    total_in, total_out = TOTALS[n]
    rng = random.Random(seed)
    a = [min(rng.lognormvariate(0.0, 1.2), 8.0) for _ in range(n)]
    b = [rng.gammavariate(2.0, 1.0) for _ in range(n)]
    sa, sb = sum(a), sum(b)
    return [max(4, round(x * total_in / sa)) for x in a], [max(4, round(x * total_out / sb)) for x in b]


@functools.cache
def benchmark(gpu: str, n: int) -> dict[str, float]:
    ins, outs = sharegpt_like(n)
    engine = Engine(PerfModel(CATALOG.gpu(gpu), CATALOG.model("llama-3-8b")), EngineConfig(max_num_seqs=256))
    arrivals = [(0.0, EngineRequest(f"r{i}", ins[i], outs[i], ignore_eos=True)) for i in range(n)]
    recs = run_offline(engine, arrivals)
    assert len(recs) == n and all(r.output_tokens == outs[int(r.request_id[1:])] for r in recs)
    return {
        "mean_ttft_ms": statistics.mean(r.ttft for r in recs) * 1e3,  # type: ignore[misc]
        "median_tpot_ms": statistics.median(r.tpot for r in recs) * 1e3,  # type: ignore[misc]
        "request_throughput": n / max(r.finished for r in recs),
    }


# (gpu, prompts, metric, measured by Lambda)
POINTS = [
    ("A100-80GB", 10, "mean_ttft_ms", 126.9),
    ("H100-SXM", 10, "mean_ttft_ms", 62.4),
    ("A100-80GB", 10, "median_tpot_ms", 12.01),
    ("H100-SXM", 10, "median_tpot_ms", 7.56),
    ("A100-80GB", 320, "median_tpot_ms", 40.86),
    ("H100-SXM", 320, "median_tpot_ms", 20.03),
    ("A100-80GB", 320, "mean_ttft_ms", 3423.2),
    ("H100-SXM", 320, "mean_ttft_ms", 1628.5),
    ("A100-80GB", 320, "request_throughput", 15.21),
    ("H100-SXM", 320, "request_throughput", 29.52),
]


@pytest.mark.parametrize(
    ("gpu", "n", "metric", "measured"),
    [pytest.param(*p, id=f"{p[0]} {p[1]} prompts {p[2]} ≈ {p[3]}") for p in POINTS],
)
def test_lambda_benchmark_point_within_25_percent(gpu: str, n: int, metric: str, measured: float) -> None:
    simulated = benchmark(gpu, n)[metric]
    assert abs(simulated - measured) / measured <= TOLERANCE, (
        f"{metric}: sim {simulated:.2f} vs vLLM {measured}"
    )


def test_lengths_match_the_published_totals() -> None:
    for n, (total_in, total_out) in TOTALS.items():
        ins, outs = sharegpt_like(n)
        # scaled to the totals; rounding and the 4-token floor move them by well under 1%
        assert abs(sum(ins) - total_in) <= 0.01 * total_in
        assert abs(sum(outs) - total_out) <= 0.01 * total_out
