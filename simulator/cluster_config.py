"""The fleet a cluster simulation runs: pools of engine-model instances, timing knobs, SLO (YAML → pydantic).

```yaml
model: llama-3-8b
slo: {ttft_ms: 2000, tpot_ms: 100}
cold_start_s: 120          # instance start → ready (image pull, weight load, CUDA graphs)
drain_timeout_s: 600       # optional grace period of a draining instance, then removed (its requests aborted)
decision_interval_s: 15    # autoscaler cycle
scrape_interval_s: 1       # how fresh the router's scraped stats are
kv_link_gbps: 25           # prefill → decode KV transfer bandwidth (GB/s), within one network domain
kv_link_cross_domain_gbps: 6.25   # … between domains (default: kv_link_gbps)
nodes: nodes.yaml          # optional node inventory (`mosaic plan --nodes` format; path relative to this file,
                           # or inline): instances are placed topology-aware (simulator/cluster_topology.py)
routing: {policy: mosaic}  # the router's config (scheduler.routing.config.RoutingConfig)
engine: {max_num_seqs: 256, max_num_batched_tokens: 8192}
autoscaler: {utilization_target: 0.8, pd_ratio: 0.5}
pools:
  - {name: prefill-h100, gpu: H100, role: prefill, replicas: 1, min_replicas: 1, max_replicas: 8}
  - {name: decode-a100, gpu: A100-80GB, role: decode, replicas: 2, min_replicas: 1, max_replicas: 16}
  - {name: mixed-l4-dp2, gpu: L4, tp: 1, dp: 2, replicas: 1}   # 2 engines per instance (on 2 GPUs)
```

A pool's `tp` is the GPUs per engine (vLLM's `--tensor-parallel-size`) and `dp` the engines per instance,
behind its one API server (vLLM's `--data-parallel-size`), each with the `engine:` knobs and its own KV
cache: an instance is dp engines' capacity and price on tp × dp GPUs of one node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from placement.catalog import Catalog, CatalogError, load_catalog
from placement.perf_model import PerfModel
from placement.profiles import read_structured
from placement.textfiles import parse_yaml, read_text
from scheduler.autoscaler.capacity import decode_tps_within_slo as decode_tps_within_slo  # moved; re-exported
from scheduler.autoscaler.capacity import instance_capacity, no_decode_reason
from scheduler.autoscaler.policy import AutoscalerConfig
from scheduler.autoscaler.signals import PoolSpec
from scheduler.fleet import prefill_only_models


class FleetConfigError(ValueError):
    """A fleet file that cannot be simulated; the message names the field."""


class _Strict(BaseModel):
    # A NaN interval or rate is a typo, and so is `replicas: yes` or a quoted "3" (lax mode reads them as 1, 3).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# Instances per pool: each is a simulated engine stepped per event, and Kubernetes pools past this are rare.
MAX_POOL_REPLICAS = 1_000


class SloSpec(_Strict):
    ttft_ms: float = Field(default=2000.0, gt=0)
    tpot_ms: float = Field(default=100.0, gt=0)


class EngineKnobs(_Strict):
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    block_size: int = Field(default=16, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    num_gpu_blocks: int | None = Field(default=None, ge=2)  # one is vLLM's null block

    @model_validator(mode="after")
    def _batch_fits_seqs(self) -> EngineKnobs:
        # as vLLM's SchedulerConfig (and simulator.engine_types.EngineConfig): every running decode must fit
        # one step's token budget
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be ≥ max_num_seqs "
                f"({self.max_num_seqs}); lower max_num_seqs or raise max_num_batched_tokens"
            )
        return self


class PoolConfig(_Strict):
    name: str
    gpu: str
    role: Literal["prefill", "decode", "mixed"] = "mixed"
    model: str | None = None  # defaults to the fleet's model
    tp: int = Field(default=1, ge=1)  # GPUs per engine
    dp: int = Field(default=1, ge=1)  # engines per instance (data parallelism), each on its own tp GPUs
    replicas: int = Field(default=1, ge=0, le=MAX_POOL_REPLICAS)
    min_replicas: int = Field(default=0, ge=0, le=MAX_POOL_REPLICAS)
    max_replicas: int = Field(default=64, ge=0, le=MAX_POOL_REPLICAS)
    cost_per_hour: float | None = Field(
        default=None, gt=0
    )  # per instance; default: catalog $/GPU-h · tp · dp
    domain: str | None = None

    @field_validator("name")
    @classmethod
    def _not_the_time_key(cls, name: str) -> str:
        if name == "t":  # a sample is {"t": time, <pool>: count}: this pool's count overwrote the time
            raise ValueError("pool name 't' is reserved: it is the time key of the report's replicas series")
        return name

    @model_validator(mode="after")
    def _bounds(self) -> PoolConfig:
        if not self.min_replicas <= self.max_replicas:
            raise ValueError(f"pool {self.name}: min_replicas must be ≤ max_replicas")
        # Starting under min_replicas is allowed (the policy raises the pool, as an HPA would); over max is not.
        if self.replicas > self.max_replicas:
            raise ValueError(
                f"pool {self.name}: replicas ({self.replicas}) must be ≤ max_replicas ({self.max_replicas})"
            )
        return self


class FleetConfig(_Strict):
    model: str = "llama-3-8b"
    slo: SloSpec = SloSpec()
    cold_start_s: float = Field(default=120.0, ge=0)
    decision_interval_s: float = Field(default=15.0, ge=1e-3)  # ≥ 1 ms: t + interval must move the clock
    scrape_interval_s: float = Field(default=1.0, ge=1e-3)
    # ≥ 1 MB/s: below it a prompt's KV takes days to cross, and the run's scrapes and decisions tick on until
    # it lands (1e-300 GB/s ran for ever without a word)
    kv_link_gbps: float = Field(default=25.0, ge=1e-3)
    kv_link_cross_domain_gbps: float | None = Field(default=None, ge=1e-3)
    nodes: dict[str, Any] | None = None  # node inventory (a path is read by `parse_fleet`)
    admission_queue_size: int = Field(default=100_000, ge=0)
    admission_deadline_s: float = Field(default=600.0, gt=0)
    # Kubernetes' terminationGracePeriodSeconds: a draining instance still serving this long after scale-in
    # chose it is removed anyway, aborting what it still runs. None: wait until it is empty (nothing aborted).
    drain_timeout_s: float | None = Field(default=None, gt=0)
    routing: dict[str, Any] = Field(default_factory=dict)
    engine: EngineKnobs = EngineKnobs()
    autoscaler: dict[str, Any] = Field(default_factory=dict)
    pools: list[PoolConfig] = Field(min_length=1)
    seed: int = 0

    @model_validator(mode="after")
    def _unique(self) -> FleetConfig:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError("pool names must be unique")
        for model, only in prefill_only_models(
            (p.name, p.model or self.model, p.role) for p in self.pools
        ).items():
            raise ValueError(
                f"model {model!r} has only prefill pools ({', '.join(only)}): a prefill instance does not "
                "finish a request; add a decode or mixed pool"
            )
        return self

    @field_validator("autoscaler")
    @classmethod
    def _knobs(cls, knobs: dict[str, Any]) -> dict[str, Any]:
        """Checked when the file is read, so the error names it and the knob (valid ones listed)."""
        AutoscalerConfig.from_knobs(knobs)
        return knobs

    def autoscaler_config(self) -> AutoscalerConfig:
        data = {"ttft_slo_s": self.slo.ttft_ms / 1e3, "tpot_slo_s": self.slo.tpot_ms / 1e3, **self.autoscaler}
        try:
            return AutoscalerConfig.from_knobs(data)
        except ValueError as exc:
            raise FleetConfigError(f"autoscaler: {exc}") from None


def load_fleet(path: str | Path) -> FleetConfig:
    text = read_text(Path(path), FleetConfigError, f"cannot read fleet file {path}: ")
    data = parse_yaml(text, FleetConfigError, f"fleet file {path} is not valid YAML")
    return parse_fleet(data, str(path), Path(path).parent)


def parse_fleet(data: Any, source: str = "fleet", base_dir: Path | None = None) -> FleetConfig:
    """Validate a fleet mapping; `nodes: FILE` is read here, relative to `base_dir` (the fleet file's folder)."""
    if isinstance(data, dict) and isinstance(data.get("nodes"), str):
        nodes = Path(data["nodes"])
        if not nodes.is_absolute() and base_dir is not None:
            nodes = base_dir / nodes
        data = {**data, "nodes": read_structured(nodes, FleetConfigError)}
    try:
        return FleetConfig.model_validate(data or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = str(err["msg"]).removeprefix("Value error, ")  # pydantic's wording around a validator's own
        raise FleetConfigError(f"{source}: {where}: {msg}") from None


def pool_specs(fleet: FleetConfig, catalog: Catalog | None = None, context: int = 1024) -> list[PoolSpec]:
    """Autoscaler `PoolSpec`s with capacities from the perf model within the fleet's SLO: one engine's (its
    sequences, its KV cache), times the pool's `dp` engines per instance (`InstanceCapacity.times`, as the
    gateway's `server.autoscaler_setup.pool_spec`)."""
    cat = catalog or load_catalog()
    specs = []
    for pool in fleet.pools:
        try:
            gpu, model = cat.gpu(pool.gpu), cat.model(pool.model or fleet.model)
        except CatalogError as exc:
            raise FleetConfigError(f"pool {pool.name}: {exc}") from None
        tp_error = model.tp_error(pool.tp)  # vLLM would not start such an instance (its own check and words)
        if tp_error is not None:
            raise FleetConfigError(f"pool {pool.name}: tp {pool.tp}: {tp_error}")
        perf = PerfModel(gpu, model, pool.tp)
        kv_tokens = (
            fleet.engine.num_gpu_blocks
            or perf.kv_capacity_blocks(fleet.engine.gpu_memory_utilization, fleet.engine.block_size)
        ) * fleet.engine.block_size
        cap = instance_capacity(
            perf,
            tpot_s=fleet.slo.tpot_ms / 1e3,
            context=context,
            max_num_seqs=fleet.engine.max_num_seqs,
            kv_tokens=kv_tokens,
            max_num_batched_tokens=fleet.engine.max_num_batched_tokens,
        ).times(pool.dp)
        decode, prefill = cap.decode_tps, cap.prefill_tps
        if pool.role in ("decode", "mixed") and decode <= 0:
            why = no_decode_reason(perf, fleet.slo.tpot_ms / 1e3, context, kv_tokens)
            raise FleetConfigError(
                f"pool {pool.name}: {gpu.name} cannot decode {model.name} within TPOT {fleet.slo.tpot_ms} ms: {why}"
            )
        specs.append(
            PoolSpec(
                name=pool.name,
                model=model.name,
                role=pool.role,
                gpu=gpu.name,
                cost_per_hour=pool.cost_per_hour or gpu.cost_per_hour * pool.tp * pool.dp,
                min_replicas=pool.min_replicas,
                max_replicas=pool.max_replicas,
                decode_tps_capacity=decode if pool.role != "prefill" else 0.0,
                decode_tps_by_context=cap.decode_by_context if pool.role != "prefill" else (),
                prefill_tps_capacity=prefill,
                domain=pool.domain,
            )
        )
    return specs
