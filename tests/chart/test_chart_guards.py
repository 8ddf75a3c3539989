"""Values that would render but break in the cluster fail the render with a message naming the values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.chart.chartkit import render


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {"poolDefaults": {"drainSeconds": 300, "terminationGracePeriodSeconds": 60}},
            "drainSeconds 300 must be below terminationGracePeriodSeconds 60",
            id="a worker's preStop drain longer than its grace period: killed mid-drain on every scale-in",
        ),
        pytest.param(
            {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
            "gateway.autoscaling.minReplicas 5 is above maxReplicas 2",
            id="an HPA the API server refuses mid-install",
        ),
    ],
)
def test_values_that_break_in_the_cluster_fail_the_render(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError) as caught:
        render(chart, values)
    assert message in str(caught.value)


def test_a_gateway_scaled_to_zero_still_renders_a_config_the_controller_loads(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """Before: `gateway.replicas: 0` wrote `gateway.replicas: 0` into the shared ConfigMap, which the
    controller (`mosaic autoscale --config`) refused, so it crash-looped while the gateway was down."""
    rendered = render(chart, {"gateway": {"replicas": 0}, "controller": {"enabled": True}})
    assert rendered.config()["gateway"]["replicas"] == 1
    assert rendered.load_config(tmp_path).gateway.replicas == 1


@pytest.mark.parametrize("resource", ["endpointslices", "pods"])
def test_an_all_digit_pool_name_stays_a_string_label(
    chart: helm.Chart, tmp_path: Path, resource: str
) -> None:
    """The schema accepts a pool named `123` (a DNS label); unquoted it rendered as an integer label value,
    which the API server refuses, and the pods selector read `mosaic.dev/pool=%!s(float64=123)`."""
    values = {
        "pools": [{"name": "123", "model": "llama-3-8b", "gpu": "L4", "simulated": True}],
        "gateway": {"discovery": {"resource": resource}},
    }
    rendered = render(chart, values)
    dep = rendered.get("Deployment", "mosaic-123")
    assert dep["metadata"]["labels"]["mosaic.dev/pool"] == "123"
    assert dep["spec"]["template"]["metadata"]["labels"]["mosaic.dev/pool"] == "123"
    assert dep["spec"]["selector"]["matchLabels"]["mosaic.dev/pool"] == "123"
    config = rendered.load_config(tmp_path)
    (pool,) = config.pools
    if resource == "pods":
        assert "mosaic.dev/pool=123" in pool.endpoints.kubernetes.label_selector.split(",")
