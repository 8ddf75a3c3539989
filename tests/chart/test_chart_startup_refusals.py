"""Values the gateway or the controller refuses at start fail the render instead (each test failed before): a
`helm install` that renders them leaves every gateway (or the controller) in CrashLoopBackOff with a one-line
config error. For each rule, the chart's refusal names the values path, and the values just inside the rule
render a config the loader accepts. Where the rule is a bound, the schema's bound is checked against the
loader's own, value by value, so the two stay in step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from placement.catalog import load_catalog
from scheduler.autoscaler.policy import AutoscalerConfig as PolicyConfig
from scheduler.kv.config import KvConfig
from scheduler.topology import Inventory
from server.autoscale_placement import check_domains
from server.config import ConfigError, LimitsConfig, validate_config
from tests.chart.chartkit import render
from tests.chart.test_chart_values_properties import check

POOL = {"name": "p", "model": "llama-3-8b", "gpu": "L4", "minReplicas": 1, "maxReplicas": 4, "replicas": 1}


def _refusal(chart: helm.Chart, values: dict[str, Any]) -> str:
    """The one-line message `helm template` refuses `values` with: the schema's or a template's `fail`."""
    with pytest.raises(helm.HelmError) as caught:
        render(chart, values)
    message = str(caught.value)
    assert isinstance(caught.value, helm.HelmValuesError) or "execution error at" in message, message
    return message


def _loads(chart: helm.Chart, values: dict[str, Any], tmp_path: Path) -> Any:
    """The rendered config, loaded as the gateway does at start (a ConfigError fails the test)."""
    return render(chart, values).load_config(tmp_path)


def _gateway_accepts(config: dict[str, Any]) -> bool:
    """The gateway's loader on `config` plus one pool (as the chart writes it, but found statically)."""
    pool = {
        "name": "p",
        "model": "llama-3-8b",
        "gpu": "L4",
        "min_replicas": 1,
        "max_replicas": 4,
        "endpoints": {"static": ["http://w:8000"]},
    }
    try:
        validate_config({"pools": [pool], **config})
    except ConfigError:
        return False
    return True


# ---- 1. kv.lease_s at or below the longest request timeout ----


@pytest.mark.parametrize(
    ("config", "lease", "longest"),
    [
        pytest.param({"kv": {"lease_s": 600}}, 600, 600, id="lease at the default total_timeout_s"),
        pytest.param({"kv": {"lease_s": 30}}, 30, 600, id="lease below it"),
        pytest.param(
            {"limits": {"total_timeout_s": 1200}}, 900, 1200, id="default lease under a longer total"
        ),
        pytest.param(
            {"kv": {"lease_s": 700}, "limits": {"total_timeout_s": 100, "stall_timeout_s": 700}},
            700,
            700,
            id="lease at stall_timeout_s",
        ),
        pytest.param(
            {"kv": {"lease_s": 90}, "limits": {"total_timeout_s": 50, "first_token_timeout_s": 120}},
            90,
            120,
            id="lease under first_token_timeout_s",
        ),
    ],
)
def test_a_kv_lease_the_longest_request_outlasts_is_refused(
    chart: helm.Chart, config: dict[str, Any], lease: float, longest: float
) -> None:
    """server/config.py `_check_kv`: the lease must exceed max(total_timeout_s, first_token_timeout_s,
    stall_timeout_s), or the ledger frees a live request's pages; the gateway refuses it at start."""
    message = _refusal(chart, {"pools": [POOL], "config": config})
    assert f"config.kv.lease_s {lease} must exceed" in message
    assert f"= {longest} s" in message
    assert not _gateway_accepts(config)


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({"kv": {"lease_s": 600.5}}, id="just above the default total"),
        pytest.param(
            {"kv": {"lease_s": 1201}, "limits": {"total_timeout_s": 1200}}, id="above a longer total"
        ),
        pytest.param({"kv": {"lease_s": 30, "enabled": False}}, id="no ledger, no lease"),
        pytest.param({"kv": {"lease_s": 61}, "limits": {"total_timeout_s": 60}}, id="shorter timeouts"),
    ],
)
def test_a_kv_lease_above_every_timeout_renders_and_loads(
    chart: helm.Chart, config: dict[str, Any], tmp_path: Path
) -> None:
    assert _gateway_accepts(config)
    _loads(chart, {"pools": [POOL], "config": config}, tmp_path)


def test_the_lease_rule_takes_the_loaders_defaults(chart: helm.Chart, tmp_path: Path) -> None:
    """The template copies the loader's defaults for the keys left out (lease_s, the three timeouts)."""
    lease = KvConfig().lease_s
    limits = LimitsConfig()
    longest = max(limits.total_timeout_s, limits.first_token_timeout_s, limits.stall_timeout_s)
    for config, refused in [
        ({"limits": {"total_timeout_s": lease}}, True),
        ({"limits": {"total_timeout_s": lease - 0.5}}, False),
        ({"kv": {"lease_s": longest}}, True),
        ({"kv": {"lease_s": longest + 0.5}}, False),
    ]:
        assert _gateway_accepts(config) is not refused
        if refused:
            assert "config.kv.lease_s" in _refusal(chart, {"pools": [POOL], "config": config})
        else:
            _loads(chart, {"pools": [POOL], "config": config}, tmp_path)


# ---- 2. autoscaler backlog_lead_s without cold_start_s ----


@pytest.mark.parametrize(
    ("autoscaler", "path"),
    [
        pytest.param({"backlog_lead_s": 30}, "config.autoscaler.backlog_lead_s", id="flat"),
        pytest.param({"knobs": {"backlog_lead_s": 30}}, "config.autoscaler.knobs.backlog_lead_s", id="knobs"),
        pytest.param(
            {"backlog_lead_s": 30, "cold_start_s": 0, "enabled": True},
            "config.autoscaler.backlog_lead_s",
            id="zero",
        ),
    ],
)
def test_a_backlog_lead_without_a_cold_start_is_refused(
    chart: helm.Chart, autoscaler: dict[str, Any], path: str
) -> None:
    """server/config.py `AutoscalerConfig._lead_needs_cold_start`: without cold_start_s there are no ready
    estimates for starting instances, and the gateway and the controller refuse the config at start."""
    message = _refusal(chart, {"pools": [POOL], "config": {"autoscaler": autoscaler}})
    assert path in message and "needs config.autoscaler.cold_start_s" in message
    assert not _gateway_accepts({"autoscaler": autoscaler})


@pytest.mark.parametrize(
    "autoscaler",
    [
        pytest.param({"backlog_lead_s": 30, "cold_start_s": 120}, id="with a cold start"),
        pytest.param({"knobs": {"backlog_lead_s": 30}, "cold_start_s": 0.5}, id="knobs, with a cold start"),
        pytest.param({"backlog_lead_s": 0}, id="lead off"),
        pytest.param(
            {"backlog_lead_s": 30, "knobs": {"backlog_lead_s": 30}, "cold_start_s": 60}, id="twice, once"
        ),
    ],
)
def test_a_backlog_lead_with_a_cold_start_renders_and_loads(
    chart: helm.Chart, autoscaler: dict[str, Any], tmp_path: Path
) -> None:
    assert _gateway_accepts({"autoscaler": autoscaler})
    _loads(chart, {"pools": [POOL], "config": {"autoscaler": autoscaler}}, tmp_path)


@pytest.mark.parametrize(
    "autoscaler",
    [
        pytest.param({"backlog_lead_s": 0, "knobs": {"backlog_lead_s": 5}}, id="lead on in knobs"),
        pytest.param({"backlog_lead_s": 30, "knobs": {"backlog_lead_s": 0}}, id="lead off in knobs"),
        pytest.param({"utilization_target": 0.6, "knobs": {"utilization_target": 0.5}}, id="target"),
    ],
)
def test_a_knob_set_twice_with_two_values_is_refused(chart: helm.Chart, autoscaler: dict[str, Any]) -> None:
    """The loader refuses it (which one wins would be a guess; `knobs` used to, silently)."""
    message = _refusal(chart, {"pools": [POOL], "config": {"autoscaler": autoscaler}})
    knob = next(iter(autoscaler["knobs"]))
    assert f"config.autoscaler.{knob} is set both under autoscaler (" in message
    assert not _gateway_accepts({"autoscaler": autoscaler})


# ---- 3. autoscaler policy knobs out of range ----

KNOBS = [
    f.name for f in dataclasses.fields(PolicyConfig) if f.name not in ("prefill_mode", "observed_context")
]
PROBES = [-1, -0.001, 0, 0.001, 0.5, 0.999, 1, 1.001, 1.5, 4, 1000]


def _policy_accepts(knob: str, value: float) -> bool:
    try:
        PolicyConfig(**{knob: int(value) if knob == "max_scale_up_step" else value})
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("knob", KNOBS)
@pytest.mark.parametrize("where", ["flat", "knobs"])
def test_the_schema_bounds_each_knob_as_the_policy_does(chart: helm.Chart, knob: str, where: str) -> None:
    """scheduler/autoscaler/policy.py `AutoscalerConfig.__post_init__`: each knob's range (utilization_target
    in (0, 1], boosts ≥ 1, …). A value the policy refuses fails the install at the knob's path; one it
    takes passes the schema."""
    for value in PROBES:
        if knob == "max_scale_up_step" and value != int(value):
            continue
        autoscaler = {knob: value} if where == "flat" else {"knobs": {knob: value}}
        values = {"config": {"autoscaler": autoscaler}}
        path = f"/config/autoscaler/{knob}" if where == "flat" else f"/config/autoscaler/knobs/{knob}"
        if _policy_accepts(knob, value):
            chart.validate_schema(values)
        else:
            with pytest.raises(helm.HelmValuesError) as caught:
                chart.validate_schema(values)
            assert f"at '{path}'" in str(caught.value), (knob, value)


@pytest.mark.parametrize(
    ("autoscaler", "path"),
    [
        pytest.param({"utilization_target": 1.5}, "/config/autoscaler/utilization_target", id="utilization over 1"),
        pytest.param({"knobs": {"smoothing": 0}}, "/config/autoscaler/knobs/smoothing", id="smoothing 0"),
        pytest.param({"max_scale_up_factor": 0.5}, "/config/autoscaler/max_scale_up_factor", id="scale-up factor below 1"),
        pytest.param({"knobs": {"severe_boost": 0.9}}, "/config/autoscaler/knobs/severe_boost", id="boost below 1"),
        pytest.param({"queue_drain_s": 0}, "/config/autoscaler/queue_drain_s", id="queue_drain_s 0"),
        pytest.param({"knobs": {"ttft_slo_s": 0}}, "/config/autoscaler/knobs/ttft_slo_s", id="TTFT SLO 0"),
        pytest.param({"max_scale_down_fraction": 0}, "/config/autoscaler/max_scale_down_fraction", id="scale-down fraction 0"),
    ],
)  # fmt: skip
def test_a_knob_out_of_range_is_refused(chart: helm.Chart, autoscaler: dict[str, Any], path: str) -> None:
    assert f"at '{path}'" in _refusal(chart, {"pools": [POOL], "config": {"autoscaler": autoscaler}})
    assert not _gateway_accepts({"autoscaler": autoscaler})


def test_knobs_at_their_bounds_render_and_load(chart: helm.Chart, tmp_path: Path) -> None:
    knobs = {
        "utilization_target": 1,
        "smoothing": 1,
        "trend_smoothing": 0.01,
        "max_scale_down_fraction": 1,
        "max_scale_up_factor": 1,
        "max_scale_up_step": 1,
        "moderate_boost": 1,
        "tolerance": 0,
        "pd_ratio": 0,
        "queue_drain_s": 0.1,
        "ttft_slo_s": None,
    }
    loaded = _loads(chart, {"pools": [POOL], "config": {"autoscaler": {"knobs": knobs}}}, tmp_path)
    assert loaded.autoscaler.knobs == knobs


# ---- 4. autoscaler.policy: the gateway's names and parameters only ----

REFUSED_POLICIES = [
    "random", "Mosaic", "fixed", "mosaic:", "hpa", "mosaic:1", "hpa-util:1.5", "hpa-util:0", "hpa-util:x", "hpa-waiting:-1",
    "hpa-waiting:0", "dynamo:nan", "dynamo:inf", "dynamo:1e999", "static:q=1", "static:p=5", "static:p=-1",
    "static:p", "static:p=1.5", " mosaic", "mosaic ", "hpa-util:0.5:1", "static:p=1,p=2",
]  # fmt: skip
ACCEPTED_POLICIES = [
    "mosaic", "hpa-util", "hpa-util:", "hpa-util:1", "hpa-util:0.05", "hpa-util:5e-1", "hpa-waiting:4",
    "hpa-waiting:.5", "hpa-waiting:+2", "dynamo:180", "dynamo:1.", "static", "static:", "static:p=1",
    "static:p=4", "static:p=2,", "static:,p=3", "static:p= 2 ",
]  # fmt: skip


@pytest.mark.parametrize("policy", REFUSED_POLICIES)
def test_a_policy_the_gateway_refuses_is_refused(chart: helm.Chart, policy: str) -> None:
    """server/config.py `AutoscalerConfig._policy_name` (scheduler/autoscaler/factory.py POLICY_NAMES, less
    `fixed`) and `_check_autoscaler`'s `build_policy(..., check_bounds=True)`: parameters are numbers > 0
    (hpa-util's ≤ 1), `static:` counts name pools and lie within their min/maxReplicas. Any string passed
    the schema before, and the gateway refused it at start whether or not the autoscaler was enabled."""
    assert not _gateway_accepts({"autoscaler": {"policy": policy}})
    message = _refusal(chart, {"pools": [POOL], "config": {"autoscaler": {"policy": policy}}})
    assert "/config/autoscaler/policy" in message or "config.autoscaler.policy" in message


@pytest.mark.parametrize("policy", ACCEPTED_POLICIES)
def test_a_policy_the_gateway_takes_renders_and_loads(chart: helm.Chart, policy: str, tmp_path: Path) -> None:
    assert _gateway_accepts({"autoscaler": {"policy": policy}})
    loaded = _loads(chart, {"pools": [POOL], "config": {"autoscaler": {"policy": policy}}}, tmp_path)
    assert loaded.autoscaler.policy == policy


def test_static_counts_are_checked_against_the_pools_own_bounds(chart: helm.Chart, tmp_path: Path) -> None:
    """…as the pools resolve over poolDefaults."""
    values = {"pools": [{**POOL, "maxReplicas": 8}], "config": {"autoscaler": {"policy": "static:p=6"}}}
    _loads(chart, values, tmp_path)
    values["poolDefaults"] = {"minReplicas": 0}
    values["pools"] = [{"name": "p", "model": "llama-3-8b", "gpu": "L4", "replicas": 0, "maxReplicas": 2}]
    message = _refusal(chart, values)
    assert (
        "config.autoscaler.policy" in message
        and "outside pool p's minReplicas..maxReplicas (0..2)" in message
    )


@pytest.mark.parametrize(
    "pools",
    [
        pytest.param([{**POOL, "role": "prefill"}], id="one model, prefill only"),
        pytest.param(
            [POOL, {"name": "q", "model": "qwen2.5-7b", "gpu": "L4", "role": "prefill"}],
            id="a second model with a prefill pool only",
        ),
    ],
)
def test_a_model_with_prefill_pools_only_is_refused(chart: helm.Chart, pools: list[dict[str, Any]]) -> None:
    """server/config.py `MosaicConfig._cross_checks` (`scheduler.fleet.prefill_only_models`): nothing would
    finish its requests, and every gateway pod would exit at start."""
    message = _refusal(chart, {"pools": pools})
    model = pools[-1]["model"]
    assert f'pools: model "{model}" has only prefill pools ({pools[-1]["name"]})' in message


# ---- 5. duplicate config.models[].name ----


def test_a_model_listed_twice_is_refused(chart: helm.Chart) -> None:
    """server/config.py `MosaicConfig._cross_checks` (`_unique`): `models.1.name: duplicate model name`."""
    models = [{"name": "llama-3-8b"}, {"name": "qwen2.5-7b"}, {"name": "llama-3-8b", "spec": "llama-3-8b"}]
    message = _refusal(chart, {"pools": [POOL], "config": {"models": models}})
    assert 'config.models[2]: name "llama-3-8b" is config.models[0]\'s too' in message
    assert not _gateway_accepts({"models": models})


# ---- 6. autoscaler.nodes against the pools' network domains ----

ZONES = {"gateway": {"discovery": {"domainLabel": "topology.kubernetes.io/zone"}}}


def _nodes(*rows: tuple[str, str]) -> dict[str, Any]:
    return {
        "nodes": [{"name": f"n{i}", "gpu": gpu, "gpus": 8, "domain": d} for i, (gpu, d) in enumerate(rows)]
    }


@pytest.mark.parametrize(
    ("domains", "nodes", "message"),
    [
        pytest.param(
            ["a", "b"],
            _nodes(("L4", "a")),
            'pools[0] (p): domain "b" is not in config.autoscaler.nodes (domains: a)',
            id="a pool domain the inventory lacks",
        ),
        pytest.param(
            ["a"],
            _nodes(("L4", "a"), ("l4", "c"), ("H100", "d")),
            "config.autoscaler.nodes has L4 nodes in c, where pool p (pools[0]) has no Deployment",
            id="an inventory domain with the pool's GPU outside its domains",
        ),
        pytest.param(
            ["a"],
            {"nodes": [{"name": "n0", "gpu": "L4", "gpus": 8, "domain": "a"}, {"name": "n1", "gpu": "L4", "gpus": 8}]},
            "config.autoscaler.nodes has L4 nodes in default, where pool p (pools[0]) has no Deployment",
            id="a node without a domain is in 'default'",
        ),
    ],
)  # fmt: skip
def test_a_node_inventory_that_misses_the_pools_domains_is_refused(
    chart: helm.Chart, domains: list[str], nodes: dict[str, Any], message: str
) -> None:
    """server/autoscale_placement.py `check_domains` (`mosaic autoscale`, the controller, at start): each
    pool with `domains` is `autoscaler.kubernetes.domains`, whose domains must be in the inventory, and every
    inventory domain with the pool's GPU (in catalog spelling) needs one of its Deployments."""
    values = {**ZONES, "pools": [{**POOL, "domains": domains}], "config": {"autoscaler": {"nodes": nodes}}}
    assert message in _refusal(chart, values)
    inventory = Inventory.from_data(nodes).in_catalog_names(load_catalog())
    with pytest.raises(ConfigError):  # as the controller would have, with the domains the chart writes
        check_domains({"p": {d: f"mosaic-p-{d}" for d in domains}}, inventory, {"p": "L4"})


@pytest.mark.parametrize(
    "nodes",
    [
        pytest.param(_nodes(("L4", "a"), ("L4", "b")), id="the pool's domains"),
        pytest.param(_nodes(("l4", "a"), ("L4", "b"), ("H100", "c")), id="another GPU elsewhere"),
        pytest.param(None, id="no inventory"),
    ],
)
def test_a_node_inventory_over_the_pools_domains_renders_and_starts_the_controller(
    chart: helm.Chart, nodes: dict[str, Any] | None, tmp_path: Path
) -> None:
    values = {**ZONES, "pools": [{**POOL, "domains": ["a", "b"]}], "config": {"autoscaler": {"nodes": nodes}}}
    check(chart, values)  # builds the controller as `mosaic autoscale` does (check_domains included)
    _loads(chart, values, tmp_path)


def test_the_inventory_is_not_checked_without_the_controller(chart: helm.Chart, tmp_path: Path) -> None:
    """Without the controller the chart writes no autoscaler.kubernetes.domains, and nothing checks them."""
    values = {
        **ZONES,
        "controller": {"enabled": False},
        "pools": [{**POOL, "domains": ["a", "b"]}],
        "config": {"autoscaler": {"nodes": _nodes(("L4", "a"))}},
    }
    _loads(chart, values, tmp_path)


# ---- 7. kv keys with a fixed set or an open bound ----


@pytest.mark.parametrize(
    ("kv", "path"),
    [
        pytest.param({"watermark": 0}, "/config/kv/watermark", id="watermark 0 (KvConfig: must be > 0)"),
        pytest.param({"data_parallel": "per_rank"}, "/config/kv/data_parallel", id="unknown DP booking"),
    ],
)
def test_kv_values_the_gateway_refuses_are_refused(chart: helm.Chart, kv: dict[str, Any], path: str) -> None:
    assert not _gateway_accepts({"kv": kv})
    assert path in _refusal(chart, {"pools": [POOL], "config": {"kv": kv}})


def test_kv_values_just_inside_render_and_load(chart: helm.Chart, tmp_path: Path) -> None:
    kv = {"watermark": 0.001, "data_parallel": "pooled"}
    assert _gateway_accepts({"kv": kv})
    loaded = _loads(chart, {"pools": [POOL], "config": {"kv": kv}}, tmp_path)
    assert (loaded.kv.watermark, loaded.kv.data_parallel) == (0.001, "pooled")
