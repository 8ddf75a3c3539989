"""Workload files and trace → histogram binning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from placement.workload import WorkloadError, histogram_from_requests, load_workload, workload_from_dict

FIXTURES = Path(__file__).parent / "fixtures"
EDGES_IN, EDGES_OUT = (1, 512, 2048, 8193), (1, 128, 512, 2049)


def test_fixture_workload_normalises_the_histogram() -> None:
    (wl,) = load_workload(str(FIXTURES / "workload.yaml"))
    assert wl.model == "llama-3-8b" and len(wl.windows) == 1
    # weights sum to 40+20+5+15+10+3+4+2+1 = 100, rate 20 → bucket (0, 0) gets 20 · 40/100 = 8 req/s
    assert wl.windows[0].rates[0] == pytest.approx(8.0)
    assert sum(wl.windows[0].rates) == pytest.approx(20.0)


def single(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "schema": "mosaic.workload/v1",
        "model": "m",
        "input_edges": [1, 100, 200],
        "output_edges": [1, 50],
        "rate": 10,
        "histogram": [[1], [3]],
    }
    return {k: v for k, v in (base | overrides).items() if v is not None}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(single(rate=0), "0 req/s", id="zero rate → nothing to place"),
        pytest.param(single(histogram=[[0], [0]]), "all zeros", id="empty histogram"),
        pytest.param(single(histogram=[[1]]), "shape must be 2×1", id="histogram missing a row"),
        pytest.param(single(histogram=[[1], [-1]]), "≥ 0", id="negative weight"),
        pytest.param(single(schema="v0"), "field schema", id="wrong schema"),
        pytest.param(single(rate=None), "give rate and histogram, or windows", id="no rate"),
        pytest.param(single(windows=[{"rate": 1, "histogram": [[1], [1]]}]), "not both", id="both forms"),
        pytest.param(single(input_edges=[1, 100, 50]), "strictly increasing", id="edges out of order"),
    ],
)
def test_workload_errors_name_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        workload_from_dict(data, "w.yaml")


def test_windows_and_several_models() -> None:
    data = {
        "schema": "mosaic.workload/v1",
        "models": [
            single(
                schema=None,
                rate=None,
                histogram=None,
                windows=[
                    {"duration_s": 1800, "rate": 4, "histogram": [[1], [1]]},
                    {"rate": 8, "histogram": [[1], [0]]},
                ],
            ),
            single(schema=None, model="n"),
        ],
    }
    a, b = workload_from_dict(data)
    assert [w.duration_s for w in a.windows] == [1800, 3600]
    assert a.windows[0].rates == (2.0, 2.0) and a.windows[1].rates == (8.0, 0.0)
    assert b.windows[0].rates == (2.5, 7.5)  # 10 · 1/4, 10 · 3/4
    with pytest.raises(WorkloadError, match="appears twice"):
        workload_from_dict(
            {"schema": "mosaic.workload/v1", "models": [single(schema=None), single(schema=None)]}
        )


def test_timed_trace_is_binned_per_window() -> None:
    # 3 requests in the first 10 s window, 1 in the second; one prompt of 9000 tokens is outside the edges.
    reqs = [(0.0, 10, 10), (2.0, 600, 10), (9.0, 9000, 10), (16.0, 10, 600)]
    wl = histogram_from_requests(reqs, "m", EDGES_IN, EDGES_OUT, window_s=10.0)
    assert len(wl.windows) == 2
    first, second = wl.windows
    # 1 request / 10 s each in buckets (0, 0) and (1, 0)
    assert first.rates[0] == pytest.approx(0.1)
    assert first.rates[3] == pytest.approx(0.1)
    assert first.out_of_range == pytest.approx(0.1)
    # (10 in, 600 out) → bucket (0, 2); the last window is covered 10 → 16 s only: 1 request / 6 s
    assert second.rates[2] == pytest.approx(1 / 6) and second.duration_s == pytest.approx(6.0)
    # one window over the whole trace: 4 requests over 16 s of arrivals
    whole = histogram_from_requests(reqs, "m", EDGES_IN, EDGES_OUT)
    assert whole.windows[0].total == pytest.approx(4 / 16)


def test_untimed_trace_needs_a_rate() -> None:
    reqs = [(None, 10, 10), (None, 10, 10), (None, 600, 10), (None, 600, 600)]
    with pytest.raises(WorkloadError, match="no arrival times"):
        histogram_from_requests(reqs, "m", EDGES_IN, EDGES_OUT)
    wl = histogram_from_requests(reqs, "m", EDGES_IN, EDGES_OUT, rate=8.0)
    # half the requests in bucket (0, 0): 8 · 2/4 = 4 req/s
    assert wl.windows[0].rates[0] == pytest.approx(4.0)
    assert wl.windows[0].total == pytest.approx(8.0)


def test_rate_rescales_the_busiest_window_of_a_timed_trace() -> None:
    reqs = [(0.0, 10, 10), (1.0, 10, 10), (15.0, 10, 10)]
    wl = histogram_from_requests(reqs, "m", EDGES_IN, EDGES_OUT, window_s=10.0, rate=20.0, end_s=20.0)
    assert [w.total for w in wl.windows] == pytest.approx([20.0, 10.0])  # 2/10 : 1/10 kept


@pytest.mark.parametrize(
    ("window_s", "end_s", "rates", "durations"),
    [
        pytest.param(
            3600.0, None, [8 / 9], [9.0], id="window longer than the trace: 8 / (last arrival 9 − 0)"
        ),
        pytest.param(3600.0, 20.0, [0.4], [20.0], id="window longer than the trace: 8 / its known end 20"),
        pytest.param(
            4.0, None, [1.0, 0.8], [4.0, 5.0], id="last window 8 → 9 s (< half): merged, 4 requests / 4 → 9 s"
        ),
        pytest.param(
            4.0, 10.0, [1.0, 0.5, 1.0], [4.0, 4.0, 2.0], id="last window 8 → 10 s (end, half): 2 / 2 s"
        ),
        pytest.param(
            3.0,
            9.0,
            [4 / 3, 2 / 3, 2 / 3],
            [3.0, 3.0, 3.0],
            id="last arrival on a window start: merged into 6 → 9 s",
        ),
    ],
)
def test_the_last_window_counts_only_the_time_the_trace_covers(
    window_s: float, end_s: float | None, rates: list[float], durations: list[float]
) -> None:
    reqs = [(t, 10, 10) for t in (0.0, 1.0, 5.0, 9.0)] * 2  # 8 requests, two at each time
    wl = histogram_from_requests(reqs, "m", EDGES_IN, EDGES_OUT, window_s=window_s, end_s=end_s)
    assert [w.total for w in wl.windows] == pytest.approx(rates)
    assert [w.duration_s for w in wl.windows] == pytest.approx(durations)


def test_empty_trace_is_an_error() -> None:
    with pytest.raises(WorkloadError, match="no requests"):
        histogram_from_requests([], "m", EDGES_IN, EDGES_OUT)


def test_a_sliver_of_a_last_window_does_not_set_the_peak() -> None:
    """A 5 req/s trace 3,601 s long in 900 s windows: the second past the last boundary held 7 requests, read
    as a 7 req/s window, and `rate` scaled every real window to 40 · 5/7 ≈ 28 req/s (a fleet 30% short).
    The sliver joins the window before it."""
    reqs = [(i / 5, 10, 10) for i in range(18_000)] + [(3600.0 + i / 7, 10, 10) for i in range(7)]
    wl = histogram_from_requests(reqs, "m", EDGES_IN, EDGES_OUT, window_s=900.0, rate=40.0, end_s=3601.0)
    assert [w.duration_s for w in wl.windows] == [900.0, 900.0, 900.0, 901.0]
    merged = (4500 + 7) / 901  # 5.002 req/s: now the busiest window, set to 40
    assert [w.total for w in wl.windows] == pytest.approx([5 * 40 / merged] * 3 + [40.0])  # 39.98, not 28
