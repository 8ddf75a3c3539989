"""Policy parameters (`scheduler.autoscaler.factory.build_policy`): finite and > 0 (counts integers ≥ 0),
static counts within the pool bounds where those are known; the gateway config's check refuses the same."""

from __future__ import annotations

import pytest

from scheduler.autoscaler.baselines import DynamoPlanner, HpaPolicy, StaticPolicy
from scheduler.autoscaler.factory import PolicyError, build_policy
from scheduler.autoscaler.policy import AutoscalerConfig
from scheduler.autoscaler.signals import PoolSpec
from server.config import ConfigError, validate_config

POOLS = [PoolSpec("dec", "llama-3-8b", "decode", "A100-80GB", 2.0, 1, 4, decode_tps_capacity=500.0)]
INITIAL = {"dec": 2}


def build(spec: str, check_bounds: bool = True) -> object:
    return build_policy(spec, POOLS, AutoscalerConfig(), INITIAL, check_bounds=check_bounds)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("hpa-util:nan", "policy 'hpa-util:nan': bad parameter: the GPU-utilisation target (hpa-util:T) must "
         "be a finite number in (0, 1], got nan"),
        ("hpa-util:0", "(hpa-util:T) must be a finite number in (0, 1], got 0"),
        ("hpa-util:1.5", "(hpa-util:T) must be a finite number in (0, 1], got 1.5"),
        ("hpa-waiting:inf", "policy 'hpa-waiting:inf': bad parameter: the waiting requests per replica "
         "(hpa-waiting:T) must be a finite number > 0, got inf"),
        ("hpa-waiting:-1", "(hpa-waiting:T) must be a finite number > 0, got -1"),
        ("hpa-waiting:1e999", "(hpa-waiting:T) must be a finite number > 0, got 1e999"),
        ("dynamo:-5", "policy 'dynamo:-5': bad parameter: the re-planning interval in seconds (dynamo:I) must "
         "be a finite number > 0, got -5"),
        ("dynamo:0", "(dynamo:I) must be a finite number > 0, got 0"),
        ("dynamo:nan", "(dynamo:I) must be a finite number > 0, got nan"),
        ("dynamo:x", "policy 'dynamo:x': bad parameter: the re-planning interval in seconds (dynamo:I) must "
         "be a number, got 'x'"),
        ("static:dec=-3", "policy 'static:dec=-3': bad parameter: the count of pool 'dec' must be an integer "
         "≥ 0 (static:POOL=N), got '-3'"),
        ("static:dec=nan", "the count of pool 'dec' must be an integer ≥ 0 (static:POOL=N), got 'nan'"),
        ("static:dec", "the count of pool 'dec' must be an integer ≥ 0 (static:POOL=N), got ''"),
        ("static:dec=5", "policy 'static:dec=5': bad parameter: the count of pool 'dec' (5) is outside its "
         "min_replicas..max_replicas (1..4)"),
        ("static:dec=0", "the count of pool 'dec' (0) is outside its min_replicas..max_replicas (1..4)"),
        ("static:other=1", "static policy: unknown pool 'other'; pools: dec"),
        ("static:dec=2,dec=3", "policy 'static:dec=2,dec=3': bad parameter: pool 'dec' is given twice"),
        ("fixed:1", "policy 'fixed:1': bad parameter: fixed takes no parameter"),
    ],
)  # fmt: skip
def test_bad_parameters_name_the_policy_and_argument(spec: str, message: str) -> None:
    with pytest.raises(PolicyError) as err:
        build(spec)
    assert message in str(err.value)


def test_good_parameters_build_the_policy() -> None:
    hpa = build("hpa-util:1")
    assert isinstance(hpa, HpaPolicy) and hpa.target == 1.0
    assert isinstance(build("hpa-waiting"), HpaPolicy)
    dynamo = build("dynamo:30")
    assert isinstance(dynamo, DynamoPlanner) and dynamo.interval_s == 30.0
    static = build("static:dec=4")
    assert isinstance(static, StaticPolicy) and static.counts == {"dec": 4}
    assert build("fixed") is None


def test_bounds_are_checked_only_when_asked() -> None:
    # the live controller pins unmanaged pools at min = max = their count: it does not check bounds
    static = build("static:dec=5", check_bounds=False)
    assert isinstance(static, StaticPolicy) and static.counts == {"dec": 5}
    with pytest.raises(PolicyError, match="integer ≥ 0"):
        build("static:dec=-1", check_bounds=False)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("dynamo:-5", "(dynamo:I) must be a finite number > 0, got -5"),
        ("hpa-util:nan", "(hpa-util:T) must be a finite number in (0, 1], got nan"),
        ("hpa-waiting:inf", "(hpa-waiting:T) must be a finite number > 0, got inf"),
        ("static:l4=-3", "the count of pool 'l4' must be an integer ≥ 0"),
    ],
)
def test_the_gateway_config_refuses_them_too(policy: str, message: str) -> None:
    sim = {"name": "l4", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"simulated": {"time_scale": 5}}}
    with pytest.raises(ConfigError) as err:
        validate_config({"pools": [sim], "autoscaler": {"policy": policy}})
    assert f"autoscaler.policy: policy '{policy}': bad parameter: " in str(err.value)
    assert message in str(err.value) and "\n" not in str(err.value)
