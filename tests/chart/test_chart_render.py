"""The chart renders, lints clean and produces objects the Kubernetes API accepts, for the default values and
every example values file (helm/mosaic/examples/).

Rendering and linting use Helm's own Go code (helm-python-sdk); objects are validated against the API's
OpenAPI schemas by kubernetes-validate in strict mode (unknown fields are errors), for the oldest Kubernetes
the chart supports (Chart.yaml kubeVersion) and the newest kubernetes-validate knows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.chart.chartkit import (
    CHART_DIR,
    CRD_KINDS,
    LABEL_VALUE,
    NAMESPACE,
    Rendered,
    example_files,
    load_values,
    render,
    walk_labels,
)

KUBE_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())

CASES = [pytest.param(None, id="default values")] + [
    pytest.param(path, id=f"example {path.name}") for path in example_files()
]


def _values(path: Path | None) -> dict[str, Any]:
    return {} if path is None else load_values(path)


def test_there_are_at_least_three_examples() -> None:
    names = {p.name for p in example_files()}
    assert {"simulated-fleet.yaml", "heterogeneous-pd.yaml", "multi-model.yaml"} <= names


def test_chart_metadata_matches_the_package_version(chart: helm.Chart) -> None:
    meta = chart.metadata
    project = (CHART_DIR.parents[1] / "pyproject.toml").read_text()
    version = next(line.split('"')[1] for line in project.splitlines() if line.startswith("version = "))
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] == version
    assert chart.schema is not None, "values.schema.json must ship with the chart"


@pytest.mark.parametrize("values_file", CASES)
def test_lint_has_no_errors_or_warnings(values_file: Path | None) -> None:
    report = helm.lint(
        CHART_DIR, _values(values_file), strict=True, namespace=NAMESPACE, kube_version="v1.33.0"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("values_file", CASES)
def test_every_object_validates_against_the_kubernetes_api(
    chart: helm.Chart, values_file: Path | None
) -> None:
    rendered = render(chart, _values(values_file))
    assert rendered.objects, "nothing rendered"
    checked = 0
    for obj in rendered.objects:
        if obj["kind"] in CRD_KINDS:
            continue  # no OpenAPI schema for CRDs in kubernetes-validate; see test_chart_structure.py
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                pytest.fail(
                    f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}): {where}: {exc.message}"
                )
        checked += 1
    assert checked >= 8  # gateway (Deployment, Service, SA, Role, Binding, ConfigMap, PDB) + ≥1 pool


@pytest.mark.parametrize("values_file", CASES)
def test_every_object_is_namespaced_in_the_release_and_named_validly(
    chart: helm.Chart, values_file: Path | None
) -> None:
    rendered = render(chart, _values(values_file))
    seen: set[tuple[str, str]] = set()
    for obj in rendered.objects:
        meta = obj["metadata"]
        key = (obj["kind"], meta["name"])
        assert key not in seen, f"{key} rendered twice"
        seen.add(key)
        assert meta["namespace"] == NAMESPACE, key
        assert len(meta["name"]) <= 63, key
        for label, value in walk_labels(obj):
            assert LABEL_VALUE.match(str(value)), f"{key}: label {label}={value!r} is not a valid label value"


@pytest.mark.parametrize("values_file", CASES)
def test_notes_tell_how_to_reach_the_gateway_and_try_a_request(
    chart: helm.Chart, values_file: Path | None
) -> None:
    values = _values(values_file)
    rendered = render(chart, values)
    pools = values.get("pools") or chart.values["pools"]
    assert "/v1/chat/completions" in rendered.notes
    assert f'"model": "{pools[0]["model"]}"' in rendered.notes
    for pool in pools:
        assert f"- {pool['name']}: {pool['model']} on {pool['gpu']}" in rendered.notes


def test_every_manifest_is_yaml_that_round_trips(chart: helm.Chart) -> None:
    """Guards against templates that emit stray text (e.g. a comment glued to a value)."""
    rendered: Rendered = render(chart, load_values(example_files()[0]))
    for obj in rendered.objects:
        assert yaml.safe_load(yaml.safe_dump(obj)) == obj


def test_packaged_chart_renders_the_same_objects(chart: helm.Chart, tmp_path: Path) -> None:
    """`helm package` output (what a chart repository serves) carries everything the templates read."""
    archive = helm.package(CHART_DIR, destination=tmp_path)
    assert Path(archive).name == "mosaic-0.1.0.tgz"
    values = load_values(example_files()[0]) | {"monitoring": {"grafanaDashboard": {"enabled": True}}}
    with helm.Chart.load(archive) as packaged:
        from_archive = render(packaged, values)
    from_dir = render(chart, values)
    # Secrets differ only by the generated key (randAlphaNum); everything else is identical.
    strip = [o for o in from_dir.objects if o["kind"] != "Secret"]
    assert [o for o in from_archive.objects if o["kind"] != "Secret"] == strip
