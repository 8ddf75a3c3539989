"""Hot-path shortcuts keep the behaviour of what they replace: request ids, header scan, usage extraction,
memoised metric children, cached worker views."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from scheduler.fleet import Role, WorkerCapacity, WorkerState
from server.app import _request_headers, new_request_id, request_id_from
from server.breaker import CircuitBreaker
from server.proxy import response_usage
from server.registry import VIEW_AGE_RESOLUTION_S, PoolInfo, WorkerRecord
from server.scrape import WorkerStats

USAGE = {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24}


def test_new_request_id_is_a_uuid4_hex() -> None:
    ids = {new_request_id() for _ in range(200)}
    assert len(ids) == 200
    for rid in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        u = uuid.UUID(hex=rid)
        assert u.version == 4 and u.variant == uuid.RFC_4122


@pytest.mark.parametrize(
    ("header", "kept"),
    [
        pytest.param("client-id-42", True, id="a safe client id is kept"),
        pytest.param("bad id with spaces", False, id="an id with spaces is replaced"),
        pytest.param("x" * 129, False, id="an id over 128 characters is replaced"),
        pytest.param(None, False, id="no header → a new id"),
    ],
)
def test_request_id_from(header: str | None, kept: bool) -> None:
    rid = request_id_from(header)
    assert (rid == header) is kept
    if not kept:
        assert len(rid) == 32


def test_request_headers_takes_the_first_of_each() -> None:
    scope: dict[str, Any] = {
        "headers": [
            (b"content-type", b"application/json"),
            (b"x-request-id", b"first"),
            (b"content-type", b"text/plain"),
            (b"authorization", b"Bearer k1"),
            (b"x-request-id", b"second"),
            (b"content-length", b"12"),
            (b"authorization", b"Bearer k2"),
        ]
    }
    assert _request_headers(scope) == ("first", "Bearer k1", "12", "application/json")
    assert _request_headers({"headers": []}) == (None, None, None, None)


def _body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param(_body(id="x", choices=[{"text": "hi"}], usage=USAGE), USAGE, id="usage after choices"),
        pytest.param(_body(usage=USAGE, choices=[{"text": "hi"}]), USAGE, id="usage before choices"),
        pytest.param(
            _body(choices=[{"text": 'he wrote "usage": {"prompt_tokens": 1}'}], usage=USAGE),
            USAGE,
            id="a quoted usage key inside the generated text is not the usage",
        ),
        pytest.param(
            _body(usage=USAGE, choices=[{"text": 'tail "usage": {"prompt_tokens": 1}'}]),
            USAGE,
            id="usage first, quoted usage in the text last → the real one",
        ),
        pytest.param(
            _body(usage={**USAGE, "prompt_tokens_details": None}),
            {**USAGE, "prompt_tokens_details": None},
            id="vLLM's prompt_tokens_details: null is kept",
        ),
        pytest.param(_body(usage=None), None, id="usage null → None"),
        pytest.param(_body(choices=[]), None, id="no usage → None"),
        pytest.param(b'not json "usage": {"prompt_tokens": 1}', None, id="not JSON → None"),
    ],
)
def test_response_usage_matches_a_full_parse(body: bytes, expected: dict[str, Any] | None) -> None:
    assert response_usage(body) == expected


def test_metric_children_are_memoised_per_label_set() -> None:
    from server.dispatch import Dispatcher

    d = Dispatcher.__new__(Dispatcher)  # only the memo is exercised
    d._children = {}
    reg = CollectorRegistry()
    c = Counter("x", "x", ["model", "pool"], registry=reg)
    a = d.child(c, "m", "p1")
    assert d.child(c, "m", "p1") is a and d.child(c, "m", "p2") is not a
    a.inc(2)
    assert reg.get_sample_value("x_total", {"model": "m", "pool": "p1"}) == 2.0


def _record() -> WorkerRecord:
    cap = WorkerCapacity(
        prefill_tokens_per_s=10_000.0, decode_tokens_per_s=2_000.0, kv_blocks=1000, block_size=16,
        cost_per_hour=2.0, max_num_seqs=256, max_model_len=8192, api_overhead_s=0.001,
    )  # fmt: skip
    info = PoolInfo("p", "llama-3-8b", "H100", Role.MIXED, cap)
    return WorkerRecord("p/w0", "http://w0", info, CircuitBreaker(3, 5.0), health_ok=True)


def test_cached_view_is_reused_until_something_it_shows_changes() -> None:
    rec = _record()
    v1 = rec.cached_view(100.0, 5.0)
    assert rec.cached_view(100.001, 5.0) is v1  # nothing changed
    rec.inflight_requests += 1
    v2 = rec.cached_view(100.002, 5.0)
    assert v2 is not v1 and v2.inflight_requests == 1
    rec.breaker.record_failure(100.0, hard=True)
    v3 = rec.cached_view(100.003, 5.0)
    assert v3.breaker_open and not v2.breaker_open
    rec.health_ok = False
    assert rec.cached_view(100.004, 5.0).state is WorkerState.UNHEALTHY


def test_cached_view_follows_scrapes_staleness_and_age() -> None:
    rec = _record()
    rec.stats, rec.stats_at = WorkerStats(num_running=3), 100.0
    v = rec.cached_view(100.0, 5.0)
    assert v.num_running == 3 and v.scrape_age_s == 0.0
    # within one age step the view (and its age) is reused; a step later the age is refreshed
    assert rec.cached_view(100.0 + VIEW_AGE_RESOLUTION_S / 2, 5.0) is v
    later = rec.cached_view(100.0 + 3 * VIEW_AGE_RESOLUTION_S, 5.0)
    assert later.scrape_age_s == pytest.approx(3 * VIEW_AGE_RESOLUTION_S)
    rec.stats = WorkerStats(num_running=7)  # a new scrape, even with the same timestamp
    assert rec.cached_view(100.0, 5.0).num_running == 7
    stale = rec.cached_view(106.0, 5.0)  # 6 s > stale_after_s = 5 → scraped fields withheld
    assert stale.num_running is None and stale.scrape_age_s is None
    assert stale == rec.view(106.0, 5.0)


def test_forked_processes_draw_different_request_ids() -> None:
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report one id and leave at once
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child_id = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child_id) == 32 and child_id != new_request_id()


def test_views_filled_slot_by_slot_equal_the_dataclass_constructor() -> None:
    """`new_worker_view` (slot descriptors) against `WorkerView(**fields)`: equal, same hash, and frozen."""
    import dataclasses

    from scheduler.fleet import WorkerView
    from server.registry import VIEW_FIELD_ORDER, new_worker_view

    assert tuple(f.name for f in dataclasses.fields(WorkerView)) == VIEW_FIELD_ORDER
    rec = _record()
    rec.stats, rec.stats_at = (
        WorkerStats(num_running=3, num_waiting=1, kv_usage=0.25, num_gpu_blocks=900),
        100.0,
    )
    rec.inflight_requests, rec.inflight_prefill_tokens, rec.domain = 2, 512, "rack-1"
    for now in (101.0, 200.0):  # fresh stats, then stale (scraped fields None)
        built = rec.view(now, 5.0)
        fields = {name: getattr(built, name) for name in VIEW_FIELD_ORDER}
        reference = WorkerView(**fields)
        assert built == reference and hash(built) == hash(reference) and repr(built) == repr(reference)
        assert new_worker_view(*fields.values()) == reference
    assert built.num_running is None and built.inflight_prefill_tokens == 512 and built.domain == "rack-1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.inflight_requests = 5  # type: ignore[misc]
