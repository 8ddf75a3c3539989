"""The gateway config's `autoscaler:` section: defaults, knobs into the policy's config, and one-line errors."""

from __future__ import annotations

from typing import Any

import pytest

from server.config import ConfigError, validate_config


def _config(
    autoscaler: dict[str, Any], pools: list[dict[str, Any]] | None = None, **top: Any
) -> dict[str, Any]:
    sim = {"name": "l4", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"simulated": {"time_scale": 5}}}
    return {"pools": pools or [sim], "autoscaler": autoscaler, **top}


def test_defaults_and_knobs_reach_the_policy_config() -> None:
    cfg = validate_config(
        _config({"knobs": {"pd_ratio": 0.25, "scale_down_window_s": 60}}, slo={"tpot_ms": 50})
    )
    a = cfg.autoscaler
    assert (a.enabled, a.policy, a.actuator, a.interval_s, a.cold_start_s) == (
        False,
        "mosaic",
        "embedded",
        15.0,
        0.0,
    )
    policy = a.policy_config(cfg.slo)
    assert (policy.pd_ratio, policy.scale_down_window_s) == (0.25, 60)
    assert (policy.tpot_slo_s, policy.ttft_slo_s) == (
        0.05,
        None,
    )  # the SLO section is the latency net's default
    assert a.policy_config(cfg.slo).utilization_target == 0.8  # untouched knobs keep the policy's defaults


def test_a_knob_overrides_the_slo_section() -> None:
    cfg = validate_config(_config({"knobs": {"tpot_slo_s": 0.2}}, slo={"tpot_ms": 50}))
    assert cfg.autoscaler.policy_config(cfg.slo).tpot_slo_s == 0.2


OTHER_SIM = {
    "name": "a100",
    "model": "llama-3-8b",
    "gpu": "A100-80GB",
    "endpoints": {"simulated": {"time_scale": 9}},
}
STATIC = {"name": "s", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"static": ["http://h:1"]}}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            _config({"policy": "dynamo:x"}),
            "autoscaler.policy: policy 'dynamo:x': bad parameter",
            id="a policy parameter that is not a number",
        ),
        pytest.param(
            _config({"policy": "static:b=2"}),
            "autoscaler.policy: static policy: unknown pool 'b'",
            id="static counts for a pool that does not exist",
        ),
        pytest.param(
            _config({"policy": "fixed"}),
            "set autoscaler.enabled: false instead",
            id="fixed is the simulator's no-autoscaler, not a live policy",
        ),
        pytest.param(
            _config({"knobs": {"utilization_target": 1.5}}),
            "autoscaler.knobs: utilization_target must be",
            id="a knob out of range",
        ),
        pytest.param(
            _config({"knobs": {"prefill_mode": "tokens"}}),
            "prefill_mode must be ratio or prompt_tokens",
            id="an unknown prefill mode",
        ),
        pytest.param(_config({"interval_s": 0}), "autoscaler.interval_s", id="interval not positive"),
        pytest.param(_config({"actuator": "helm"}), "autoscaler.actuator", id="unknown actuator"),
        pytest.param(
            _config({"kubernetes": {"deployments": {"x": "d"}}}),
            "autoscaler.kubernetes.deployments.x: no pool named 'x'",
            id="a Deployment for an unknown pool",
        ),
        pytest.param(
            _config({"enabled": True}, [STATIC]),
            "the embedded actuator scales simulated",
            id="embedded actuator with nothing simulated to scale",
        ),
        pytest.param(
            _config({"enabled": True}, [_config({})["pools"][0], OTHER_SIM]),
            "mix time_scale values",
            id="one model's simulated pools at two time scales",
        ),
        pytest.param(
            _config({"enabled": True, "actuator": "dry-run"}, [_config({})["pools"][0], OTHER_SIM]),
            "mix time_scale values",
            id="dry-run reads rates the same way: two time scales refused too",
        ),
        pytest.param(_config({"cooldown_s": 5}), "autoscaler.cooldown_s: unknown key", id="unknown key"),
        pytest.param(
            _config({"backlog_lead_s": 120}),
            "backlog_lead_s needs autoscaler.cold_start_s",
            id="a backlog lead without ready estimates",
        ),
    ],
)
def test_bad_autoscaler_section_names_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(data)
    assert message in str(err.value) and "\n" not in str(err.value)
