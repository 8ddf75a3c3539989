"""The simulated worker's `system_fingerprint` and the vLLM version it answers `GET /version` with.

vLLM 0.32 names itself on every completion (`--fingerprint-mode full`, its default):
`vllm-<version>[-tp<N>][-pp<N>][-dp<N>][-ep]-<hash8>`, where hash8 is the first 8 hex digits of its config's
hash (model identity, cache and parallel configs, ...): two servers of one configuration share it, and a
client that compares fingerprints (as OpenAI's docs suggest, to notice a backend change) sees one change
when the configuration does. The simulator does the same over the configuration it simulates (model,
GPU, parallelism, engine knobs). The seed is left out: it draws the simulated text, as a model's weights
would, and vLLM's hash does not see the weights either.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

VLLM_VERSION = "0.32.0"  # the vLLM release whose API the simulated worker speaks


def system_fingerprint(
    model: str, gpu: str, tp: int, data_parallel_size: int, engine: Mapping[str, Any]
) -> str:
    """vLLM's `full` fingerprint of a simulated server: parallelism degrees above 1 named, then the hash."""
    config = {"model": model, "gpu": gpu, "tp": tp, "dp": data_parallel_size, "engine": dict(engine)}
    hash8 = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    parts = [f"vllm-{VLLM_VERSION}"]
    if tp > 1:
        parts.append(f"tp{tp}")
    if data_parallel_size > 1:
        parts.append(f"dp{data_parallel_size}")
    parts.append(hash8)
    return "-".join(parts)
