"""Fixtures for the chart tests: the chart loaded once per session (a native Helm handle, closed at the end)."""

from __future__ import annotations

from collections.abc import Iterator

import helm_python as helm
import pytest

from tests.chart.chartkit import CHART_DIR


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded
