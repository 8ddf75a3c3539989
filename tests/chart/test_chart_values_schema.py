"""Bad values are refused before anything reaches the cluster, with a message naming the key.

Two layers, both run by `helm install/upgrade/template/lint`: values.schema.json (types, enums, required
keys, unknown keys) and `fail` in the templates for what a JSON schema cannot say (cross-field bounds,
unique pool names, a GPU with no node label to place it by). Each fixture is one mistake.
"""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.chart.chartkit import CHART_DIR, FIXTURES_DIR, NAMESPACE, example_files, load_values, render

SCHEMA_REJECTS = [
    pytest.param("bad-no-pools.yaml", "at '/pools': minItems: got 0, want 1", id="no pools → at least one"),
    pytest.param(
        "bad-unknown-role.yaml",
        "at '/pools/0/role': value must be one of 'prefill', 'decode', 'mixed'",
        id="unknown role → the three roles are listed",
    ),
    pytest.param(
        "bad-missing-model.yaml",
        "at '/pools/0': missing property 'model'",
        id="pool without a model → missing property 'model'",
    ),
    pytest.param(
        "bad-negative-replicas.yaml",
        "at '/pools/0/replicas': minimum: got -1, want 0",
        id="replicas < 0 → minimum 0",
    ),
    pytest.param(
        "bad-typo-in-pool.yaml",
        "additional properties 'tensorParallel' not allowed",
        id="misspelt pool key → named as not allowed",
    ),
    pytest.param(
        "bad-pool-name.yaml",
        "at '/pools/0/name': 'H100_Prefill' does not match pattern",
        id="pool name not a DNS label → pattern",
    ),
    pytest.param(
        "bad-gpu-memory-utilization.yaml",
        "at '/pools/0/gpuMemoryUtilization': maximum: got 90, want 1",
        id="utilisation as a percentage → maximum 1",
    ),
    pytest.param("bad-zero-tp.yaml", "at '/pools/0/tp': minimum: got 0, want 1", id="tp 0 → minimum 1"),
    pytest.param(
        "bad-top-level-typo.yaml",
        "additional properties 'gatway' not allowed",
        id="misspelt top-level key → named",
    ),
    pytest.param(
        "bad-config-owned-by-chart.yaml",
        "at '/config': additional properties 'pools' not allowed",
        id="config.pools → refused, the chart writes pools",
    ),
]

TEMPLATE_REJECTS = [
    pytest.param(
        "bad-min-above-max.yaml",
        "pools[0] (a100): minReplicas 3 is above maxReplicas 2",
        id="minReplicas above maxReplicas",
    ),
    pytest.param(
        "bad-replicas-outside-bounds.yaml",
        "pools[0] (a100): replicas 5 is outside [minReplicas 1, maxReplicas 4]",
        id="replicas above maxReplicas",
    ),
    pytest.param(
        "bad-duplicate-pool.yaml", 'pools[1]: pool name "a100" is used twice', id="two pools with one name"
    ),
    pytest.param(
        "bad-reserved-pool-name.yaml",
        'pools[0]: pool name "gateway" is reserved',
        id="pool named like a chart component",
    ),
    pytest.param(
        "bad-gpu-without-product-label.yaml",
        'no GPU product label values for gpu "B200"; set pools[0].gpuProducts or vllm.gpuProducts.B200',
        id="GPU with no node label to place it by",
    ),
]


@pytest.mark.parametrize(("fixture", "message"), SCHEMA_REJECTS)
def test_schema_rejects_bad_values_with_a_clear_message(
    chart: helm.Chart, fixture: str, message: str
) -> None:
    values = load_values(FIXTURES_DIR / fixture)
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    assert message in str(caught.value)
    with pytest.raises(helm.HelmValuesError):  # and an install/template never gets to render
        render(chart, values)


@pytest.mark.parametrize(("fixture", "message"), TEMPLATE_REJECTS)
def test_templates_fail_on_inconsistent_values_with_a_clear_message(
    chart: helm.Chart, fixture: str, message: str
) -> None:
    values = load_values(FIXTURES_DIR / fixture)
    chart.validate_schema(values)  # each value is fine alone …
    with pytest.raises(helm.HelmRenderError) as caught:  # … the combination is not
        render(chart, values)
    assert message in str(caught.value)


def test_lint_reports_schema_errors_as_errors() -> None:
    report = helm.lint(CHART_DIR, load_values(FIXTURES_DIR / "bad-unknown-role.yaml"), namespace=NAMESPACE)
    assert any("value must be one of 'prefill', 'decode', 'mixed'" in e for e in report["errors"])


def test_defaults_and_examples_satisfy_the_schema(chart: helm.Chart) -> None:
    chart.validate_schema({})
    chart.validate_schema(chart.values)
    for path in example_files():
        chart.validate_schema(load_values(path))


def test_a_pool_may_name_its_own_gpu_products(chart: helm.Chart) -> None:
    """The escape hatch the B200 error message points to."""
    values = load_values(FIXTURES_DIR / "bad-gpu-without-product-label.yaml")
    values["pools"][0]["gpuProducts"] = ["NVIDIA-B200"]
    values["catalog"] = {
        "gpus": {"B200": {"memory_gb": 192, "hbm_gbps": 8000, "tflops": 2250, "cost_per_hour": 6.5}}
    }
    rendered = render(chart, values)
    affinity = rendered.pool_deployments()[0]["spec"]["template"]["spec"]["affinity"]
    term = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0]["values"] == ["NVIDIA-B200"]


def _key_paths(values: dict[str, object], prefix: str = "", depth: int = 2) -> list[str]:
    paths = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths.append(path)
        if isinstance(value, dict) and value and depth > 1 and key not in {"gpuProducts", "resources"}:
            paths += _key_paths(value, f"{path}.", depth - 1)
    return paths


def test_every_value_is_documented_in_the_reference_table(chart: helm.Chart) -> None:
    doc = (CHART_DIR.parents[1] / "docs" / "deploy.md").read_text()
    pool_keys = chart.schema["definitions"]["poolFields"]["properties"]  # type: ignore[index]
    # poolDefaults.<k> is documented as pools[].<k> (the same keys, merged under each pool).
    missing = [
        p
        for p in _key_paths(chart.values)
        if p != "pools" and not p.startswith("poolDefaults.") and f"`{p}" not in doc
    ]
    missing += [f"pools[].{k}" for k in pool_keys if f"`pools[].{k}`" not in doc]
    assert not missing, f"add to docs/deploy.md's values table: {missing}"
