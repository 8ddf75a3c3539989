"""The simulated worker's `system_fingerprint` and the vLLM version it answers `GET /version` with.

vLLM 0.32 names itself on every completion (`--fingerprint-mode full`, its default):
`vllm-<version>[-tp<N>][-pp<N>][-dp<N>][-ep]-<hash8>`, where hash8 is the first 8 hex digits of its config's
hash: two servers of one configuration share it, and a client that compares fingerprints (as OpenAI's docs
suggest, to notice a backend change) sees one change when the configuration does. The simulator hashes the
factors of its configuration that vLLM's `compute_hash` covers: the model and its `max_model_len`, the
scheduler's `max_num_seqs` and `max_num_batched_tokens`, the KV `block_size`, the parallel sizes, and
`max_loras` when LoRA is on. Not what vLLM leaves out: the GPU (its device config hashes nothing), memory
utilisation, a block-count override and prefix caching (its cache config skips them), nor the simulator's
seed and output-length law, which stand for the model's weights, and vLLM does not hash those either.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

VLLM_VERSION = "0.32.0"  # the vLLM release whose API the simulated worker speaks


def system_fingerprint(model: str, tp: int, data_parallel_size: int, factors: Mapping[str, Any]) -> str:
    """vLLM's `full` fingerprint of a simulated server: parallelism degrees above 1 named, then the hash of
    the model, the parallel sizes and `factors` (the other hashed settings, module docstring)."""
    config = {"model": model, "tp": tp, "dp": data_parallel_size, "factors": dict(factors)}
    hash8 = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    parts = [f"vllm-{VLLM_VERSION}"]
    if tp > 1:
        parts.append(f"tp{tp}")
    if data_parallel_size > 1:
        parts.append(f"dp{data_parallel_size}")
    parts.append(hash8)
    return "-".join(parts)
