"""Tools of the fidelity diff (real vLLM vs Mosaic's simulated worker) and the list of known differences.

`KNOWN_*` hold every difference measured against vLLM 0.32.0 (CPU build), each with its reason. The test
fails on a difference that is not listed (the simulator drifted, or vLLM changed) and on a listed difference
that no longer shows (the simulator was fixed: take it off here and in the docs). `docs/real_vllm.md` ("Fidelity limits") lists the same
entries; a test checks that every key here appears there.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

# --- response bodies: "<case> <json path>: <real kind> vs <sim kind>" → reason --------------------------------
_NEWER = "newer vLLM response field (null unless a feature is on); Mosaic never reads it"
KNOWN_BODY: Mapping[str, str] = {
    "chat .choices[].routed_experts: null vs absent": _NEWER,
    "chat .choices[].token_ids: null vs absent": _NEWER,
    "chat .ec_transfer_params: null vs absent": _NEWER,
    "chat .metrics: null vs absent": _NEWER,
    "chat .prompt_text: null vs absent": _NEWER,
    "chat .prompt_token_ids: null vs absent": _NEWER,
    "chat .service_tier: null vs absent": _NEWER,
    "chat .usage.completion_tokens_details: null vs absent": _NEWER,
    "completion .choices[].prompt_token_ids: null vs absent": _NEWER,
    "completion .choices[].routed_experts: null vs absent": _NEWER,
    "completion .choices[].token_ids: null vs absent": _NEWER,
    "completion .ec_transfer_params: null vs absent": _NEWER,
    "completion .metrics: null vs absent": _NEWER,
    "completion .service_tier: null vs absent": _NEWER,
    "completion .usage.completion_tokens_details: null vs absent": _NEWER,
}

# --- stream events: "<case> <event kind> <json path>: <real kind> vs <sim kind>" → reason ---------------------
KNOWN_STREAM: Mapping[str, str] = {
    "chat-stream first .prompt_text: null vs absent": _NEWER,
    "chat-stream first .prompt_token_ids: null vs absent": _NEWER,
    "chat-stream content .choices[].token_ids: null vs absent": _NEWER,
    "chat-stream last .choices[].token_ids: null vs absent": _NEWER,
    "completion-stream content .choices[].prompt_token_ids: null vs absent": _NEWER,
    "completion-stream content .choices[].token_ids: null vs absent": _NEWER,
    "completion-stream last .choices[].prompt_token_ids: null vs absent": _NEWER,
    "completion-stream last .choices[].token_ids: null vs absent": _NEWER,
}

# --- differences only the differential test's random requests reach (tests/real_vllm/test_differential.py):
# keys as `differential.compare` makes them → reason. Not checked for staleness there (which requests come
# depends on the number of examples); every key is in docs/real_vllm.md.
_STOPS = (
    "stop strings and stop_token_ids are checked but not simulated: the simulator's text is not the model's, so "
    "it never stops on one (vLLM's stop_reason is the string or the token id)"
)
_PROMPT_LOGPROBS = (
    "prompt_logprobs are checked as vLLM checks them (types, stream, at most 20) but answered null"
)
_PARTS = (
    "which of vLLM's two content-part parsers takes a message's parts is approximated (its own for a role of its "
    "own or a message with a valid text part, else pydantic's): a part without `type` is named `type` by one only"
)
_ECHO = "echo is accepted and ignored: the simulator's text and logprobs are the completion's only"
KNOWN_DIFFERENTIAL: Mapping[str, str] = {
    "completion .choices[].stop_reason: str vs null": _STOPS,
    "completion .choices[].stop_reason: int vs null": _STOPS,
    "chat .choices[].stop_reason: str vs null": _STOPS,
    "chat .choices[].stop_reason: int vs null": _STOPS,
    "completion-stream last .choices[].stop_reason: str vs null": _STOPS,
    "completion-stream last .choices[].stop_reason: int vs null": _STOPS,
    "chat-stream last .choices[].stop_reason: str vs null": _STOPS,
    "chat-stream last .choices[].stop_reason: int vs null": _STOPS,
    "completion .choices[].prompt_logprobs: list vs null": _PROMPT_LOGPROBS,
    "completion .choices[].prompt_logprobs[]: null vs absent": _PROMPT_LOGPROBS,
    "chat .prompt_logprobs: list vs null": _PROMPT_LOGPROBS,
    "chat .prompt_logprobs[]: null vs absent": _PROMPT_LOGPROBS,
    "completion .choices[].logprobs.token_logprobs[]: null vs float": _ECHO,
    "completion .choices[].logprobs.top_logprobs[]: null vs dict": _ECHO,
    "completion .choices[].logprobs.top_logprobs[].<token>: absent vs float": _ECHO,
    "completion-stream content .choices[].logprobs.token_logprobs[]: null vs float": _ECHO,
    "completion-stream content .choices[].logprobs.top_logprobs[]: null vs dict": _ECHO,
    "completion-stream content .choices[].logprobs.top_logprobs[].<token>: absent vs float": _ECHO,
    "completion-stream last .choices[].logprobs.token_logprobs[]: null vs float": _ECHO,
    "completion-stream last .choices[].logprobs.top_logprobs[]: null vs dict": _ECHO,
    "completion-stream last .choices[].logprobs.top_logprobs[].<token>: absent vs float": _ECHO,
    "completion-stream content .choices[].prompt_token_ids: list vs absent": _ECHO,
    "completion-stream content .choices[].prompt_token_ids[]: int vs absent": _ECHO,
    "completion-stream last .choices[].prompt_token_ids: list vs absent": _ECHO,
    "completion-stream last .choices[].prompt_token_ids[]: int vs absent": _ECHO,
    "chat error: (400, 'BadRequestError', 'type') vs (400, 'BadRequestError', None)": _PARTS,
    "chat error: (400, 'BadRequestError', None) vs (400, 'BadRequestError', 'type')": _PARTS,
}

# --- errors: "<case>: <real (status, type, param)> vs <sim ...>" → reason ---------------------------------------
KNOWN_ERRORS: Mapping[str, str] = {}

# --- metrics: "<family>: <real (type, labels)> vs <sim ...>" → reason -----------------------------------------
_NEWER_METRIC = "a newer vLLM family Mosaic does not read"
KNOWN_METRIC_FAMILIES: Mapping[str, str] = {
    f"vllm:{name}: present vs absent": _NEWER_METRIC
    for name in (
        "admission_rejections",
        "engine_sleep_state",
        "estimated_flops_per_gpu",
        "estimated_read_bytes_per_gpu",
        "estimated_write_bytes_per_gpu",
        "external_prefix_cache_hits",
        "external_prefix_cache_queries",
        "mm_cache_hits",
        "mm_cache_queries",
        "num_requests_waiting_by_reason",
        "prompt_tokens_by_source",
        "prompt_tokens_cached",
        "prompt_tokens_cached_by_source",
        "request_max_num_generation_tokens",
        "request_num_preemptions",
        "request_params_max_tokens",
        "request_params_n",
        "request_prefill_kv_computed_tokens",
        "request_time_per_output_token_seconds",
    )
}
KNOWN_METRIC_LABELS: Mapping[str, str] = {
    "vllm:cache_config_info missing labels": "vLLM 0.32 reports ~35 cache labels; the simulator the 6 that matter "
    "(block_size, num_gpu_blocks, num_gpu_blocks_override, gpu_memory_utilization, cache_dtype, prefix caching)",
    "vllm:iteration_tokens_total buckets": "vLLM's buckets run to max_num_batched_tokens (16384 here); the "
    "simulator's stop at 8192",
}

# Families the gateway and the autoscaler read (REFERENCE.md): both sides must expose them, same type and labels.
CORE_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:request_success",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
)


def kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}[type(value)]


def shape(value: Any, path: str = "") -> dict[str, str]:
    """Flatten JSON to {path: kind}; lists by their first element (`[]`), empty lists as kind `list`."""
    out: dict[str, str] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(shape(item, f"{path}.{key}"))
    elif isinstance(value, list) and value:
        out[path] = "list"
        out.update(shape(value[0], f"{path}[]"))
    else:
        out[path] = kind(value)
    return out


def shape_diff(case: str, real: Any, sim: Any) -> set[str]:
    """`"<case> <path>: <real kind> vs <sim kind>"` for every path whose kind differs (`absent` when missing)."""
    a, b = shape(real), shape(sim)
    return {
        f"{case} {p}: {a.get(p, 'absent')} vs {b.get(p, 'absent')}"
        for p in a.keys() | b.keys()
        if a.get(p) != b.get(p)
    }


def token_keyed(value: Any) -> Any:
    """`value` with completions' `top_logprobs` dicts (keyed by token text: data, not schema) re-keyed to one
    `<token>` key, so their shapes compare."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "top_logprobs" and isinstance(item, list):
                item = [{"<token>": next(iter(d.values()))} if isinstance(d, dict) and d else d for d in item]
            out[key] = token_keyed(item)
        return out
    if isinstance(value, list):
        return [token_keyed(item) for item in value]
    return value


def raw_chunks(
    url: str, path: str, body: Mapping[str, Any], timeout_s: float = 60.0
) -> tuple[int, dict[str, str], list[bytes]]:
    """POST over a raw HTTP/1.1 socket and return (status, headers, the transfer-encoding chunks as sent), so
    the test sees how events are split into HTTP chunks (an HTTP client would merge or re-split them)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    data = json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode() + data
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(request)
        buf = b""
        while chunk := sock.recv(65536):
            buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    chunks: list[bytes] = []
    if headers.get("transfer-encoding") == "chunked":
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            chunks.append(rest[:size])
            rest = rest[size + 2 :]
    else:
        chunks.append(rest)
    return int(status_line.split()[1]), headers, chunks
