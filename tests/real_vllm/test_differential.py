"""Differential test: the same random request bodies to the real vLLM server and to Mosaic's simulated worker.

Where `test_fidelity.py` diffs fixed cases, this draws /v1/completions and /v1/chat/completions bodies with
hypothesis (`differential.requests`: sampling parameters in and out of range and of the wrong type, stop
conditions, logprobs, echo, prompts and messages of every shape, stream options, unknown fields, model
names) and compares what a client sees (`differential.compare`): status, the error's (status, type, param),
the answer's shape, choices, determined finish reasons and token counts, a stream's events. Every difference
must be a listed one (`fidelity.KNOWN_*`, with its reason, mirrored in docs/real_vllm.md).

Deterministic (`derandomize`) and small by default. To hunt: `MOSAIC_DIFF_EXAMPLES=2000` (more examples, same
seed stream) and/or `MOSAIC_DIFF_RANDOM=1` (a fresh random run), with `MOSAIC_REAL_VLLM_URL` set to a running
server (`bash scripts/real_vllm.sh start`) to skip the start.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from conftest import RealServer
from differential import compare, requests
from fidelity import KNOWN_BODY, KNOWN_DIFFERENTIAL, KNOWN_STREAM
from hypothesis import HealthCheck, given, settings

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]

EXAMPLES = int(os.environ.get("MOSAIC_DIFF_EXAMPLES", "300"))
KNOWN = {**KNOWN_BODY, **KNOWN_STREAM, **KNOWN_DIFFERENTIAL}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("MOSAIC_DIFF_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_random_requests_answer_alike(
    real_vllm: RealServer, sim_url: str, request: tuple[str, dict[str, Any]]
) -> None:
    path, body = request
    unexpected = compare(real_vllm.url, sim_url, path, body) - KNOWN.keys()
    assert not unexpected, f"POST {path} {json.dumps(body)}: {sorted(unexpected)}"
