"""A gateway pod shuts down without cutting requests: a preStop sleep keeps it serving while its endpoint
removal reaches kube-proxy and load balancers, then SIGTERM drains in-flight requests within
`config.limits.shutdown_grace_s`, all inside `terminationGracePeriodSeconds`. And its readiness probe
(`/ready`) can be made strict per model through the `config.readiness` section."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from server.config import LimitsConfig
from tests.chart.chartkit import CHART_DIR, RELEASE, container, pod_spec, render

DOCKERFILE = CHART_DIR.parents[1] / "deploy" / "Dockerfile"


def _gateway(chart: helm.Chart, values: dict[str, Any]) -> dict[str, Any]:
    return render(chart, values).get("Deployment", f"{RELEASE}-gateway")


def _validate(obj: dict[str, Any], versions: tuple[str, ...]) -> None:
    for version in versions:
        kubernetes_validate.validate(obj, version, strict=True)


def test_default_drains_before_sigterm_and_gives_the_drain_its_grace(chart: helm.Chart) -> None:
    dep = _gateway(chart, {})
    c = container(dep)
    # Before: no preStop and the default 30 s grace = shutdown_grace_s, so SIGTERM (draining → 503) came
    # while endpoints still routed to the pod, and a stream still running at 30 s was killed.
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    grace = LimitsConfig().shutdown_grace_s  # the chart's default must follow the gateway's
    assert pod_spec(dep)["terminationGracePeriodSeconds"] == 10 + grace + 5
    assert c["command"] == ["mosaic"] and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    _validate(dep, ("1.27.0", kubernetes_validate.utils.latest_version()))


def test_the_image_has_the_sleep_the_exec_prestop_runs() -> None:
    """`exec: sleep` needs the binary in the image: the runtime stage is Debian's python slim (coreutils),
    not a distroless or scratch base (use `gateway.preStop: sleep` with such an image)."""
    stages = re.findall(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE)
    assert re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim(-bookworm)?", stages[-1]), stages


def test_the_kubelets_sleep_action_instead_of_exec(chart: helm.Chart) -> None:
    dep = _gateway(chart, {"gateway": {"preStop": "sleep", "drainSeconds": 7}})
    assert container(dep)["lifecycle"] == {"preStop": {"sleep": {"seconds": 7}}}
    assert pod_spec(dep)["terminationGracePeriodSeconds"] == 7 + 30 + 5
    _validate(dep, (kubernetes_validate.utils.latest_version(),))  # the field exists from 1.29 on


def test_no_drain_renders_no_hook(chart: helm.Chart) -> None:
    dep = _gateway(chart, {"gateway": {"drainSeconds": 0}})
    assert "lifecycle" not in container(dep)
    assert pod_spec(dep)["terminationGracePeriodSeconds"] == 35


def test_the_grace_period_follows_the_configured_shutdown_grace(chart: helm.Chart) -> None:
    dep = _gateway(chart, {"config": {"limits": {"shutdown_grace_s": 120.5}}})
    assert pod_spec(dep)["terminationGracePeriodSeconds"] == 10 + 121 + 5  # uvicorn waits ceil(grace)


def test_an_explicit_grace_period_is_kept_when_it_covers_the_drain(chart: helm.Chart) -> None:
    dep = _gateway(chart, {"gateway": {"terminationGracePeriodSeconds": 300}})
    assert pod_spec(dep)["terminationGracePeriodSeconds"] == 300


def test_a_grace_period_shorter_than_drain_plus_shutdown_grace_is_refused(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, {"gateway": {"terminationGracePeriodSeconds": 30}})
    assert (
        "gateway.terminationGracePeriodSeconds (30) must be at least gateway.drainSeconds (10) + "
        "config.limits.shutdown_grace_s (30) = 40" in str(caught.value)
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gateway": {"preStop": "httpGet"}}, "at '/gateway/preStop': value must be one of 'exec', 'sleep'"),
        ({"gateway": {"drainSeconds": -1}}, "at '/gateway/drainSeconds': minimum: got -1, want 0"),
    ],
)
def test_schema_refuses_bad_shutdown_values(chart: helm.Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert message in str(caught.value)


def test_strict_readiness_passes_through_to_the_gateway_config(chart: helm.Chart, tmp_path: Path) -> None:
    assert render(chart, {}).load_config(tmp_path).readiness.require_all_models is False
    rendered = render(chart, {"config": {"readiness": {"require_all_models": True}}})
    (tmp_path / "strict").mkdir()
    assert rendered.load_config(tmp_path / "strict").readiness.require_all_models is True


def test_cors_passes_through_to_the_gateway_config(chart: helm.Chart, tmp_path: Path) -> None:
    assert render(chart, {}).load_config(tmp_path).cors.allowed_origins == []  # vLLM 0.32's default: off
    rendered = render(chart, {"config": {"cors": {"allowed_origins": ["https://chat.example"]}}})
    (tmp_path / "cors").mkdir()
    assert rendered.load_config(tmp_path / "cors").cors.allowed_origins == ["https://chat.example"]
