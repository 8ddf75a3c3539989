"""Gateway configuration: one YAML file → `MosaicConfig` (pydantic v2, unknown keys refused).

```yaml
models:
  - name: llama-3-8b                # the name clients send as "model"
    spec: llama-3-8b                # catalog row for the perf model (default: name; aliases resolve)
pools:
  - name: decode-a100
    model: llama-3-8b
    gpu: A100-80GB
    role: decode                    # prefill | decode | mixed
    endpoints:                      # exactly one of static | kubernetes | simulated | launch
      static: [http://10.0.0.5:8000, http://10.0.0.6:8000]
routing: {policy: mosaic, pd_threshold_tokens: 256}   # scheduler.routing.config.RoutingConfig
auth: {api_keys_env: MOSAIC_API_KEYS, admin_keys: [admin-secret]}
limits: {max_body_bytes: 4194304, queue_size: 256, queue_deadline_s: 10}
```

`load_config(path)` raises `ConfigError` whose message is one line naming the file and the field
(`pools.1.gpu: unknown GPU 'B200'; valid GPUs: T4, ...`). `docs/gateway.md` is the full reference.

Sections owned by other parts are their own pydantic models, plugged in here so one file configures
everything and unknown keys are refused everywhere: `routing` (`scheduler.routing.config.RoutingConfig`),
`kv` (`scheduler.kv.config.KvConfig`); `autoscaler` (`AutoscalerConfig` here, run by `server.autoscaling`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from placement.catalog import Catalog, CatalogError, load_catalog
from placement.textfiles import parse_yaml, read_text
from scheduler.autoscaler.factory import POLICY_NAMES, PolicyError, build_policy
from scheduler.autoscaler.policy import AutoscalerConfig as PolicyConfig
from scheduler.autoscaler.signals import PoolSpec
from scheduler.config_numbers import NoBoolNumbers
from scheduler.fleet import prefill_only_models
from scheduler.kv.config import KvConfig
from scheduler.routing.config import RoutingConfig, RoutingConfigError
from server.vllm_pool import LaunchVllmConfig

RoleName = Literal["prefill", "decode", "mixed"]
# vLLM's `--runner`: `generate` serves completions, chat and responses; `pooling` serves embeddings, score
# and rerank (an embedding or reranker model, or a causal LM with `--convert embed`) and none of the
# generation endpoints
RunnerName = Literal["generate", "pooling"]


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the field."""


class _Strict(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # .inf or .nan is a typo


class ModelConfig(_Strict):
    name: str = Field(min_length=1)
    spec: str | None = None  # catalog model name; None → `name`
    max_model_len: int | None = Field(default=None, ge=1)  # None → the catalog's max context
    # The workers load LoRA adapters on demand (vLLM's resolver plugins: VLLM_ALLOW_RUNTIME_LORA_UPDATING with
    # VLLM_PLUGINS=lora_filesystem_resolver and VLLM_LORA_RESOLVER_CACHE_DIR, or the Hub resolver): a request
    # naming a model the gateway does not know goes to this model's workers as an adapter, not a 404
    lora_resolver: bool = False

    @property
    def spec_name(self) -> str:
        return self.spec or self.name


class KubernetesSource(_Strict):
    """Workers found through the Kubernetes API (EndpointSlices of a Service, or pods) by label selector.

    EndpointSlices carry `kubernetes.io/service-name=<svc>`, so for `resource: endpointslices` the selector
    usually names the Service; for `resource: pods` it matches the pods' own labels.
    """

    namespace: str = "default"
    label_selector: str = Field(min_length=1)
    port: int | str = 8000  # number, or the port's name in the EndpointSlice / container spec
    resource: Literal["endpointslices", "pods"] = "endpointslices"
    scheme: Literal["http", "https"] = "http"
    resync_s: float = Field(default=10.0, gt=0)  # periodic re-list
    in_cluster: bool | None = None  # None: in-cluster config when available, else ~/.kube/config
    # Node label whose value is a worker's network domain (pd-domain-affinity routing). The default is read
    # from the EndpointSlice endpoint's `zone` field; any other label, or `resource: pods`, reads the node's
    # labels (lists nodes: RBAC `list nodes`). None: domains unknown.
    domain_label: str | None = "topology.kubernetes.io/zone"


class SimulatedLora(_Strict):
    """One LoRA adapter of a simulated pool (vLLM's `--lora-modules name=path`); `path` defaults to the name
    (what a Hugging Face adapter id would be): it is only shown, as the adapter's `/v1/models` `root`."""

    name: str = Field(min_length=1)
    path: str | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @property
    def module_path(self) -> str:
        return self.path or self.name


class SimulatedSource(_Strict):
    """Simulated vLLM workers started in-process (`simulator.worker_server.start_worker_server`)."""

    # each is an HTTP server in the gateway's process; fleets larger than this are `mosaic simulate`'s job
    replicas: int = Field(default=1, ge=0, le=256)
    time_scale: float = Field(default=1.0, ge=1e-3)  # X times faster than real time (≥ 1000× slower)
    seed: int = 0
    kv_link_gbps: float | None = Field(default=None, gt=0)  # P/D transfer link; None → the worker's default
    error_rate: float = Field(default=0.0, ge=0, le=1)  # failure injection (reliability tests)
    # LoRA adapters every worker serves (vLLM's --enable-lora --lora-modules), a name or {name, path} each,
    # and how many one engine step may run (--max-loras; vLLM's default 1)
    lora_modules: list[SimulatedLora] = Field(default_factory=list)
    max_loras: int = Field(default=1, ge=1)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter on every worker (vLLM with env
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); it turns LoRA on in the workers, as a pool started with
    # --enable-lora would have it (a vLLM without LoRA answers every load 500)
    allow_runtime_lora_updating: bool = False

    @field_validator("lora_modules")
    @classmethod
    def _unique_adapters(cls, modules: list[SimulatedLora]) -> list[SimulatedLora]:
        seen: set[str] = set()
        for m in modules:
            if m.name in seen:  # vLLM refuses to start: "The lora adapter '...' has already been loaded."
                raise ValueError(f"duplicate LoRA adapter name {m.name!r}")
            seen.add(m.name)
        return modules


class EndpointsConfig(_Strict):
    static: list[str] | None = None
    kubernetes: KubernetesSource | None = None
    simulated: SimulatedSource | None = None
    launch: LaunchVllmConfig | None = None  # `launch: vllm`: the gateway starts the pool's vLLM processes
    # network domain per static URL; filled from `static: [{url, domain}]` items (see `_static_items`)
    static_domains: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _static_items(cls, data: Any) -> Any:
        """`static:` items may be `{url: ..., domain: ...}`: the URL stays in `static`, the domain goes to
        `static_domains` (keyed by the URL without a trailing slash, as `static` stores it)."""
        if not isinstance(data, dict) or not isinstance(data.get("static"), list):
            return data
        urls: list[Any] = []
        domains = dict(data.get("static_domains") or {})
        for item in data["static"]:
            if isinstance(item, dict):
                if set(item) - {"url", "domain"} or not isinstance(item.get("url"), str):
                    raise ValueError(f"static item {item!r}: give a URL or {{url, domain}}")
                urls.append(item["url"])
                if item.get("domain") is not None:
                    domains[item["url"].rstrip("/")] = str(item["domain"])
            else:
                urls.append(item)
        return {**data, "static": urls, "static_domains": domains}

    @model_validator(mode="after")
    def _exactly_one(self) -> EndpointsConfig:
        given = [k for k in ("static", "kubernetes", "simulated", "launch") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of static, kubernetes, simulated, launch (got {given or 'none'})"
            )
        return self

    @field_validator("static")
    @classmethod
    def _urls(cls, urls: list[str] | None) -> list[str] | None:
        if urls is None:
            return None
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s):// URL")
        return [u.rstrip("/") for u in urls]

    @property
    def kind(self) -> str:
        return next(
            k for k in ("static", "kubernetes", "simulated", "launch") if getattr(self, k) is not None
        )


class PoolConfig(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: str
    gpu: str
    role: RoleName = "mixed"
    runner: RunnerName = "generate"  # vLLM's --runner: what the pool's workers serve (RunnerName)
    tp: int = Field(default=1, ge=1)  # GPUs per engine (vLLM's --tensor-parallel-size)
    # engines per worker, behind its one API server (vLLM's --data-parallel-size), each on `tp` GPUs with its
    # own KV cache: a worker is `dp` times one engine's capacity and price, on tp × dp GPUs
    dp: int = Field(default=1, ge=1)
    endpoints: EndpointsConfig
    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int | None = Field(default=None, ge=0)
    cost_per_hour: float | None = Field(default=None, ge=0)  # per worker; None → catalog price × tp × dp
    # vLLM engine knobs the gateway needs to size capacity before the first scrape (and simulated workers use).
    max_num_seqs: int = Field(default=256, ge=1)
    block_size: int = Field(default=16, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # network domain (rack / RDMA group / zone) of workers whose endpoint gives none (pd-domain-affinity)
    domain: str | None = Field(default=None, min_length=1)
    # env var holding the key the pool's vLLM servers were started with (`vllm serve --api-key`): sent to
    # them as `Authorization: Bearer …` (clients' own keys are the gateway's and never go upstream)
    api_key_env: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _replica_bounds(self) -> PoolConfig:
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        if self.runner == "pooling" and self.role != "mixed":
            # vLLM hands KV from prefill to decode for generation only: a pooling request ends at its prefill
            raise ValueError(f"a pooling pool serves whole requests: role must be mixed, not {self.role}")
        return self


class SloConfig(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)


class AuthConfig(_Strict):
    api_keys: list[str] = Field(default_factory=list)
    api_keys_env: str | None = None  # env var holding comma-separated keys, merged with api_keys
    admin_keys: list[str] = Field(default_factory=list)
    admin_keys_env: str | None = None


class RateLimitConfig(_Strict):
    """Per API key token buckets; None disables that bucket."""

    requests_per_s: float | None = Field(default=None, gt=0)
    burst: int | None = Field(default=None, ge=1)  # request bucket size; None → max(1, ceil(requests_per_s))
    tokens_per_min: float | None = Field(default=None, gt=0)  # prompt + reserved output tokens


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    rate_limit: RateLimitConfig = Field(default_factory=RateLimitConfig)
    queue_size: int = Field(default=1024, ge=0)  # waiting requests per model; 0 → reject at once
    queue_deadline_s: float = Field(default=10.0, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_token_timeout_s: float = Field(default=60.0, gt=0)  # dispatch → first byte (P/D: incl. prefill)
    stall_timeout_s: float = Field(default=60.0, gt=0)  # longest gap between stream chunks
    total_timeout_s: float = Field(default=600.0, gt=0)
    retry_budget_s: float = Field(default=10.0, ge=0)  # retries allowed while within this of arrival
    max_retries: int = Field(default=2, ge=0)
    max_upstream_connections: int = Field(default=1024, ge=1)
    shutdown_grace_s: float = Field(default=30.0, ge=0)  # drain in-flight streams on SIGTERM


class ScrapeConfig(_Strict):
    interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)  # a busy vLLM can take ~1 s to render /metrics
    stale_after_s: float = Field(default=5.0, gt=0)  # older stats are dropped from the fleet view
    # how often a worker's /v1/models is read for its LoRA adapters (`server.registry`)
    models_interval_s: float = Field(default=15.0, gt=0)


class HealthConfig(_Strict):
    """Active `/health` checks and the circuit breaker (passive ejection on connection errors)."""

    interval_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    failure_threshold: int = Field(default=3, ge=1)  # consecutive failures that open the breaker
    open_s: float = Field(default=5.0, gt=0)  # open this long, then one probe decides (half-open)
    # Failures eject a worker only while fewer than this percentage of the workers serving its model in its
    # role are out (ejected, or failing their health checks; at least one may be; Envoy's outlier detection
    # `max_ejection_percent`): a client whose requests fail on every worker (one that trips a vLLM bug) cannot
    # eject them all. A refused connection, or failed checks reaching failure_threshold, eject regardless.
    # 100: no limit.
    max_ejection_percent: float = Field(default=50.0, ge=0, le=100)
    # While a worker is unhealthy, close the gateway's connections to it that got no byte for
    # failure_threshold × interval_s: requests not begun go to another worker, streams end with an error event
    sever_silent_requests: bool = True
    # An engine that reports requests running and no step for this long (raised per pool to twice its
    # longest prefill, `max_model_len` at the perf model's rate) fails its health checks although its
    # /health says 200: vLLM's answers only whether the engine process died. None: never judged stuck
    stuck_engine_s: float | None = Field(default=30.0, gt=0)


class ReadinessConfig(_Strict):
    """What `GET /ready` (the chart's readiness probe) requires besides "not draining and discovery synced".

    Off by default: a gateway with no ready worker for one model still serves the others, and taking every
    gateway replica out of the Service for one model's empty pool would cut all models off (and block a
    rolling update). `require_all_models: true` restores the strict probe: 503 until every configured
    model has a ready worker (a single-model fleet, or a load balancer that should skip such a gateway).
    """

    require_all_models: bool = False


class AutoscalerKubernetesConfig(_Strict):
    """Where the `kubernetes` actuator scales: each managed pool's Deployment (its `scale` subresource)."""

    namespace: str | None = None  # None → $POD_NAMESPACE (set in the chart's controller pod), else "default"
    deployments: dict[str, str] = Field(
        default_factory=dict
    )  # pool → Deployment; empty → every kubernetes pool, by pool name
    # pool → {network domain → Deployment}: the pool is one Deployment per domain (the chart's pools[].domains),
    # scaled by the placing actuator (scheduler.actuators.kubernetes); domains are those of autoscaler.nodes
    domains: dict[str, dict[str, str]] = Field(default_factory=dict)
    in_cluster: bool | None = None  # None: in-cluster config when available, else ~/.kube/config


class AutoscalerGatewaysConfig(_Strict):
    """The gateways `mosaic autoscale` scrapes for the gateway-side signals (`server.gateway_scrape`):
    static base URLs, or the gateway pods found by Kubernetes discovery (`server.discovery`)."""

    static: list[str] | None = None  # gateway base URLs; `path` is appended
    kubernetes: KubernetesSource | None = None  # e.g. resource: pods, the gateway pods' labels, their port
    path: str = Field(default="/metrics", pattern=r"^/")
    bearer_token_env: str | None = (
        None  # env var with a bearer token (first of a comma list) for a protected /metrics
    )
    interval_s: float | None = Field(
        default=None, gt=0
    )  # scrape period; None → min(5 s, autoscaler.interval_s / 2)
    timeout_s: float = Field(default=2.0, gt=0)
    stale_after_s: float = Field(default=30.0, gt=0)  # an older last good scrape: the gateway is skipped

    @model_validator(mode="after")
    def _one_source(self) -> AutoscalerGatewaysConfig:
        if (self.static is None) == (self.kubernetes is None):
            raise ValueError("give exactly one of static, kubernetes")
        for url in self.static or []:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s):// URL")
        return self


class AutoscalerConfig(_Strict):
    """The live P/D autoscaler (`server.autoscaling`, docs/autoscaling-live.md).

    `mosaic serve` runs it in-process when `enabled` and the actuator is `embedded` or `dry-run`;
    `mosaic autoscale` runs only the controller (the chart's controller Deployment, `kubernetes`).
    Per-pool bounds are the pools' `min_replicas` / `max_replicas`; `knobs` are the policy's own
    (`scheduler.autoscaler.policy.AutoscalerConfig`: utilization_target, pd_ratio, scale_down_window_s, ...).
    """

    enabled: bool = False
    policy: str = "mosaic"  # scheduler.autoscaler.factory spelling: mosaic, hpa-util:0.7, hpa-waiting:4, dynamo:180, static:p=N
    interval_s: float = Field(default=15.0, gt=0)
    actuator: Literal["embedded", "kubernetes", "dry-run"] = "embedded"
    cold_start_s: float = Field(
        default=0.0, ge=0
    )  # embedded: a started worker becomes routable this much later; any actuator: expected start → ready
    drain_timeout_s: float = Field(
        default=600.0, gt=0
    )  # embedded: longest wait for a draining worker's requests
    context_tokens: int = Field(default=1024, ge=1)  # context per sequence at which decode capacity is sized
    history: int = Field(default=100, ge=1)  # decisions and scale actions kept for /admin/autoscaler
    knobs: dict[str, Any] = Field(default_factory=dict)
    kubernetes: AutoscalerKubernetesConfig = Field(default_factory=AutoscalerKubernetesConfig)
    nodes: str | dict[str, Any] | None = (
        None  # node inventory (`mosaic plan --nodes` format; server.autoscale_placement)
    )
    gateways: AutoscalerGatewaysConfig | None = (
        None  # `mosaic autoscale`: whose /metrics give the gateway-side signals
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_knobs(cls, data: Any) -> Any:
        """Policy knobs may sit directly under `autoscaler:` (as in a `mosaic simulate` fleet file) or in `knobs:`."""
        if not isinstance(data, dict):
            return data
        names = {f.name for f in dataclasses.fields(PolicyConfig)}
        flat = {k: v for k, v in data.items() if k in names}
        if not flat:
            return data
        rest = {k: v for k, v in data.items() if k not in names}
        nested = rest.get("knobs") or {}
        both = sorted(k for k in flat if isinstance(nested, dict) and k in nested and nested[k] != flat[k])
        if both:  # which one wins would be a guess
            raise ValueError(
                f"{both[0]} is set both under autoscaler ({flat[both[0]]!r}) and under autoscaler.knobs "
                f"({nested[both[0]]!r}); give it once"
            )
        return {**rest, "knobs": {**flat, **nested}}

    @field_validator("policy")
    @classmethod
    def _policy_name(cls, spec: str) -> str:
        name = spec.partition(":")[0]
        if name == "fixed":
            raise ValueError(
                "policy 'fixed' scales nothing; set autoscaler.enabled: false instead (mosaic serve), or do "
                "not run mosaic autoscale (the Helm chart: controller.enabled: false)"
            )
        if name not in POLICY_NAMES:
            raise ValueError(
                f"unknown policy {spec!r}; valid: {', '.join(n for n in POLICY_NAMES if n != 'fixed')}"
            )
        return spec

    @field_validator("knobs")
    @classmethod
    def _knobs(cls, knobs: dict[str, Any]) -> dict[str, Any]:
        PolicyConfig.from_knobs(knobs)
        return knobs

    @model_validator(mode="after")
    def _lead_needs_cold_start(self) -> AutoscalerConfig:
        # Without a cold start there are no ready estimates: every starting instance would count as coming
        # up only at the lead, so the projected backlog could only grow (more buying, not less).
        if float(self.knobs.get("backlog_lead_s") or 0) > 0 and self.cold_start_s <= 0:
            raise ValueError(
                "backlog_lead_s needs autoscaler.cold_start_s (starting instances' expected ready times)"
            )
        return self

    def policy_config(self, slo: SloConfig) -> PolicyConfig:
        """The policy's knobs, with the SLO section's TTFT/TPOT as its latency net unless a knob sets them."""
        slos = {
            "ttft_slo_s": slo.ttft_ms / 1e3 if slo.ttft_ms else None,
            "tpot_slo_s": slo.tpot_ms / 1e3 if slo.tpot_ms else None,
        }
        return PolicyConfig.from_knobs({**slos, **self.knobs})


class CorsConfig(_Strict):
    """Cross-origin requests from browsers, as vLLM's `--allowed-origins`, `--allowed-methods`,
    `--allowed-headers` and `--allow-credentials` take them, with vLLM 0.32's defaults (no origin: browser
    access off; any method and header; no credentials). An empty `allowed_origins` turns CORS off: no
    preflight answer, no headers; `["*"]` lets any web page call the gateway from a user's browser."""

    allowed_origins: list[str] = Field(default_factory=list)
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


class ResponsesConfig(_Strict):
    """OpenAI's Responses API (`/v1/responses`): how many served response ids the gateway remembers with
    their worker (stored-response affinity, `server.response_store`), and for how long."""

    affinity_max_entries: int = Field(default=100_000, ge=1)
    affinity_ttl_s: float = Field(default=86_400.0, gt=0, allow_inf_nan=False)


class LoraConfig(_Strict):
    """Run-time LoRA adapters relayed through the gateway (`server.lora_admin`): how long a worker may take
    to load one, and whether adapters loaded through the gateway are loaded on workers that come later."""

    load_timeout_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)  # vLLM may download from the Hub
    reconcile: bool = True
    retry_max_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)  # a failed reconcile's longest wait


class GatewayPeersConfig(_Strict):
    """This gateway's own replicas, listed at run time (`server.peers`): N of the 1/N KV share is the number
    listed — at once when it rises, after `grow_back_after_s` of fewer when it falls — instead of the fixed
    `gateway.replicas`. Kubernetes discovery of the gateway's pods: the EndpointSlices of its Service (every
    pod with an address, ready or not, terminating ones included) or the pods by label."""

    kubernetes: KubernetesSource
    grow_back_after_s: float = Field(default=60.0, ge=0)


class GatewaySettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # gateway processes sharing the fleet: each owns 1/N of capacity (with `peers`: N until the first listing)
    replicas: int = Field(default=1, ge=1)
    peers: GatewayPeersConfig | None = None


class MosaicConfig(_Strict):
    models: list[ModelConfig] = Field(default_factory=list)  # empty → one entry per pool model
    pools: list[PoolConfig] = Field(min_length=1)
    routing: RoutingConfig = Field(
        default_factory=RoutingConfig
    )  # the router's own model (policy, plugins, weights)
    slo: SloConfig = Field(default_factory=SloConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    scrape: ScrapeConfig = Field(default_factory=ScrapeConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    readiness: ReadinessConfig = Field(default_factory=ReadinessConfig)  # what GET /ready requires
    kv: KvConfig = Field(default_factory=KvConfig)  # the KV budget ledger's own model (scheduler.kv.config)
    autoscaler: AutoscalerConfig = Field(default_factory=AutoscalerConfig)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    cors: CorsConfig = Field(default_factory=CorsConfig)  # browsers' cross-origin requests (vLLM's defaults)
    lora: LoraConfig = Field(default_factory=LoraConfig)  # /v1/load_lora_adapter relayed to the fleet
    responses: ResponsesConfig = Field(
        default_factory=ResponsesConfig
    )  # /v1/responses' stored-response affinity
    # YAML file of GPU/model rows merged over the built-in catalog; relative to the config file's folder
    catalog: str | None = None
    # The file this config was read from (`load_config` sets it; not a key users write): relative paths in
    # it, like `kv.compression[].profile`, are resolved against its folder.
    _source_path: Path | None = PrivateAttr(default=None)

    @property
    def source_dir(self) -> Path | None:
        """The folder of the config file it was loaded from (None when built from data)."""
        return self._source_path.parent if self._source_path is not None else None

    def resolve_path(self, path: str | Path) -> Path:
        """`path` as written in the config: relative ones from the config file's folder (when loaded from a
        file; else from the working directory), absolute ones as they are."""
        p = Path(path)
        base = self.source_dir
        return base / p if base is not None and not p.is_absolute() else p

    @model_validator(mode="after")
    def _cross_checks(self) -> MosaicConfig:
        _unique([p.name for p in self.pools], "pools", "pool name")
        _unique([m.name for m in self.models], "models", "model name")
        if self.models:
            known = {m.name for m in self.models}
            for i, pool in enumerate(self.pools):
                if pool.model not in known:
                    raise _FieldError(f"pools.{i}.model", f"model {pool.model!r} is not listed under models")
        resolving = [i for i, m in enumerate(self.models) if m.lora_resolver]
        if len(resolving) > 1:  # an unknown name would belong to any of them
            raise _FieldError(
                f"models.{resolving[1]}.lora_resolver",
                "only one model may resolve LoRA adapters on demand: the gateway could not tell which model "
                "an unknown name belongs to",
            )
        for model, names in prefill_only_models((p.name, p.model, p.role) for p in self.pools).items():
            i = next(i for i, p in enumerate(self.pools) if p.name == names[0])
            raise _FieldError(
                f"pools.{i}.role",
                f"model {model!r} has only prefill pools ({', '.join(names)}): a prefill worker does not "
                "finish a request; add a decode or mixed pool",
            )
        _check_one_runner_per_model(self.pools)
        _check_launch_gpus(self)
        for i, pool in enumerate(self.pools):
            sim = pool.endpoints.simulated
            for j, m in enumerate(sim.lora_modules if sim is not None else ()):
                # the workers' served name (vLLM refuses it: "conflicts with a served base model")
                if m.name == pool.model:
                    raise _FieldError(
                        f"pools.{i}.endpoints.simulated.lora_modules.{j}.name",
                        f"LoRA adapter {m.name!r} takes the name the pool's workers serve the base model as",
                    )
        _check_autoscaler(self)
        _check_kv(self)
        return self

    def model_configs(self) -> list[ModelConfig]:
        """Listed models, or one per distinct pool model when `models` is empty."""
        if self.models:
            return list(self.models)
        names = dict.fromkeys(p.model for p in self.pools)
        return [ModelConfig(name=n) for n in names]

    @property
    def lora_resolver_model(self) -> str | None:
        """The model whose workers resolve unknown LoRA adapter names themselves (`lora_resolver`), if any."""
        return next((m.name for m in self.models if m.lora_resolver), None)

    def model_config_for(self, name: str) -> ModelConfig:
        for m in self.model_configs():
            if m.name == name:
                return m
        raise KeyError(name)


def _check_one_runner_per_model(pools: list[PoolConfig]) -> None:
    """A model's pools share one runner: the gateway answers a model's requests by what its workers serve
    (embeddings, score and rerank, or completions, chat and responses), as one vLLM serves one or the other
    under a name."""
    runner_of: dict[str, tuple[str, str]] = {}  # model → (runner, the first pool that set it)
    for i, pool in enumerate(pools):
        first = runner_of.setdefault(pool.model, (pool.runner, pool.name))
        if first[0] != pool.runner:
            raise _FieldError(
                f"pools.{i}.runner",
                f"model {pool.model!r} is served by pool {first[1]!r} with runner {first[0]} and by "
                f"{pool.name!r} with {pool.runner}; serve the embedding model under a name of its own",
            )


def _check_launch_gpus(config: MosaicConfig) -> None:
    """Launched pools' `gpu_ids` against what their replicas need (tp × dp GPUs each), so that a shortage is
    refused at load instead of failing the gateway's start (`needs N GPU(s)`): a pool's ids must hold one
    replica, and the `launch.replicas` started with the gateway must fit the ids listed. Pools whose ids
    overlap share those GPUs (the allocator gives each GPU to one replica at a time, as it does to pools
    without `gpu_ids`, which draw from all of them), so their starting replicas are counted together, per
    group of pools linked by a shared GPU. Both are necessary conditions, so no config whose replicas could
    all start is refused; a start can still fail (pools without `gpu_ids` draw from the same GPUs, and the
    allocator, which prefers the GPUs the fewest other pools list, chooses per start, not for every order of
    starts at once)."""
    listed = [
        (i, p, p.endpoints.launch)
        for i, p in enumerate(config.pools)
        if p.endpoints.launch is not None and p.endpoints.launch.use_gpus and p.endpoints.launch.gpu_ids
    ]
    groups: list[tuple[list[int], set[str]]] = []  # pool indexes, their GPU ids
    for i, pool, launch in listed:
        ids = launch.gpu_ids or []
        need = pool.tp * pool.dp
        if len(ids) < need:
            raise _FieldError(
                f"pools.{i}.endpoints.launch.gpu_ids",
                f"{len(ids)} GPU(s) ({','.join(ids)}) cannot hold one replica of tp {pool.tp} × dp {pool.dp} = "
                f"{need} GPUs",
            )
        members, union = [i], set(ids)
        for group in [g for g in groups if not g[1].isdisjoint(ids)]:
            groups.remove(group)
            members, union = group[0] + members, group[1] | union
        groups.append((sorted(members), union))
    for members, _ in groups:
        pools = [config.pools[i] for i in members]
        launches = [p.endpoints.launch for p in pools if p.endpoints.launch is not None]
        gpus = list(dict.fromkeys(g for launch in launches for g in launch.gpu_ids or []))  # as listed
        demand = [(launch.replicas, p.tp * p.dp) for p, launch in zip(pools, launches, strict=True)]
        total = sum(r * need for r, need in demand)
        if total <= len(gpus):
            continue
        last = members[-1]
        if len(members) == 1:
            (replicas, need), pool = demand[0], pools[0]
            raise _FieldError(
                f"pools.{last}.endpoints.launch.replicas",
                f"{replicas} replicas of tp {pool.tp} × dp {pool.dp} = {need} GPUs need {total} GPUs; "
                f"gpu_ids lists {len(gpus)} ({','.join(gpus)})",
            )
        raise _FieldError(
            f"pools.{last}.endpoints.launch.replicas",
            f"pools {', '.join(p.name for p in pools)} share GPUs {','.join(gpus)} and start replicas of "
            f"{' + '.join(f'{r} × {n}' for r, n in demand)} = {total} GPUs (launch.replicas × tp × dp), more "
            f"than those {len(gpus)}; a GPU serves one replica at a time",
        )


def _check_autoscaler(config: MosaicConfig) -> None:
    """What the autoscaler section can only check against the pools (names, parameters, time scales)."""
    a = config.autoscaler
    names = [p.name for p in config.pools]
    mapped_by: dict[str, str] = {}  # Deployment → the pool mapped to it
    for mapped, deployment in a.kubernetes.deployments.items():
        if mapped not in names:
            raise _FieldError(
                f"autoscaler.kubernetes.deployments.{mapped}",
                f"no pool named {mapped!r}; pools: {', '.join(names)}",
            )
        if deployment in mapped_by:  # two pools scaling one Deployment would undo each other every cycle
            raise _FieldError(
                f"autoscaler.kubernetes.deployments.{mapped}",
                f"Deployment {deployment!r} is already mapped by pool {mapped_by[deployment]!r}; "
                "each Deployment can scale one pool only",
            )
        mapped_by[deployment] = mapped
        if next(p for p in config.pools if p.name == mapped).runner == "pooling":
            # the policy's signal is decode tokens/s, which an embedding pool never produces: it would only
            # ever be scaled down
            raise _FieldError(
                f"autoscaler.kubernetes.deployments.{mapped}",
                f"pool {mapped!r} runs the pooling runner (embeddings), which the autoscaler does not scale",
            )
    for pooled in (p.name for p in config.pools if p.runner == "pooling" and p.name in a.kubernetes.domains):
        raise _FieldError(
            f"autoscaler.kubernetes.domains.{pooled}",
            f"pool {pooled!r} runs the pooling runner (embeddings), which the autoscaler does not scale",
        )
    _check_domains(a.kubernetes.deployments, a.kubernetes.domains, names)
    # The parameters parse (hpa-util:0.7, static:pool=N, ...), and `static:` counts lie within their pools'
    # configured bounds; the live policy is built by the controller (which also clamps every target to them).
    bounds = [
        PoolSpec(
            p.name,
            "",
            "prefill",
            "",
            0.0,
            p.min_replicas,
            max(64, p.min_replicas) if p.max_replicas is None else p.max_replicas,
            prefill_tps_capacity=1.0,
        )  # placeholders: only the bounds are read
        for p in config.pools
    ]
    try:
        build_policy(a.policy, bounds, PolicyConfig(), dict.fromkeys(names, 0), check_bounds=True)
    except PolicyError as exc:
        raise _FieldError("autoscaler.policy", str(exc)) from None
    if a.enabled and a.actuator in ("embedded", "dry-run"):
        _check_one_time_scale_per_model(config)
    if (
        a.enabled
        and a.actuator == "embedded"
        and not any(
            p.endpoints.simulated is not None or getattr(p.endpoints, "launch", None) is not None
            for p in config.pools
        )
    ):
        raise _FieldError(
            "autoscaler.actuator",
            "the embedded actuator scales simulated (or launched vLLM) "
            "pools and there is none; use kubernetes (mosaic autoscale) or dry-run",
        )


def _check_one_time_scale_per_model(config: MosaicConfig) -> None:
    """Simulated rates and latencies are converted to model time by the pool's time_scale; the gateway
    measures arrivals and latency per model, so one model's simulated pools must share one scale (the
    in-process controller, embedded or dry-run, reads them the same way)."""
    scales: dict[str, set[float]] = {}
    for pool in config.pools:
        if pool.endpoints.simulated is not None:
            scales.setdefault(pool.model, set()).add(pool.endpoints.simulated.time_scale)
    for model, found in scales.items():
        if len(found) > 1:
            raise _FieldError(
                "autoscaler",
                f"the simulated pools of model {model!r} mix time_scale values "
                f"{sorted(found)}; the in-process autoscaler ({config.autoscaler.actuator}) needs one per model",
            )


def _check_kv(config: MosaicConfig) -> None:
    """What the `kv` section can only check against the pools and limits (docs/kv.md "Knobs")."""
    kv = config.kv
    if kv.batch_admission.enabled and not kv.enabled:
        raise _FieldError(
            "kv.batch_admission.enabled",
            "batch admission plans against the KV ledger; it needs kv.enabled: true",
        )
    if not kv.enabled:
        return
    if kv.share is not None and config.gateway.peers is not None:
        raise _FieldError(
            "kv.share",
            "a fixed share and gateway.peers (a share of 1/N from the listed replicas) exclude each other; "
            "remove one",
        )
    pools = {p.name: p for p in config.pools}
    models = [m.name for m in config.model_configs()]
    for i, c in enumerate(kv.compression):
        if c.pool is not None:
            if c.pool not in pools:
                raise _FieldError(
                    f"kv.compression.{i}.pool", f"no pool named {c.pool!r}; pools: {', '.join(pools)}"
                )
            targets = [pools[c.pool]]
        else:
            if c.model not in models:
                raise _FieldError(
                    f"kv.compression.{i}.model", f"no model named {c.model!r}; models: {', '.join(models)}"
                )
            targets = [p for p in config.pools if p.model == c.model]
        # tp > 1: each rank's page tables hold its own heads (contiguous shards unless a layout file says)
        if c.tp_layout != "contiguous" and all(p.tp == 1 for p in targets):
            raise _FieldError(
                f"kv.compression.{i}.tp_layout",
                f"a TP layout says which heads each rank holds; no pool it applies to has tp > 1 "
                f"({', '.join(f'{p.name}: tp {p.tp}' for p in targets) or 'none'})",
            )
    limits = config.limits
    # A waiter's aging hold must come before its 429. The default (2 s) is left inert under a shorter
    # deadline; an explicit setting that can never act is refused.
    aging = kv.queue.aging_s
    if (
        aging is not None
        and not kv.batch_admission.enabled
        and "aging_s" in kv.queue.model_fields_set
        and aging >= limits.queue_deadline_s
    ):
        raise _FieldError(
            "kv.queue.aging_s",
            f"{aging:g} s must be below limits.queue_deadline_s ({limits.queue_deadline_s:g} s), or the "
            "waiter gets its 429 before its aging hold (null turns aging off)",
        )
    # A reservation is renewed by streamed tokens, but a non-streaming request renews it only once (at its
    # estimated first token) and may hold it for total_timeout_s; a stream may wait first_token_timeout_s
    # for its first byte and stall_timeout_s between chunks. The lease must outlast all of them, or the
    # sweep frees a live request's pages (lease_expired) and the ledger over-commits the worker.
    longest = max(limits.total_timeout_s, limits.first_token_timeout_s, limits.stall_timeout_s)
    if kv.lease_s <= longest:
        raise _FieldError(
            "kv.lease_s",
            f"{kv.lease_s:g} s must exceed the longest time a request holds KV pages without renewing "
            f"them, max(limits.total_timeout_s, first_token_timeout_s, stall_timeout_s) = {longest:g} s",
        )


def _check_domains(deployments: dict[str, str], domains: dict[str, dict[str, str]], names: list[str]) -> None:
    """`autoscaler.kubernetes.domains`: known pools, not also in `deployments`, each Deployment named once.
    (That the domains exist in `autoscaler.nodes` is checked where the inventory is read:
    `server.autoscale_placement.check_domains`.)"""
    owner = {name: f"deployments.{pool}" for pool, name in deployments.items()}
    for pool, by_domain in domains.items():
        loc = f"autoscaler.kubernetes.domains.{pool}"
        if pool not in names:
            raise _FieldError(loc, f"no pool named {pool!r}; pools: {', '.join(names)}")
        if pool in deployments:
            raise _FieldError(
                loc, f"pool {pool!r} is also in autoscaler.kubernetes.deployments; give one of the two"
            )
        if not by_domain:
            raise _FieldError(loc, "map at least one domain to a Deployment")
        for domain, name in by_domain.items():
            if not domain or not name:
                raise _FieldError(f"{loc}.{domain}", "domain and Deployment names must be non-empty")
            if name in owner:
                raise _FieldError(
                    f"{loc}.{domain}", f"Deployment {name!r} is already mapped by {owner[name]}"
                )
            owner[name] = f"domains.{pool}.{domain}"


class _FieldError(ValueError):
    def __init__(self, loc: str, msg: str) -> None:
        super().__init__(f"{loc}: {msg}")
        self.loc = loc
        self.msg = msg


def _unique(names: list[str], loc: str, what: str) -> None:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise _FieldError(f"{loc}.{i}.name", f"duplicate {what} {name!r}")
        seen.add(name)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"]
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldError | RoutingConfigError):
        return str(ctx_error)  # already names its field (RoutingConfigError: `routing.plugins[0] ...`)
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    return f"{loc}: {msg}".replace("\n", " ")


def validate_config(data: Any, source: str = "config") -> MosaicConfig:
    """Parsed YAML/JSON (a mapping) → MosaicConfig, checked against the catalog; `ConfigError` otherwise."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping of keys (models, pools, ...)")
    try:
        config = MosaicConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_first_error(exc)}") from None
    check_catalog(config, source)
    return config


def check_catalog(config: MosaicConfig, source: str = "config") -> Catalog:
    """Every pool's GPU and model resolve in the catalog (needed for capacity); returns the catalog."""
    try:
        catalog = load_catalog(config.catalog)
    except CatalogError as exc:
        raise ConfigError(f"{source}: catalog: {exc}") from None
    for i, pool in enumerate(config.pools):
        try:
            catalog.gpu(pool.gpu)
        except CatalogError as exc:
            raise ConfigError(f"{source}: pools.{i}.gpu: {exc}") from None
        spec = config.model_config_for(pool.model).spec_name
        try:
            model = catalog.model(spec)
        except CatalogError as exc:
            where = f"pools.{i}.model" if not config.models else f"models.{pool.model}.spec"
            raise ConfigError(f"{source}: {where}: {exc}; set models[].spec to a catalog model") from None
        tp_error = model.tp_error(pool.tp)  # vLLM would not start such a worker (`mosaic worker` refuses it)
        if tp_error is not None:
            raise ConfigError(f"{source}: pools.{i}.tp: {tp_error}")
        if pool.endpoints.kubernetes is not None and not math.isfinite(pool.endpoints.kubernetes.resync_s):
            raise ConfigError(f"{source}: pools.{i}.endpoints.kubernetes.resync_s: must be finite")
    return catalog


def load_config(path: str | Path) -> MosaicConfig:
    """Read and validate a YAML (or JSON) config file; `ConfigError` with one line on any problem."""
    p = Path(path)
    text = read_text(p, ConfigError, f"cannot read config file {p}: ")
    data = parse_yaml(text, ConfigError, f"{p}: not valid YAML")
    if isinstance(data, dict) and isinstance(catalog := data.get("catalog"), str) and catalog:
        # relative to the config file's folder, as `kv.compression[].profile` is, not to where mosaic started
        data = {**data, "catalog": str(p.absolute().parent / Path(catalog).expanduser())}
    config = validate_config(data, str(p))
    # absolute(), not resolve(): a config mounted from a ConfigMap is a symlink into a timestamped folder
    # that the next update of the ConfigMap removes; its siblings are reached through the mount's own links
    config._source_path = p.absolute()
    return config
