"""The reject table (one row per reason, iterated) and the Reject summary."""

from __future__ import annotations

import pytest

from scheduler.routing.reasons import REJECT_TABLE, FilterReason, Reject

# the gateway's own errors' types for these statuses (server/errors.py), so a client sees one vocabulary
TYPES_BY_STATUS = {
    400: "BadRequestError",
    404: "NotFoundError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def test_every_reason_has_exactly_one_row():
    assert set(REJECT_TABLE) == set(FilterReason)


@pytest.mark.parametrize("reason", list(FilterReason), ids=lambda r: f"{r.value} maps to one status and type")
def test_each_row_is_a_consistent_openai_error(reason: FilterReason):
    rule = REJECT_TABLE[reason]
    assert rule.error_type == TYPES_BY_STATUS[rule.status]
    assert rule.code and rule.code == rule.code.lower()
    # retryable reasons are the ones that can clear by waiting: 429 (full now) or 503 (not ready now); a 503
    # for a role no worker has, or a pool nothing can add one to, cannot
    final_503 = (FilterReason.WRONG_ROLE, FilterReason.POOL_STAYS_EMPTY)
    assert rule.retryable == (rule.status in (429, 503) and reason not in final_503)
    assert rule.retry_after_s >= 0
    body = Reject.from_counts({reason: 1}).error_body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == rule.error_type and body["error"]["code"] == rule.code


@pytest.mark.parametrize(
    ("counts", "summary", "primary"),
    [
        pytest.param(
            {FilterReason.KV_FULL: 3, FilterReason.DRAINING: 1},
            "no worker fits: 3 kv_full, 1 draining",
            FilterReason.KV_FULL,
            id="kv full on three and one draining → kv_full, most frequent first",
        ),
        pytest.param(
            {FilterReason.WRONG_MODEL: 5, FilterReason.BREAKER_OPEN: 2},
            "no worker fits: 2 breaker_open",
            FilterReason.BREAKER_OPEN,
            id="workers of other models are left out of the summary",
        ),
        pytest.param(
            {FilterReason.WRONG_MODEL: 4},
            "no worker fits: 4 wrong_model",
            FilterReason.WRONG_MODEL,
            id="no worker serves the model → model_not_found",
        ),
        pytest.param(
            {FilterReason.EXCLUDED: 3, FilterReason.AT_CAPACITY: 1},
            "no worker fits: 3 excluded, 1 at_capacity",
            FilterReason.AT_CAPACITY,
            id="a retryable reason wins over a more frequent final one",
        ),
        pytest.param(
            {FilterReason.EXCLUDED: 2, FilterReason.WRONG_ROLE: 2},
            "no worker fits: 2 excluded, 2 wrong_role",
            FilterReason.EXCLUDED,
            id="equal counts break by table order",
        ),
        pytest.param(
            {FilterReason.WRONG_ROLE: 3, FilterReason.EXCEEDS_CONTEXT: 1},
            "no worker fits: 3 wrong_role, 1 exceeds_context",
            FilterReason.EXCEEDS_CONTEXT,
            id="workers of an unused role are the reason only when nothing else is (was wrong_role: a 503)",
        ),
        pytest.param(
            {}, "no worker fits: no workers", FilterReason.NO_WORKERS, id="empty fleet → no_workers"
        ),
    ],
)
def test_summary_and_primary_reason(counts, summary, primary):
    reject = Reject.from_counts(counts)
    assert reject.reason == summary
    assert reject.primary is primary
    assert reject.retryable == REJECT_TABLE[primary].retryable
    assert reject.retry_after_s == REJECT_TABLE[primary].retry_after_s


def test_model_not_found_message_names_the_model():
    body = Reject.from_counts({FilterReason.WRONG_MODEL: 1}).error_body(model="gpt-9")
    assert body["error"]["message"] == "The model 'gpt-9' does not exist or no worker serves it"
    assert Reject.from_counts({FilterReason.WRONG_MODEL: 1}).http_status == 404
