"""What goes into the engine model and what comes out of it: requests, P/D transfer roles, timing records.

`EngineRequest` is the engine's input (immutable). `RequestRecord` is what the engine hands back when a
request finishes or is aborted: the timings vLLM's `/metrics` histograms are built from (queue time, TTFT,
prefill/decode/inference time, e2e) in simulated seconds.

Natural output length. A real model stops at EOS; the simulated one stops at a length drawn from a gamma
law with the given mean and shape k (coefficient of variation 1/√k). ShareGPT's completion lengths (the
Vidur ShareGPT trace, filtered as vLLM's benchmark_serving does) have cv 0.71 → k = 2; the mean defaults to
204 tokens, the Llama-3-8B ShareGPT mean of the Lambda vLLM benchmark. The draw is seeded by (engine seed, prompt fingerprint): token-id prompts give the same length for
the same prompt, as a model at temperature 0 would; count-only prompts are keyed by the request id.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class FinishReason(StrEnum):
    """vLLM's finish reasons (the `finished_reason` label of `vllm:request_success_total`)."""

    STOP = "stop"  # EOS at the natural length (after min_tokens)
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client went away / aborted; vLLM counts no success for it


@dataclass(frozen=True, slots=True)
class KvTransfer:
    """A request's part in prefill/decode disaggregation (vLLM's NixlConnector protocol).

    prefill_only: the prefill worker computes the prompt, emits its token(s), then *holds* the request's
        blocks (not freed at finish) until the decode side fetched them (`Engine.release_held`) or
        `hold_timeout_s` of simulated time passed.
    remote_prefilled: the decode worker takes the prompt's KV from the prefill worker: it allocates the
        prompt's blocks, waits `transfer_delay_s` (KV bytes over the link), then computes only the last
        prompt token to produce the first output token (as vLLM does after a remote KV load).
    """

    prefill_only: bool = False
    hold_timeout_s: float = 30.0
    remote_prefilled: bool = False
    transfer_delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine sees it. `prompt_tokens` is a count or the token ids themselves."""

    request_id: str
    prompt_tokens: int | Sequence[int]
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    natural_output_tokens: int | None = None  # where EOS falls; None → drawn from the engine's seed
    kv_transfer: KvTransfer | None = None
    lora: str | None = None  # the LoRA adapter it runs with (its name); None → the base model
    # A pooling (embedding) request, as vLLM's `--runner pooling` runs one: prefill only. It is scheduled,
    # chunked and holds KV like any request, and finishes (reason stop, no output token) when its prompt is
    # computed; `max_tokens` must be 0. Its prompt may fill max_model_len (no room for output is needed).
    pooling: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens if isinstance(self.prompt_tokens, int) else len(self.prompt_tokens)

    @property
    def token_ids(self) -> Sequence[int] | None:
        return None if isinstance(self.prompt_tokens, int) else self.prompt_tokens


class RequestRecord(NamedTuple):
    """Timings of one finished (or aborted) request, simulated seconds; None where the phase never happened.

    A NamedTuple (immutable, attribute access) because the engine builds one per request in its hot loop.
    """

    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: FinishReason
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float
    num_preemptions: int = 0
    held_blocks: int = 0  # prefill_only: blocks kept for the decode side (0 otherwise)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def prefill_time(self) -> float | None:
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_time(self) -> float | None:
        return None if self.first_token is None else self.finished - self.first_token

    @property
    def inference_time(self) -> float | None:
        return None if self.first_scheduled is None else self.finished - self.first_scheduled

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (finished − first_token) / (output_tokens − 1)."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


def prompt_fingerprint(req: EngineRequest) -> int:
    """A stable 64-bit key of the prompt (token ids) or, for count-only prompts, of the request id."""
    ids = req.token_ids
    if ids is None:
        return zlib.crc32(req.request_id.encode()) | (req.num_prompt_tokens << 32)
    # crc32 over the ids' bytes: stable across processes (Python's hash() of str is salted).
    data = (
        b"".join(int(t).to_bytes(4, "little", signed=False) for t in ids)
        if len(ids) < 4096
        else repr(tuple(ids)).encode()
    )
    return zlib.crc32(data) | (len(ids) << 32)


def sample_natural_output(seed: int, fingerprint: int, mean: float, shape: float) -> int:
    """Gamma(shape k, scale mean/k) output length, rounded, at least 1 token; shape ≤ 0 → exactly `mean`.

    Uniforms come from SplitMix64 over (seed, fingerprint) and the gamma variate from Marsaglia–Tsang: a few
    µs per request, where seeding a `random.Random` per request would cost more than the engine step.
    """
    if shape <= 0:
        return max(1, round(mean))
    rand = _SplitMix((seed * 0x9E3779B97F4A7C15) ^ fingerprint)
    k = shape if shape >= 1 else shape + 1.0
    d = k - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    while True:
        z = math.sqrt(-2.0 * math.log(rand.uniform())) * math.cos(2.0 * math.pi * rand.uniform())
        v = (1.0 + c * z) ** 3
        if v > 0 and math.log(rand.uniform()) < 0.5 * z * z + d - d * v + d * math.log(v):
            break
    x = d * v
    if shape < 1:  # Gamma(k) = Gamma(k + 1) · U^(1/k)
        x *= rand.uniform() ** (1.0 / shape)
    return max(1, round(x * mean / shape))


class _SplitMix:
    """SplitMix64 (Steele, Lea & Flood 2014): a tiny seeded stream of uniforms in (0, 1)."""

    __slots__ = ("state",)
    _MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self.state = seed & self._MASK

    def uniform(self) -> float:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self._MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        z ^= z >> 31
        return ((z >> 11) + 0.5) / float(1 << 53)
