"""`helm test`'s Pod (templates/tests/) asks the gateway's Service for what an operator would check first, and
NOTES.txt tells the truth about the LoadBalancer address and about which pods carry scrape annotations.
The Pod's script itself runs against a live gateway in test_chart_smoke.py."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.chart.chartkit import EXAMPLES_DIR, RELEASE, Rendered, container, env_map, load_values, render

TEST_POD = f"{RELEASE}-gateway-test"


def _test_pod(rendered: Rendered) -> dict[str, Any]:
    return rendered.get("Pod", TEST_POD)


@pytest.mark.parametrize(
    "values",
    [
        pytest.param({}, id="default values"),
        pytest.param(
            load_values(EXAMPLES_DIR / "multi-model.yaml"), id="multi-model: existing Secret, 2 models"
        ),
        pytest.param({"auth": {"enabled": False}, "gateway": {"service": {"port": 8088}}}, id="no auth"),
    ],
)
def test_the_helm_test_pod_asks_the_gateway_service(chart: helm.Chart, values: dict[str, Any]) -> None:
    """Before: no test hook; `helm test` reported nothing to run."""
    rendered = render(chart, values)
    pod = _test_pod(rendered)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    gateway = rendered.get("Deployment", f"{RELEASE}-gateway")
    svc = rendered.get("Service", f"{RELEASE}-gateway")
    (c,) = pod["spec"]["containers"]
    # the Mosaic image (already pulled for the gateway) running its own Python: nothing new to pull
    assert c["image"] == container(gateway)["image"] and c["command"][:2] == ["python", "-c"]
    env = env_map(c)
    assert env["MOSAIC_URL"]["value"] == f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    models = sorted({p["model"] for p in rendered.config()["pools"]})
    assert sorted(json.loads(env["MOSAIC_MODELS"]["value"])) == models
    if rendered.config().get("auth"):
        # the keys the gateway checks, from the same Secret key
        assert env["MOSAIC_API_KEYS"] == env_map(container(gateway))["MOSAIC_API_KEYS"]
    else:
        assert "MOSAIC_API_KEYS" not in env
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"]
    for version in ("1.27.0", kubernetes_validate.utils.latest_version()):
        kubernetes_validate.validate(pod, version, strict=True)


def test_the_notes_point_at_helm_test(chart: helm.Chart) -> None:
    assert f"helm test {RELEASE} -n llm" in render(chart).notes


# ---- NOTES.txt ----


def test_a_load_balancer_address_is_its_ip_or_its_hostname(chart: helm.Chart) -> None:
    """Before: only `.ingress[0].ip`, empty on AWS, whose load balancers have a hostname: MOSAIC_URL was `http://:80`."""
    notes = render(chart, {"gateway": {"service": {"type": "LoadBalancer"}}}).notes
    assert (
        "export MOSAIC_URL=http://$(kubectl -n llm get svc mosaic-gateway -o jsonpath="
        "'{.status.loadBalancer.ingress[0].ip}{.status.loadBalancer.ingress[0].hostname}'):80"
    ) in notes


@pytest.mark.parametrize(
    ("key", "path"),
    [("api-keys", "{.data.api-keys}"), ("api.keys", "{.data.api\\.keys}"), ("a.b.c", "{.data.a\\.b\\.c}")],
)
def test_the_api_key_command_reads_the_secret_key_the_gateway_uses(
    chart: helm.Chart, key: str, path: str
) -> None:
    """Before: a key name with a dot (`auth.apiKeysKey: api.keys`, which the schema allows) gave
    `{.data.api.keys}`, a path kubectl's JSONPath reads as two fields: MOSAIC_API_KEY was empty."""
    notes = render(chart, {"auth": {"apiKeysKey": key}}).notes
    assert f"-o jsonpath='{path}' | base64 -d" in notes


@pytest.mark.parametrize(
    ("labels", "line"),
    [
        pytest.param(
            {},
            "its ruleSelector matches the rule's labels: none are set (monitoring.prometheusRule.labels), and "
            "kube-prometheus-stack's selector wants release: <its release name>.",
            id="no labels: the usual reason a rule is never loaded",
        ),
        pytest.param(
            {"release": "kps", "team": "ml"},
            "its ruleSelector matches the rule's labels (release: kps, team: ml).",
            id="labels",
        ),
    ],
)
def test_the_notes_name_the_alert_rule_and_what_loads_it(
    chart: helm.Chart, labels: dict[str, str], line: str
) -> None:
    monitoring = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True, "labels": labels}}
    notes = render(chart, {"monitoring": monitoring}).notes
    assert "Alerts: PrometheusRule/mosaic (group mosaic.rules" in notes and line in notes
    assert "Alerts:" not in render(chart, {"monitoring": {"serviceMonitor": {"enabled": True}}}).notes


@pytest.mark.parametrize(
    ("monitoring", "line", "annotated"),
    [
        pytest.param(
            {},
            "Metrics: the gateway, controller and worker pods carry prometheus.io/scrape annotations (/metrics).",
            {"gateway", "controller", "worker"},
            id="annotations",
        ),
        pytest.param(
            {"scrapeAnnotations": False},
            "Metrics: only the worker pods carry prometheus.io/scrape annotations",
            {"worker"},
            id="annotations off",
        ),
        pytest.param(
            {"podMonitor": {"enabled": True}},
            "Metrics: the Prometheus operator scrapes /metrics of the gateway, the workers and the controller.",
            {"worker"},
            id="operator",
        ),
    ],
)
def test_the_notes_say_which_pods_carry_scrape_annotations(
    chart: helm.Chart, monitoring: dict[str, Any], line: str, annotated: set[str]
) -> None:
    """Before: with scrapeAnnotations=false the notes still said pods carried scrape annotations."""
    rendered = render(chart, {"monitoring": monitoring})
    assert line in rendered.notes
    # what the notes say is what the pods carry
    assert {
        d["metadata"]["labels"]["app.kubernetes.io/component"]
        for d in rendered.of_kind("Deployment")
        if "prometheus.io/scrape" in d["spec"]["template"]["metadata"]["annotations"]
    } == annotated
