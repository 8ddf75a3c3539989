"""Routing config: policies build, weights merge, and every bad config names the plugin and the field."""

from __future__ import annotations

import math
import random

import pytest
import yaml

from scheduler.routing.config import RoutingConfig, RoutingConfigError, build_router, parse_routing_config
from scheduler.routing.framework import Decision
from tests.scheduler.routing.builders import req, view, worker


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            {"policy": "fastest"},
            "routing.policy: Input should be 'round-robin', 'least-loaded' or 'mosaic'",
            id="unknown policy",
        ),
        pytest.param(
            {"plugins": [{"type": "magic"}]},
            "routing.plugins[0] (magic).type: unknown plugin type 'magic'",
            id="unknown plugin type names the plugin",
        ),
        pytest.param(
            {"plugins": [{"type": "kv-fit", "params": {"max_usage": 1.5}}]},
            "routing.plugins[0] (kv-fit).params.max_usage: Input should be less than or equal to 1",
            id="out-of-range param names plugin and field",
        ),
        pytest.param(
            {"plugins": [{"type": "prefix-affinity", "params": {"lru": 5}}]},
            "routing.plugins[0] (prefix-affinity).params.lru: Extra inputs are not permitted",
            id="misspelt param is refused",
        ),
        pytest.param(
            {"plugins": [{"type": "cost", "name": "cheap"}]},
            "routing.profiles.mixed.weights.cheap: scorer has no weight",
            id="a scorer without a weight is refused at load",
        ),
        pytest.param(
            {"weights": {"latency": 1}},
            "routing.weights.latency: not an enabled scorer",
            id="weight for an unknown scorer",
        ),
        pytest.param(
            {"plugins": [{"type": "cost", "enabled": False}], "weights": {"cost": 1}},
            "routing.weights.cost: not an enabled scorer",
            id="weight for a disabled scorer",
        ),
        pytest.param(
            {"profiles": {"prefill": {"weights": {"cost": -1}}}},
            "routing.profiles.prefill.weights.cost: weight must be ≥ 0",
            id="negative weight",
        ),
        pytest.param(
            {"weights": {"cost": math.inf}},
            "routing.weights.cost: Input should be a finite number",
            id="infinite weight (every route raised OverflowError: a 500)",
        ),
        pytest.param(
            {"profiles": {"decode": {"weights": {"cost": math.nan}}}},
            "routing.profiles.decode.weights.cost: Input should be a finite number",
            id="NaN weight (silently disabled the scorer)",
        ),
        pytest.param(
            {"plugins": [{"type": "at-capacity", "params": {"inflight_factor": math.inf}}]},
            "routing.plugins[0] (at-capacity).params.inflight_factor: Input should be a finite number",
            id="infinite plugin param (every request raised OverflowError)",
        ),
        pytest.param(
            {"profiles": {"decode": {"picker": "best"}}},
            "routing.profiles.decode.picker: unknown picker 'best'",
            id="unknown picker",
        ),
        pytest.param(
            {"plugins": [{"type": "cost", "name": "kv-fit"}]},
            "routing.plugins[0] (kv-fit).name: 'kv-fit' is already a kv-fit plugin",
            id="name clash with a default",
        ),
        pytest.param(
            {"pd_threshold_tokens": -1},
            "routing.pd_threshold_tokens: Input should be greater than or equal to 0",
            id="negative threshold",
        ),
        pytest.param(
            {"colour": "red"}, "routing.colour: Extra inputs are not permitted", id="unknown top-level key"
        ),
    ],
)
def test_bad_config_is_one_line_naming_plugin_and_field(data, message):
    with pytest.raises(RoutingConfigError) as info:
        parse_routing_config(data)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_bad_config_also_fails_plain_pydantic_validation():
    with pytest.raises(ValueError, match=r"routing\.plugins\[0\] \(kv-fit\)\.params\.max_usage"):
        RoutingConfig.model_validate({"plugins": [{"type": "kv-fit", "params": {"max_usage": 2}}]})


def test_yaml_example_from_the_docs_builds_and_merges_weights():
    data = yaml.safe_load(
        """
        policy: mosaic
        pd_threshold_tokens: 512
        weights: {cost: 1.0}
        plugins:
          - {type: prefix-affinity, params: {lru_blocks: 32768, load_escape: 1.5}}
          - {type: at-capacity, params: {inflight_factor: 1.0}}
          - {type: kv-headroom, enabled: false}
          - {type: capacity-load, name: load-2}
        profiles:
          mixed: {weights: {load-2: 1}}
          decode: {weights: {load-2: 0}}
          prefill: {weights: {est-ttft: 4, load-2: 0.5}}
        """
    )
    router = build_router(parse_routing_config(data))
    d = router.describe()
    assert d["policy"] == "mosaic" and d["pd_threshold_tokens"] == 512
    # defaults < routing.weights < profile weights; disabled kv-headroom is gone; weight 0 drops a scorer
    assert d["profiles"]["mixed"]["weights"] == {
        "capacity-load": 3.0,
        "est-ttft": 2.0,
        "prefix-affinity": 2.0,
        "cost": 1.0,
        "load-2": 1.0,
        "lora-affinity": 2.0,
    }
    assert d["profiles"]["decode"]["weights"] == {
        "capacity-load": 3.0,
        "prefix-affinity": 1.0,
        "cost": 1.0,
        "lora-affinity": 2.0,
    }
    assert d["profiles"]["prefill"]["weights"]["est-ttft"] == 4.0
    params = {p["name"]: p["params"] for p in d["plugins"]}
    assert params["prefix-affinity"]["lru_blocks"] == 32768 and params["at-capacity"] == {
        "inflight_factor": 1.0
    }
    assert "kv-headroom" not in params


@pytest.mark.parametrize(
    ("policy", "picker", "scorers"),
    [
        pytest.param("round-robin", "round-robin", {}, id="round-robin: no scorers, rotating picker"),
        pytest.param("least-loaded", "least-loaded", {}, id="least-loaded: no scorers, fewest requests"),
        pytest.param(
            "mosaic",
            "max-score",
            {"capacity-load", "est-ttft", "prefix-affinity", "kv-headroom", "cost", "lora-affinity"},
            id="mosaic: capacity-aware scorers, max weighted score",
        ),
    ],
)
def test_named_policies(policy, picker, scorers):
    d = build_router(RoutingConfig(policy=policy)).describe()
    for prof in d["profiles"].values():
        assert prof["picker"] == picker
        assert set(prof["filters"]) >= {"model", "role", "adapter", "state", "breaker", "kv-fit"}
    assert set(d["profiles"]["mixed"]["weights"]) == set(scorers)


def test_default_router_is_mosaic_and_routes():
    router = build_router()
    assert router.policy == "mosaic"
    decision = router.route(req(), view(worker("l4"), worker("h", gpu="H100-SXM")), 0.0, random.Random(0))
    assert isinstance(decision, Decision) and decision.decode.id == "h"  # idle fleet → the faster GPU


def test_gateway_fields_are_accepted():
    cfg = parse_routing_config({"policy": "least-loaded", "default_output_tokens": 128, "seed": 7})
    assert (cfg.default_output_tokens, cfg.seed) == (128, 7)
