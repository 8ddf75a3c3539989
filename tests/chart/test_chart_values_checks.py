"""Values that would pass `helm install` and then crash pods or fail mid-install are refused up front:

- sizes that are not Kubernetes quantities (`16GB`), which the API server refuses halfway through an install;
- a PodDisruptionBudget of `maxUnavailable: 0`, which blocks every node drain forever;
- misspelt keys in the gateway config's sections, which the gateway (server/config.py, extra="forbid")
  refuses at start: a crash loop after a "successful" install. The schema's keys and types are kept equal
  to the loader's models here;
- a pool model that is not in Mosaic's catalog (nor mapped to one by `config.models[].spec`), which the
  gateway and controller refuse at start (server/config.py's check_catalog).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from pydantic import BaseModel

from placement.catalog import _GPU_ALIASES, _MODEL_ALIASES, load_catalog
from scheduler.autoscaler.policy import AutoscalerConfig as PolicyConfig
from scheduler.kv.config import KvConfig
from scheduler.routing.config import RoutingConfig
from server.config import (
    AutoscalerConfig,
    CorsConfig,
    HealthConfig,
    LimitsConfig,
    ModelConfig,
    RateLimitConfig,
    ReadinessConfig,
    ScrapeConfig,
    SloConfig,
    validate_config,
)
from tests.chart.chartkit import CHART_DIR, render

POOL = {"name": "p", "model": "llama-3-8b", "gpu": "L4"}


def _refused(chart: helm.Chart, values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.validate_schema(values)
    return str(caught.value)


# ---- Kubernetes quantities ----

QUANTITY_PLACES = [
    pytest.param(lambda q: {"vllm": {"shmSize": q}}, id="vllm.shmSize"),
    pytest.param(lambda q: {"vllm": {"modelCache": {"sizeLimit": q}}}, id="vllm.modelCache.sizeLimit"),
    pytest.param(
        lambda q: {"poolDefaults": {"resources": {"limits": {"memory": q}}}}, id="poolDefaults limits"
    ),
    pytest.param(
        lambda q: {"pools": [{**POOL, "resources": {"requests": {"cpu": q}}}]}, id="a pool's requests"
    ),
    pytest.param(lambda q: {"gateway": {"resources": {"requests": {"memory": q}}}}, id="gateway requests"),
    pytest.param(lambda q: {"controller": {"resources": {"limits": {"memory": q}}}}, id="controller limits"),
    pytest.param(lambda q: {"simulator": {"resources": {"requests": {"cpu": q}}}}, id="simulator requests"),
]


@pytest.mark.parametrize("place", QUANTITY_PLACES)
@pytest.mark.parametrize("bad", ["16GB", "16 Gi", "16gi", "lots", "-1Gi", -1])
def test_sizes_that_are_not_kubernetes_quantities_are_refused(
    chart: helm.Chart, place: Any, bad: Any
) -> None:
    """Before: `shmSize: 16GB` passed the schema, and the API server refused the Deployment mid-install."""
    message = _refused(chart, place(bad))
    assert "does not match pattern" in message or "minimum" in message


@pytest.mark.parametrize("place", QUANTITY_PLACES)
@pytest.mark.parametrize("good", ["16Gi", "100G", "500m", "4", "1.5", "1e3", "+2Ki", 4, 0.5])
def test_kubernetes_quantities_are_accepted(chart: helm.Chart, place: Any, good: Any) -> None:
    chart.validate_schema(place(good))


# ---- requests above limits ----

REAL_POOL = {**POOL, "gpu": "H100", "model": "meta-llama/Meta-Llama-3-8B-Instruct"}
RESOURCE_PLACES = [
    pytest.param(lambda r: {"pools": [{**REAL_POOL, "resources": r}]}, "pools[0] (p)", id="a pool over poolDefaults"),
    pytest.param(lambda r: {"poolDefaults": {"resources": r}, "pools": [REAL_POOL]}, "pools[0] (p)", id="poolDefaults"),
    pytest.param(lambda r: {"gateway": {"resources": r}}, "gateway", id="gateway"),
    pytest.param(lambda r: {"controller": {"resources": r}}, "controller", id="controller"),
    pytest.param(lambda r: {"simulator": {"resources": r}, "simulated": True}, "simulator", id="simulator"),
]  # fmt: skip


@pytest.mark.parametrize(("place", "where"), RESOURCE_PLACES)
@pytest.mark.parametrize(
    ("key", "request_", "limit"),
    [
        ("memory", "128Gi", "64Gi"),
        ("memory", "65G", "60Gi"),  # 65e9 > 64.4e9
        ("memory", "2e9", "1Gi"),
        ("cpu", "1.5", "1"),
        ("cpu", "1001m", "1"),
        ("cpu", 2, "1500m"),
    ],
)
def test_a_request_above_its_limit_is_refused_at_render(
    chart: helm.Chart, place: Any, where: str, key: str, request_: Any, limit: Any
) -> None:
    """Before: a pool's `resources: {requests: {memory: 128Gi}}` was merged over poolDefaults' 64Gi limit, and
    the API server refused the Deployment halfway through `helm install`."""
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, place({"requests": {key: request_}, "limits": {key: limit}}))
    message = str(caught.value)
    assert f"{where}: resources.requests.{key} {request_} is above resources.limits.{key} {limit}" in message


@pytest.mark.parametrize(("place", "where"), RESOURCE_PLACES)
@pytest.mark.parametrize(
    ("request_", "limit"), [("64Gi", "64Gi"), ("60G", "60Gi"), ("1000m", "1"), ("1e9", "1Gi")]
)
def test_a_request_at_or_below_its_limit_renders(
    chart: helm.Chart, place: Any, where: str, request_: Any, limit: Any
) -> None:
    render(chart, place({"requests": {"memory": request_}, "limits": {"memory": limit}}))


# ---- PodDisruptionBudgets that block drains ----

PDB_PLACES = [
    pytest.param(lambda v: {"gateway": {"pdb": {"maxUnavailable": v}}}, "/gateway/pdb/maxUnavailable", id="gateway"),
    pytest.param(lambda v: {"pools": [{**POOL, "pdb": {"maxUnavailable": v}}]}, "/pools/0/pdb/maxUnavailable", id="pool"),
    pytest.param(lambda v: {"poolDefaults": {"pdb": {"maxUnavailable": v}}}, "/poolDefaults/pdb/maxUnavailable", id="poolDefaults"),
]  # fmt: skip


@pytest.mark.parametrize(("place", "where"), PDB_PLACES)
@pytest.mark.parametrize("bad", [0, "0%", "101%", "1.5%", "half"])
def test_a_budget_that_blocks_every_drain_is_refused(
    chart: helm.Chart, place: Any, where: str, bad: Any
) -> None:
    """Before: `maxUnavailable: 0` rendered a budget no eviction could satisfy: node drains hung forever."""
    assert f"at '{where}'" in _refused(chart, place(bad))


@pytest.mark.parametrize(("place", "where"), PDB_PLACES)
@pytest.mark.parametrize("good", [1, 3, "1%", "50%", "100%"])
def test_a_budget_that_lets_drains_through_is_accepted(
    chart: helm.Chart, place: Any, where: str, good: Any
) -> None:
    chart.validate_schema(place(good))


# ---- the gateway config's sections ----

# config.<section> → the loader's model of it (server/config.py and the models it nests)
SECTIONS: dict[str, type[BaseModel]] = {
    "routing": RoutingConfig,
    "slo": SloConfig,
    "limits": LimitsConfig,
    "scrape": ScrapeConfig,
    "health": HealthConfig,
    "readiness": ReadinessConfig,
    "kv": KvConfig,
    "autoscaler": AutoscalerConfig,
    "cors": CorsConfig,
}
KNOBS = [f.name for f in dataclasses.fields(PolicyConfig)]


def _section_schema(chart: helm.Chart, path: str) -> dict[str, Any]:
    node: Any = chart.schema["properties"]["config"]  # type: ignore[index]
    for part in path.split("."):
        node = node["properties"][part] if part != "[]" else node["items"]
    return _deref(chart, node)


def _deref(chart: helm.Chart, node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = chart.schema
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _json_types(prop: dict[str, Any]) -> set[str]:
    """The JSON types a pydantic JSON-schema property allows (a nested model counts as an object)."""
    if "anyOf" in prop:
        return set().union(*(_json_types(p) for p in prop["anyOf"]))
    if "$ref" in prop:
        return {"object"}
    return {prop["type"]}


def _schema_types(node: dict[str, Any]) -> set[str]:
    if "type" in node:
        return {node["type"]} if isinstance(node["type"], str) else set(node["type"])
    return {"string"} if all(isinstance(v, str) for v in node["enum"]) else set()


@pytest.mark.parametrize(
    ("path", "model"),
    [*SECTIONS.items(), ("limits.rate_limit", RateLimitConfig), ("models.[]", ModelConfig)],
)
def test_each_config_section_declares_exactly_the_loaders_keys_and_types(
    chart: helm.Chart, path: str, model: type[BaseModel]
) -> None:
    """Before: each section was a bare `object`: `limits: {queue_sise: 5}` installed, then the gateway and the
    controller refused the config at start (extra="forbid") and crash-looped."""
    node = _section_schema(chart, path)
    assert node["additionalProperties"] is False
    declared = node["properties"]
    fields = model.model_json_schema()["properties"]
    expected = set(fields) | (set(KNOBS) if model is AutoscalerConfig else set())
    assert set(declared) == expected, f"config.{path}: keep values.schema.json equal to {model.__name__}"
    for name, prop in fields.items():
        assert _schema_types(_deref(chart, declared[name])) == _json_types(prop), f"config.{path}.{name}"


def test_the_autoscaler_knobs_are_the_policys(chart: helm.Chart) -> None:
    knobs = _deref(chart, _section_schema(chart, "autoscaler")["properties"]["knobs"])
    assert list(knobs["properties"]) == KNOBS and knobs["additionalProperties"] is False


@pytest.mark.parametrize("section", [*SECTIONS, "models"])
def test_the_loaders_own_defaults_pass_the_schema(chart: helm.Chart, section: str) -> None:
    """Every default server/config.py writes out (nulls, nested sections) is a value the schema accepts."""
    if section == "models":
        value: Any = [ModelConfig(name="m").model_dump(mode="json")]
    else:
        value = SECTIONS[section]().model_dump(mode="json")
    if section == "autoscaler":
        # but the actuator: the loader's default, embedded, scales simulated pools inside `mosaic serve`, which
        # the chart's pools never are; the schema refuses it and the chart writes kubernetes when none is given
        assert value.pop("actuator") == "embedded"
    chart.validate_schema({"config": {section: value}})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param({"limits": {"queue_sise": 5}}, "at '/config/limits': additional properties 'queue_sise'", id="limits"),
        pytest.param({"limits": {"rate_limit": {"rps": 5}}}, "at '/config/limits/rate_limit': additional properties 'rps'", id="rate_limit"),
        pytest.param({"slo": {"ttft_ms": "fast"}}, "at '/config/slo/ttft_ms': got string, want null or number", id="slo type"),
        pytest.param({"models": [{"name": "m", "specs": "llama-3-8b"}]}, "at '/config/models/0': additional properties 'specs'", id="models"),
        pytest.param({"routing": {"polcy": "mosaic"}}, "at '/config/routing': additional properties 'polcy'", id="routing"),
        pytest.param({"routing": {"policy": "random"}}, "at '/config/routing/policy'", id="routing policy"),
        pytest.param({"autoscaler": {"interval": 5}}, "at '/config/autoscaler': additional properties 'interval'", id="autoscaler"),
        pytest.param({"autoscaler": {"knobs": {"pd_ration": 1}}}, "at '/config/autoscaler/knobs': additional properties 'pd_ration'", id="knob"),
        pytest.param({"kv": {"watermak": 0.1}}, "at '/config/kv': additional properties 'watermak'", id="kv"),
        pytest.param({"readiness": {"require_all_models": "yes"}}, "got string, want boolean", id="readiness"),
        pytest.param({"cors": {"allowed_origin": ["*"]}}, "at '/config/cors': additional properties 'allowed_origin'", id="cors"),
    ],
)  # fmt: skip
def test_a_misspelt_config_key_fails_the_install_not_the_gateway(
    chart: helm.Chart, config: dict[str, Any], message: str
) -> None:
    assert message in _refused(chart, {"config": config})


def test_policy_knobs_may_sit_directly_under_autoscaler(chart: helm.Chart, tmp_path: Path) -> None:
    """server/config.py's AutoscalerConfig moves knob names found under `autoscaler:` into `knobs`."""
    values = {"config": {"autoscaler": {"pd_ratio": 0.4, "knobs": {"utilization_target": 0.7}}}}
    chart.validate_schema(values)
    knobs = render(chart, values).load_config(tmp_path).autoscaler.knobs
    assert knobs == {"pd_ratio": 0.4, "utilization_target": 0.7}


# ---- pool models the catalog does not know ----


def test_the_charts_model_list_is_the_catalogs() -> None:
    """files/catalog-models.yaml is what the templates check pool models and GPUs against: the catalog's rows
    and aliases."""
    listed = yaml.safe_load((CHART_DIR / "files" / "catalog-models.yaml").read_text())
    assert listed == {
        "models": list(load_catalog().models),
        "aliases": dict(_MODEL_ALIASES),
        "gpus": list(load_catalog().gpus),
        "gpuAliases": dict(_GPU_ALIASES),
    }


@pytest.mark.parametrize(
    "model", [*load_catalog().models, *_MODEL_ALIASES, "META-LLAMA/Meta-Llama-3-8B-Instruct", "Llama-3-8B"]
)
def test_every_catalog_model_and_alias_renders_and_loads(
    chart: helm.Chart, model: str, tmp_path: Path
) -> None:
    rendered = render(chart, {"pools": [{**POOL, "model": model, "simulated": True}]})
    assert rendered.load_config(tmp_path).pools[0].model == model


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param(
            {"pools": [{**POOL, "model": "acme/llm-13b"}]},
            'pools[0] (p): model "acme/llm-13b" is not a model of Mosaic\'s catalog (llama-2-7b, llama-2-70b, '
            "llama-3-8b, llama-3-70b, llama-3.1-8b, llama-3.1-70b, mistral-7b, qwen2.5-7b, qwen2.5-32b, their Hugging Face names, or a row "
            'under catalog.models); map it to one with config.models: [{name: "acme/llm-13b", spec: <catalog model>}]',
            id="an unknown model",
        ),
        pytest.param(
            {"pools": [{**POOL, "model": "acme/llm-13b"}], "config": {"models": [{"name": "acme/llm-13b", "spec": "llm-13b"}]}},
            'pools[0] (p): config.models entry "acme/llm-13b" has spec "llm-13b", which is not a model of Mosaic\'s catalog',
            id="mapped to an unknown catalog row",
        ),
        pytest.param(
            {"pools": [POOL], "config": {"models": [{"name": "other", "spec": "qwen2.5-7b"}]}},
            'pools[0] (p): model "llama-3-8b" is not listed under config.models (other)',
            id="config.models without the pool's model",
        ),
    ],
)  # fmt: skip
def test_a_model_the_gateway_would_refuse_fails_the_render(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    """Before: these installed, then the gateway and controller exited at start (check_catalog) and crash-looped."""
    chart.validate_schema(values)
    with pytest.raises(helm.HelmRenderError) as caught:
        render(chart, values)
    assert message in str(caught.value)
    # … as the gateway's loader says, given the config the chart would have written
    config = {
        "pools": [{**POOL, "model": values["pools"][0]["model"], "endpoints": {"static": ["http://x"]}}]
    }
    with pytest.raises(ValueError, match="model"):
        validate_config({**config, **values.get("config", {})})


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(
            {"config": {"models": [{"name": "acme/llm-13b", "spec": "Llama-3-8B"}]}},
            id="mapped by config.models",
        ),
        pytest.param(
            {
                "catalog": {
                    "models": {
                        "acme/llm-13b": {
                            "layers": 40,
                            "hidden_size": 5120,
                            "num_heads": 40,
                            "num_kv_heads": 40,
                            "head_dim": 128,
                            "params_b": 13.0,
                            "max_context": 4096,
                        }
                    }
                }
            },
            id="a catalog row of its own",
        ),
    ],
)
def test_a_model_outside_the_builtin_catalog_renders_when_the_config_resolves_it(
    chart: helm.Chart, values: dict[str, Any], tmp_path: Path
) -> None:
    rendered = render(chart, {**values, "pools": [{**POOL, "model": "acme/llm-13b"}]})
    assert rendered.load_config(tmp_path).pools[0].model == "acme/llm-13b"
