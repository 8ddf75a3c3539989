"""Routing config (pydantic) and `build_router`: plugins by kebab-case `type`, weights in the profiles.

```yaml
routing:
  policy: mosaic                 # round-robin | least-loaded | mosaic
  pd_threshold_tokens: 256       # prompts shorter than this skip P/D
  pd_max_prefill_wait_s: null    # P/D gate: prefill on the decode worker when the prefill pool's best
  pd_local_prefill_margin_s: 0.5 #   queue wait exceeds this AND the decode worker's own prefill time + margin
  weights: {cost: 1.0}           # scorer name → weight, applied to every profile
  plugins:                       # merged by name over the policy's defaults (name defaults to type)
    - {type: prefix-affinity, params: {lru_blocks: 32768, load_escape: 1.5}}
    - {type: at-capacity, params: {inflight_factor: 1.0}}
    - {type: kv-headroom, enabled: false}
  profiles:
    prefill: {weights: {est-ttft: 4}}
```

Rules, checked at load: an unknown `type` or an unknown/invalid param is refused naming the plugin and
the field (`routing.plugins[0] (prefix-affinity).params.lru_blocks: Input should be greater than or
equal to 1`); every enabled scorer needs a weight in every profile (`mosaic` gives its defaults one; a
new scorer name must be given one, `0` to disable it in a profile); a weight for something that is not an
enabled scorer is refused. Reserve plugins are live objects (the KV ledger), passed to `build_router`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from scheduler.config_numbers import NoBoolNumbers
from scheduler.kv.plugins import KvBestFitScorer
from scheduler.routing import filters, pickers, scorers
from scheduler.routing.framework import (
    Filter,
    Picker,
    PreFilter,
    ReservePlugin,
    Router,
    SchedulingProfile,
    Scorer,
    WeightedScorer,
)
from scheduler.routing.lora import AdapterFilter, LoraAffinityScorer
from scheduler.routing.pd_gate import PdGate
from scheduler.routing.profiles import (
    DEFAULT_FILTERS,
    MOSAIC_SCORERS,
    MOSAIC_WEIGHTS,
    POLICY_PICKERS,
    PROFILE_ROLES,
    PdProfileHandler,
    describe_profile,
)
from scheduler.routing.topology_scorer import PdDomainAffinityScorer

# Built here, not registered by import side effects: the whole vocabulary of plugin types in one place.
# Values are plugin classes with a `type` name and a pydantic `Params` model (typed Any: a class-level
# protocol with ClassVars is not expressible for mypy).
FILTER_TYPES: Mapping[str, Any] = {
    cls.type: cls
    for cls in (
        filters.ModelFilter,
        filters.RoleFilter,
        filters.ExcludedFilter,
        filters.StateFilter,
        filters.BreakerFilter,
        filters.ContextLengthFilter,
        filters.AtCapacityFilter,
        filters.KvFitFilter,
        AdapterFilter,  # scheduler/routing/lora.py: LoRA adapters
    )
}
SCORER_TYPES: Mapping[str, Any] = {
    cls.type: cls
    for cls in (
        scorers.CapacityLoadScorer,
        scorers.EstimatedTtftScorer,
        scorers.PrefixAffinityScorer,
        scorers.KvHeadroomScorer,
        scorers.CostScorer,
        KvBestFitScorer,  # scheduler/kv/plugins.py (KV engineer): best fit on the ledger's free pages
        PdDomainAffinityScorer,  # scheduler/routing/topology_scorer.py: prefill in the decode's domain
        LoraAffinityScorer,  # scheduler/routing/lora.py: a worker already running the request's adapter
    )
}
PICKER_TYPES: Mapping[str, Any] = {
    cls.type: cls for cls in (pickers.MaxScorePicker, pickers.RoundRobinPicker, pickers.LeastLoadedPicker)
}
PLUGIN_TYPES: Mapping[str, Any] = {**FILTER_TYPES, **SCORER_TYPES}


class RoutingConfigError(ValueError):
    """A routing config that cannot be built; the message names the plugin and the field."""


class _Strict(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # an infinite weight overflowed routing


class PluginSpec(_Strict):
    type: str
    name: str | None = None  # defaults to `type`; give one to run two instances of a type
    enabled: bool = True
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.name or self.type


class ProfileSpec(_Strict):
    weights: dict[str, float] = Field(default_factory=dict)
    picker: str | None = None  # overrides the policy's picker for this profile


class RoutingConfig(_Strict):
    policy: Literal["round-robin", "least-loaded", "mosaic"] = "mosaic"
    pd_threshold_tokens: int = Field(default=256, ge=0)
    # Conditional disaggregation (scheduler/routing/pd_gate.py): null = always remote prefill.
    pd_max_prefill_wait_s: float | None = Field(default=None, ge=0)
    pd_local_prefill_margin_s: float | None = Field(default=0.5, ge=0)
    weights: dict[str, float] = Field(default_factory=dict)
    plugins: list[PluginSpec] = Field(default_factory=list)
    profiles: dict[Literal["mixed", "decode", "prefill"], ProfileSpec] = Field(default_factory=dict)
    # Read by the gateway, not the router: output estimate without predictor data, and the rng seed.
    default_output_tokens: int = Field(default=256, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check_buildable(self) -> RoutingConfig:
        # RoutingConfigError is a ValueError: pydantic reports it as this model's error, message intact.
        resolved = resolve_plugins(self)
        scorer_names = [k for k, (spec, _) in resolved.items() if spec.type in SCORER_TYPES]
        for profile in PROFILE_ROLES:
            profile_weights(self, scorer_names, profile)
            _picker_type(self, profile)
        return self


def _default_specs(policy: str) -> list[PluginSpec]:
    names = DEFAULT_FILTERS + (MOSAIC_SCORERS if policy == "mosaic" else ())
    return [PluginSpec(type=t) for t in names]


def resolve_plugins(config: RoutingConfig) -> dict[str, tuple[PluginSpec, Any]]:
    """Enabled plugins by name → (spec, validated params), defaults merged with `config.plugins`."""
    specs = {s.key: s for s in _default_specs(config.policy)}
    for i, spec in enumerate(config.plugins):
        where = f"routing.plugins[{i}] ({spec.key})"
        if spec.type not in PLUGIN_TYPES:
            raise RoutingConfigError(
                f"{where}.type: unknown plugin type {spec.type!r}; valid: {', '.join(PLUGIN_TYPES)}"
            )
        if spec.key in specs and specs[spec.key].type != spec.type:
            raise RoutingConfigError(f"{where}.name: {spec.key!r} is already a {specs[spec.key].type} plugin")
        specs[spec.key] = spec
    out: dict[str, tuple[PluginSpec, Any]] = {}
    for key, spec in specs.items():
        if not spec.enabled:
            continue
        cls = PLUGIN_TYPES[spec.type]
        try:
            out[key] = (spec, cls.Params(**spec.params))
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            where = _where(config, key)
            raise RoutingConfigError(f"{where}.params.{field}: {err['msg']}") from None
    return out


def _where(config: RoutingConfig, key: str) -> str:
    for i, spec in enumerate(config.plugins):
        if spec.key == key:
            return f"routing.plugins[{i}] ({key})"
    return f"routing.plugins default ({key})"


def profile_weights(config: RoutingConfig, scorer_names: Sequence[str], profile: str) -> dict[str, float]:
    """Default weights < `routing.weights` < `routing.profiles.<profile>.weights`; every scorer needs one."""
    defaults = MOSAIC_WEIGHTS[profile] if config.policy == "mosaic" else {}
    spec = config.profiles.get(profile)  # type: ignore[call-overload]
    merged = {**defaults, **config.weights, **(spec.weights if spec else {})}
    for source, weights in (
        ("routing.weights", config.weights),
        (f"routing.profiles.{profile}.weights", spec.weights if spec else {}),
    ):
        for name, w in weights.items():
            if name not in scorer_names:
                raise RoutingConfigError(
                    f"{source}.{name}: not an enabled scorer; scorers: {', '.join(scorer_names) or 'none'}"
                )
            if w < 0:  # .inf and .nan are refused when the config is validated (allow_inf_nan)
                raise RoutingConfigError(f"{source}.{name}: weight must be ≥ 0, got {w}")
    missing = [n for n in scorer_names if n not in merged]
    if missing:
        raise RoutingConfigError(
            f"routing.profiles.{profile}.weights.{missing[0]}: scorer has no weight (give it one; 0 disables it here)"
        )
    return {n: merged[n] for n in scorer_names}


def build_router(
    config: RoutingConfig | None = None,
    *,
    reserve: Sequence[ReservePlugin] = (),
    pre_filters: Sequence[PreFilter] = (),
) -> Router:
    """A Router for `config` (defaults: policy `mosaic`). Raises RoutingConfigError on a bad config."""
    cfg = config if config is not None else RoutingConfig()
    plugins = {key: PLUGIN_TYPES[spec.type](params) for key, (spec, params) in resolve_plugins(cfg).items()}
    filter_list: tuple[Filter, ...] = tuple(p for p in plugins.values() if type(p).type in FILTER_TYPES)
    scorer_map: dict[str, Scorer] = {k: p for k, p in plugins.items() if type(p).type in SCORER_TYPES}
    built: dict[str, SchedulingProfile] = {}
    for name, roles in PROFILE_ROLES.items():
        weights = profile_weights(cfg, list(scorer_map), name)
        built[name] = SchedulingProfile(
            name=name,
            roles=roles,
            filters=filter_list,
            scorers=tuple(WeightedScorer(n, scorer_map[n], w) for n, w in weights.items() if w > 0),
            picker=_picker(cfg, name),
        )
    gate = PdGate(cfg.pd_max_prefill_wait_s, cfg.pd_local_prefill_margin_s)
    handler = PdProfileHandler(
        built["mixed"], built["decode"], built["prefill"], cfg.pd_threshold_tokens, gate
    )
    description = {
        "pd_threshold_tokens": cfg.pd_threshold_tokens,
        **gate.describe(),
        "plugins": [
            {"name": k, "type": type(p).type, "params": p.params.model_dump()} for k, p in plugins.items()
        ],
        "profiles": {n: describe_profile(p) for n, p in built.items()},
        "reserve": [type(r).__name__ for r in reserve],
    }
    return Router(handler, pre_filters, reserve, tuple(plugins.values()), cfg.policy, description)


def _picker_type(cfg: RoutingConfig, profile: str) -> Any:
    spec = cfg.profiles.get(profile)  # type: ignore[call-overload]
    name = spec.picker if spec is not None and spec.picker else POLICY_PICKERS[cfg.policy]
    if name not in PICKER_TYPES:
        raise RoutingConfigError(
            f"routing.profiles.{profile}.picker: unknown picker {name!r}; valid: {', '.join(PICKER_TYPES)}"
        )
    return PICKER_TYPES[name]


def _picker(cfg: RoutingConfig, profile: str) -> Picker:
    picker: Picker = _picker_type(cfg, profile)()  # one instance per profile: round-robin keeps a cursor each
    return picker


def parse_routing_config(data: Mapping[str, Any] | None) -> RoutingConfig:
    """`RoutingConfig` from parsed YAML (the `routing:` mapping); RoutingConfigError with one line otherwise."""
    try:
        return RoutingConfig.model_validate(data or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "value_error":  # our own checks: the message already names plugin and field
            raise RoutingConfigError(str(err["ctx"]["error"])) from None
        field = ".".join(str(p) for p in err["loc"])
        raise RoutingConfigError(f"routing.{field}: {err['msg']}") from None
