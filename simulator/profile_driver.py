"""`mosaic profile --sim`: measure a bucket at a rate by running the engine model itself, no HTTP.

One probe = one fresh `Engine` (vLLM defaults unless an `EngineConfig` is given) driven by
`simulator.engine.run_offline` through the bucket's test requests (`loadgen.profiling.bucket_requests`:
uniform lengths within the bucket, unit-rate Poisson gaps divided by the rate), every request with
`max_tokens` = its output length and `ignore_eos`, as `mosaic replay` sends them. Latencies are the
engine's request records, which are what a client measures: TTFT from the client's send (the perf
model's API overhead included) to the first token, TPOT = (last − first token) / (output − 1).

Only requests arriving in the probe's measured window count (`loadgen.profiling`); a measured request
the engine could not finish counts as failed. The probe length W grows with the expected end-to-end
latency, estimated as prefill(longest input) + API overhead + longest output × 50 ms, so long outputs
see a steady state. The probe plan and the starting hint never depend on the SLO: the same rate gives the
same measurement whatever the SLO, so a looser SLO can never end with a lower rate.

Roles (`role`, placement.profiles.Role), as the planner reads a P/D profile (docs/placement.md "P/D"):
- mixed: whole requests, as above.
- prefill: what a vLLM prefill worker does in P/D — each request with `max_tokens` = 1 (its output length
  is ignored); judged on TTFT. The KV is assumed fetched by the decode side as soon as the first token is
  out, so blocks are freed at finish (no `KvTransfer(prefill_only=True)` hold, which nobody releases here).
- decode: what a decode worker does — each request remote-prefilled
  (`KvTransfer(remote_prefilled=True)`: the engine allocates the prompt's blocks, waits prompt tokens ·
  kv_bytes_per_token / (kv_link_gbps · 10⁹) s for the KV, computes only the last prompt token) and then
  decodes the full output; judged on TPOT. The link speed defaults to the cluster simulator's 25 GB/s.

Deterministic: the same (GPU, model, config, seed) gives the same measurements, hence the same profile.
A probe costs milliseconds to a second of CPU (the engine is O(1) per decode step), so a 16-bucket
profile takes seconds.
"""

from __future__ import annotations

import numpy as np

from loadgen.profile_search import Measurement
from loadgen.profiling import (
    Bucket,
    BucketMeasure,
    MeasureFactory,
    ProbePlan,
    bucket_requests,
    probe_requests,
    summarize,
    unloaded_requests,
)
from placement.perf_model import PerfModel
from placement.profiles import Role
from simulator.engine import Engine, EngineConfig, run_offline
from simulator.requests import EngineRequest, KvTransfer

PROBE_TPOT_S = 0.05  # per-token time assumed when sizing probes and hints (never the SLO: see factory)
KV_LINK_GBPS = 25.0  # prefill → decode KV bandwidth (GB/s), the cluster simulator's default


def role_request(
    perf: PerfModel, role: Role, rid: str, input_tokens: int, output_tokens: int, kv_link_gbps: float
) -> EngineRequest:
    """The engine request an instance of `role` sees for a client request of these lengths."""
    if role is Role.PREFILL:
        return EngineRequest(rid, input_tokens, 1, ignore_eos=True)
    if role is Role.DECODE:
        delay = input_tokens * perf.model.kv_bytes_per_token / (kv_link_gbps * 1e9)
        kvt = KvTransfer(remote_prefilled=True, transfer_delay_s=delay)
        return EngineRequest(rid, input_tokens, output_tokens, ignore_eos=True, kv_transfer=kvt)
    return EngineRequest(rid, input_tokens, output_tokens, ignore_eos=True)


def engine_max_model_len(perf: PerfModel, config: EngineConfig) -> int:
    """The engine's max_model_len for this GPU: min(model context, KV capacity); 0 if the model does not fit."""
    try:
        return Engine(perf, config).max_model_len
    except ValueError:  # the weights leave no room for a single KV block
        return 0


def capacity_hint(
    perf: PerfModel,
    bucket: Bucket,
    tpot_target_s: float,
    config: EngineConfig,
    max_model_len: int,
    role: Role = Role.MIXED,
) -> float:
    """A first guess of the bucket's max rate from the perf model alone, to start the search near the answer.

    Decode: the largest batch B (≤ max_num_seqs, within the KV cache) whose decode step at the bucket's mean
    context stays under 80% of the TPOT target serves B / (mean output · step) req/s. Prefill: the
    prefill rate in tokens/s over the mean input. Both share the GPU: 1 / (1/decode + 1/prefill); a prefill
    instance gets the prefill rate alone, a decode instance the decode rate alone. Only a hint: the
    search's answer comes from the engine runs.
    """
    mean_in = (bucket.input_lo + bucket.input_hi - 1) / 2
    mean_out = (bucket.output_lo + bucket.output_hi - 1) / 2
    ctx = int(mean_in + mean_out / 2)
    kv_batch = max(
        1, perf.kv_capacity_tokens(config.gpu_memory_utilization) // max(1, ctx + int(mean_out / 2))
    )
    batch = 1
    for b in (256, 192, 128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1):
        if (
            b <= min(config.max_num_seqs, kv_batch)
            and perf.decode_step_time([ctx] * b) <= 0.8 * tpot_target_s
        ):
            batch = b
            break
    decode_rate = batch / (mean_out * perf.decode_step_time([ctx] * batch))
    prefill_rate = perf.prefill_tokens_per_s(min(config.max_num_batched_tokens, max_model_len)) / mean_in
    if role is Role.PREFILL:
        return prefill_rate
    if role is Role.DECODE:
        return decode_rate
    return 1.0 / (1.0 / decode_rate + 1.0 / prefill_rate)


def unloaded_ttft_ms(
    perf: PerfModel,
    config: EngineConfig,
    bucket: Bucket,
    max_context: int,
    seed: int,
    role: Role = Role.MIXED,
    kv_link_gbps: float = KV_LINK_GBPS,
) -> float:
    """p90 TTFT of the bucket's first 10 requests, each alone in the engine (one output token each; a
    decode instance's TTFT is the KV transfer plus one step)."""
    reqs = unloaded_requests(bucket, max_context, seed)
    arrivals = [
        (k * 1e4, role_request(perf, role, str(k), r.input_tokens, 1, kv_link_gbps))
        for k, r in enumerate(reqs)
    ]
    records = run_offline(Engine(perf, config, seed), arrivals)
    return float(np.percentile([rec.ttft or 0.0 for rec in records], 90)) * 1000.0


def sim_measure_factory(
    perf: PerfModel,
    config: EngineConfig | None = None,
    seed: int = 0,
    plan: ProbePlan = ProbePlan(),
    role: Role = Role.MIXED,
    kv_link_gbps: float = KV_LINK_GBPS,
) -> MeasureFactory:
    """For each bucket, `measure(rate)` on the engine model and a starting hint — or None when this GPU
    cannot hold the bucket. Neither depends on the SLO (the SLO only judges), which is what makes the
    search's answer monotone in the SLO. `role` picks what one instance does (module docstring)."""
    if not kv_link_gbps > 0:
        raise ValueError(f"kv_link_gbps must be > 0, got {kv_link_gbps}")
    config = config or EngineConfig()
    max_context = perf.model.max_context
    max_model_len = engine_max_model_len(perf, config)
    tpot_target = PROBE_TPOT_S

    def factory(bucket: Bucket) -> BucketMeasure | None:
        if not bucket.feasible(max_context) or bucket.longest(max_context) > max_model_len:
            return None
        longest_in = min(bucket.input_hi - 1, max_context - bucket.output_lo)
        longest_out = 1 if role is Role.PREFILL else bucket.output_hi - 1
        e2e_estimate = (
            perf.prefill_time([longest_in]) + perf.constants.api_overhead_s + longest_out * tpot_target
        )

        def measure(rate: float) -> Measurement:
            window = plan.window_s(rate, e2e_estimate)
            reqs, lo, hi = probe_requests(bucket_requests(bucket, max_context, seed), rate, window)
            arrivals = [
                (
                    r.offset / rate,
                    role_request(perf, role, str(k), r.input_tokens, r.output_tokens, kv_link_gbps),
                )
                for k, r in enumerate(reqs)
            ]
            records = run_offline(Engine(perf, config, seed), arrivals)
            done = [rec for rec in records if lo <= rec.arrival < hi and rec.first_token is not None]
            expected = sum(1 for t, _ in arrivals if lo <= t < hi)
            return summarize(
                rate,
                [rec.arrival for rec in done],
                [rec.ttft or 0.0 for rec in done],
                [rec.tpot for rec in done],
                failed=expected - len(done),
            )

        return BucketMeasure(
            measure,
            capacity_hint(perf, bucket, tpot_target, config, max_model_len, role),
            unloaded_ttft_ms(perf, config, bucket, max_context, seed, role, kv_link_gbps),
        )

    return factory
