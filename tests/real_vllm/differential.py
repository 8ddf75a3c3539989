"""Random request bodies for the differential test (real vLLM vs the simulated worker) and the comparison.

`requests()` draws a /v1/completions or /v1/chat/completions body: a mostly valid request with a few fields
perturbed (in and out of range, wrong types, unknown fields). `compare()` sends it to both servers and
returns the differences a client would see, as keys shaped like the fidelity diff's (`fidelity.KNOWN_*`), so
a difference is either listed there with its reason or a finding:

- status, and for errors the OpenAI error's (status, type, param): `"<case> error: <real> vs <sim>"`;
- for answers: the body's shape (`fidelity.shape_diff`, completions' top_logprobs re-keyed), `object`, the
  choices' indices, and when the request determines them (ignore_eos, max_tokens, no stop condition) every
  finish_reason (`length`) and `usage.completion_tokens`;
- for streams: the framing (one `data:` event per chunk, `[DONE]` last), per choice which kinds of event come
  (chat's role event first, tokens, a finishing one), a usage event exactly when asked for, usage on every
  event with continuous usage stats, and the representative events' shapes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx
from fidelity import raw_chunks, shape_diff, token_keyed
from fidelity import shape as fidelity_shape
from hypothesis import strategies as st

MODEL = "tiny-llama"
VOCAB = 2048  # the tiny model's vocabulary (tests/real_vllm/build_model.py)
MAX_MODEL_LEN = 512

_ANY_BAD = st.sampled_from(["x", [1], {"a": 1}, True])

# field → values: ordinary ones first (hypothesis shrinks towards them), then edge and wrong-typed ones
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.one_of(
        st.integers(1, 12),
        st.sampled_from([0, -1, -5, 512, 513, 10**6, 3.0, 2.5, "4", "four", None, True, 1e30]),
    ),
    "max_completion_tokens": st.one_of(st.integers(1, 8), st.sampled_from([0, -1, 513, 2.0, 2.5, "3", None])),
    "n": st.sampled_from([1, 2, 3, 0, -1, 2.0, 1.5, "2", None, 20000]),
    "best_of": st.sampled_from([1, 2, 0, -1, 3, None, "2"]),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2, 2.01, -0.1, 1e-6, None, "hot", "0.5", 1e308]),
    "top_p": st.sampled_from([1, 0.5, 0, 1.5, -0.1, 1e-9, None, "x"]),
    "top_k": st.sampled_from([-1, 0, 1, 5, -2, 1.5, 1.0, "3", None, 10**6]),
    "min_p": st.sampled_from([0, 0.5, 1, 1.1, -0.1, None, "x"]),
    "seed": st.sampled_from([0, 42, -1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 1.5, 3.0, "7", None]),
    "stop": st.sampled_from(
        [
            "a",
            "",
            [],
            ["\n"],
            ["a", "b", "c", "d"],
            ["a", "b", "c", "d", "e"],
            [""],
            5,
            [5],
            None,
            ["a", None],
        ]
    ),
    "stop_token_ids": st.sampled_from([[], [5], [-1], [99999], "5", None, [1.5], [2047], [2048]]),
    "ignore_eos": st.sampled_from([True, False, "true", None, "maybe", 1, 0]),
    "min_tokens": st.sampled_from([0, 1, 3, 100, 600, -1, None, 1.5, 2.0, "2"]),
    "presence_penalty": st.sampled_from([0, 1.5, 2, 2.5, -2, -3, None, "x"]),
    "frequency_penalty": st.sampled_from([0, -2, -2.5, 2, 3, None, "x"]),
    "repetition_penalty": st.sampled_from([1, 1.2, 0, -1, 0.5, 3, None, "x"]),
    "logit_bias": st.sampled_from(
        [{"5": 1.0}, {"5": 200}, {"5": -100}, {"a": 1}, {"99999": 1}, {}, None, [1], {"-1": 1}, {"5": "x"}]
    ),
    "user": st.sampled_from(["u", "", 5, None]),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "nope"},
            "json",
            None,
            {},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            {"type": "json_schema"},
        ]
    ),
    "stream_options": st.sampled_from(
        [
            {"include_usage": True},
            {"include_usage": False},
            {},
            {"include_usage": True, "continuous_usage_stats": True},
            {"continuous_usage_stats": True},
            None,
            "x",
            {"include_usage": "x"},
            {"include_usage": True, "foo": 1},
        ]
    ),
    "stream": st.sampled_from([True, False, None, "true", "maybe", 1, 0]),
    "priority": st.sampled_from([0, 1, -1, "x", 1.5]),
    "unknown": st.sampled_from([1, "x", None, {"a": [1]}]),  # sent as `foo_bar`
    "model": st.sampled_from(["", "nope", None, 5, "TINY-LLAMA", "tiny-llama "]),  # None: no `model` key
    "request_id": st.sampled_from(["r-1", "", 5, None]),
    "prompt_logprobs": st.sampled_from([0, 1, 3, -1, 21, None, "x"]),
    "skip_special_tokens": st.sampled_from([True, False, "x"]),
    "truncate_prompt_tokens": st.sampled_from([1, 5, -1, 0, 600, None, "x"]),
    "truncation_side": st.sampled_from(["left", "right", None, "middle", 5]),
}
COMPLETION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "logprobs": st.one_of(
        st.integers(0, 5), st.sampled_from([20, 21, -1, -2, True, False, None, "2", 1.5, 2.0])
    ),
    "echo": st.sampled_from([True, False, None, "x", 1]),
    "suffix": st.sampled_from(["x", None, 5]),
}
CHAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "logprobs": st.sampled_from([True, False, None, 0, 1, 2, "yes", "x"]),
    "top_logprobs": st.sampled_from([0, 1, 3, 20, 21, -1, -2, None, "2", 1.5, 2.0]),
    "add_generation_prompt": st.sampled_from([True, False, "x"]),
    "continue_final_message": st.sampled_from([True, False]),
    "echo": st.sampled_from([True, False, "x"]),
    "parallel_tool_calls": st.sampled_from([True, False, "x"]),
    "chat_template_kwargs": st.sampled_from([{}, {"a": 1}, "x", None]),
}

_TEXT = st.sampled_from(["hello", "def f(x):\n    return x", "a b c", " ", "é😀", "<s>", "\n\n"])
PROMPTS = st.one_of(
    _TEXT,
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    st.lists(_TEXT, min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), min_size=1, max_size=3),
    st.sampled_from(
        [
            "",
            [],
            [[]],
            [""],
            [1, "a"],
            [[1], "a"],
            ["a", [1]],
            5,
            None,
            [VOCAB],
            [-1],
            [[-1]],
            [True],
            1.5,
            {"a": 1},
            [0],
            ["a", ""],
            [[1, 2], []],
        ]
    ),
)
_PART = st.sampled_from(
    [
        {"type": "text", "text": "hi"},
        {"type": "text", "text": ""},
        {"type": "text"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "nope"},
        "hi",
        {"text": "hi"},
    ]
)
_CONTENT = st.one_of(
    st.sampled_from(["hi", "", None, 5, [], {"a": 1}]), st.lists(_PART, min_size=1, max_size=2)
)
_ROLE = st.sampled_from(["user", "system", "assistant", "developer", "tool", "bot", "", None, 5])


@st.composite
def _message(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(["hi", 5, None, [], {}]))
    msg: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        msg["role"] = draw(_ROLE) if draw(st.booleans()) else "user"
    if draw(st.integers(0, 9)):
        msg["content"] = draw(_CONTENT) if draw(st.booleans()) else "Explain paged attention."
    if draw(st.integers(0, 9)) == 0:
        msg[draw(st.sampled_from(["name", "tool_call_id", "tool_calls", "foo"]))] = draw(_ANY_BAD)
    return msg


MESSAGES = st.one_of(
    st.just([{"role": "user", "content": "Explain paged attention."}]),
    st.lists(_message(), min_size=0, max_size=3),
    st.sampled_from(["hi", None, 5, {"role": "user", "content": "hi"}]),
)


@st.composite
def requests(draw: st.DrawFn, max_perturbed: int = 4) -> tuple[str, dict[str, Any]]:
    """(path, body): a small ignore_eos request of 1-6 tokens with up to `max_perturbed` fields drawn above."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL}
    if chat:
        body["messages"] = (
            draw(MESSAGES)
            if draw(st.integers(0, 3)) == 0
            else [{"role": "user", "content": "Explain paged attention."}]
        )
    else:
        body["prompt"] = draw(PROMPTS) if draw(st.integers(0, 2)) == 0 else "def route(request):"
    body["max_tokens"] = draw(st.integers(1, 6))
    body["ignore_eos"] = True
    if draw(st.booleans()):
        body["stream"] = True
    fields = {**FIELDS, **(CHAT_FIELDS if chat else COMPLETION_FIELDS)}
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=max_perturbed, unique=True))
    for name in names:
        value = draw(fields[name])
        if name == "unknown":
            body["foo_bar"] = value
        elif name == "model" and value is None:
            del body["model"]
        else:
            body[name] = value
    if "max_completion_tokens" in names and draw(st.booleans()):
        del body["max_tokens"]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, body


# ---------------------------------------------------------------------------------------------- comparison
def error_key(status: int, text: str) -> tuple[int, Any, Any]:
    if status == 200:
        return (200, None, None)
    try:
        error = json.loads(text)["error"]
        return (status, error.get("type"), error.get("param"))
    except (ValueError, KeyError, TypeError):
        return (status, "<not an OpenAI error>", text[:80])


def _post(url: str, path: str, body: Mapping[str, Any]) -> tuple[int, dict[str, str], list[bytes]]:
    return raw_chunks(url, path, body, timeout_s=120)


def _determined(body: Mapping[str, Any], chat: bool) -> int | None:
    """The completion tokens each choice must have when the request fixes them (ignore_eos, an explicit small
    max_tokens, nothing that stops early), else None."""
    if body.get("ignore_eos") is not True or any(
        body.get(k) for k in ("stop", "stop_token_ids", "response_format", "logit_bias", "min_tokens")
    ):
        return None
    field = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    value = body.get(field)
    if type(value) is not int or not 1 <= value <= 12:
        return None
    if body.get("echo") or (chat and body.get("continue_final_message")):
        return None
    return value


def _stream_events(chunks: list[bytes]) -> tuple[list[str], list[dict[str, Any]]]:
    """Framing problems, and the JSON events before [DONE]."""
    problems = []
    if not chunks or chunks[-1] != b"data: [DONE]\n\n":
        problems.append("no [DONE] last")
    events = []
    for chunk in chunks:
        if not (chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n\n") == 1):
            problems.append("not one data event per chunk")
            continue
        if chunk != b"data: [DONE]\n\n":
            try:
                events.append(json.loads(chunk[len(b"data: ") :]))
            except ValueError:
                problems.append("event not JSON")
    return problems, events


def _event_kind(event: Mapping[str, Any], chat: bool) -> tuple[int, str]:
    if "error" in event:
        return (-2, "error")
    if not event.get("choices"):
        return (-1, "usage")
    choice = event["choices"][0]
    if chat and (choice.get("delta") or {}).get("role"):
        return (choice["index"], "role")
    return (choice["index"], "last" if choice.get("finish_reason") else "token")


def _stream_summary(events: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    kinds = [_event_kind(e, chat) for e in events]
    per_choice: dict[int, list[str]] = {}
    for index, kind_ in kinds:
        seq = per_choice.setdefault(index, [])
        # token events are left out: a loaded vLLM may merge tokens (the last with the finishing event), and
        # one that stops on a stop string sends fewer; their count is compared through usage when determined
        if kind_ != "token" and (not seq or seq[-1] != kind_):
            seq.append(kind_)
    return {
        "choices per event": sorted({len(e.get("choices") or []) for e in events if "error" not in e}),
        "kinds per choice": per_choice,
        "usage event last": bool(kinds) and kinds[-1] == (-1, "usage"),
        "usage on every event": bool(events) and all(e.get("usage") for e in events),
        "finish reasons": sorted(
            {str(e["choices"][0].get("finish_reason")) for e in events if e.get("choices")}
        ),
    }


def _representatives(events: list[dict[str, Any]], chat: bool) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, event in enumerate(events):
        _, kind_ = _event_kind(event, chat)
        name = {"role": "first", "token": "content"}.get(kind_, kind_)
        if kind_ == "token" and chat and i == 0:
            name = "first"
        out.setdefault(name, event)
    return out


def _shape_diff(case: str, real: Any, sim: Any) -> set[str]:
    """`fidelity.shape_diff` of the two, completions' top_logprobs re-keyed, without the differences an
    empty list makes (`[]` has no element kind: vLLM's `bytes` of a token that is no whole UTF-8 character)."""
    a, b = fidelity_shape(token_keyed(real)), fidelity_shape(token_keyed(sim))
    out = set()
    for key in shape_diff(case, token_keyed(real), token_keyed(sim)):
        path = key[len(case) + 1 :].split(":")[0]
        parent = path[: path.rfind("[]")] if "[]" in path else None
        if parent is not None and a.get(parent) == b.get(parent) == "list" and "absent" in key:
            continue
        out.add(key)
    return out


def compare(real_url: str, sim_url: str, path: str, body: Mapping[str, Any]) -> set[str]:
    """The differences between what the two servers answer to `body`, as keys (see the module docstring)."""
    chat = path.endswith("chat/completions")
    case = "chat" if chat else "completion"
    (rs, rh, rc), (ss, sh, sc) = _post(real_url, path, body), _post(sim_url, path, body)
    real_text, sim_text = b"".join(rc).decode(errors="replace"), b"".join(sc).decode(errors="replace")
    if rs != 200 or ss != 200:
        a, b = error_key(rs, real_text), error_key(ss, sim_text)
        return set() if a == b else {f"{case} error: {a} vs {b}"}
    streamed = rh.get("content-type", "").startswith("text/event-stream")
    if streamed != sh.get("content-type", "").startswith("text/event-stream"):
        return {f"{case} streamed: {streamed} vs {not streamed}"}
    n_tokens = _determined(body, chat)
    diffs: set[str] = set()
    if not streamed:
        real, sim = json.loads(real_text), json.loads(sim_text)
        diffs |= _shape_diff(case, real, sim)
        for key in ("object",):
            if real.get(key) != sim.get(key):
                diffs.add(f"{case} .{key}: {real.get(key)!r} vs {sim.get(key)!r}")
        ri = [c.get("index") for c in real.get("choices", [])]
        si = [c.get("index") for c in sim.get("choices", [])]
        if ri != si:
            diffs.add(f"{case} choice indices: {ri} vs {si}")
        if n_tokens is not None:
            for side, answer in (("real", real), ("sim", sim)):
                reasons = {c.get("finish_reason") for c in answer.get("choices", [])}
                if reasons != {"length"}:
                    diffs.add(f"{case} finish_reason not length on {side}: {sorted(map(str, reasons))}")
            ru, su = real["usage"]["completion_tokens"], sim["usage"]["completion_tokens"]
            if ru != su:
                diffs.add(f"{case} usage.completion_tokens: {ru} vs {su}")
        return diffs
    scase = f"{case}-stream"
    (rp, revents), (sp, sevents) = _stream_events(rc), _stream_events(sc)
    for problem in set(rp) ^ set(sp):
        diffs.add(f"{scase} framing {problem!r}: {problem in rp} vs {problem in sp}")
    rsum, ssum = _stream_summary(revents, chat), _stream_summary(sevents, chat)
    if n_tokens is None:  # finish reasons are not determined
        rsum.pop("finish reasons"), ssum.pop("finish reasons")
    for key in rsum:
        if rsum[key] != ssum[key]:
            diffs.add(f"{scase} {key}: {rsum[key]} vs {ssum[key]}")
    rrep, srep = _representatives(revents, chat), _representatives(sevents, chat)
    for kind_ in rrep.keys() & srep.keys():
        diffs |= _shape_diff(f"{scase} {kind_}", rrep[kind_], srep[kind_])
    if n_tokens is not None and "usage" in rrep and "usage" in srep:
        ru, su = rrep["usage"]["usage"]["completion_tokens"], srep["usage"]["usage"]["completion_tokens"]
        if ru != su:
            diffs.add(f"{scase} usage.completion_tokens: {ru} vs {su}")
    return diffs


def probe(real_url: str, sim_url: str, path: str, body: Mapping[str, Any]) -> tuple[Any, Any]:
    """Both answers in full (for a report): status and text."""
    with httpx.Client(timeout=120) as http:
        a, b = http.post(real_url + path, json=body), http.post(sim_url + path, json=body)
    return (a.status_code, a.text[:600]), (b.status_code, b.text[:600])
