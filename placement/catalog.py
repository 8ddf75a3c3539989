"""GPU catalog and model specs: the facts the perf model, the planner and the router reason over.

Built-in rows carry a source comment each; users add or override rows from YAML (`load_catalog(path)`):

```yaml
gpus:
  L4: {cost_per_hour: 0.62}            # override one field of a built-in row
  RTX-6000-Ada: {memory_gb: 48, hbm_gbps: 960, tflops: 364, cost_per_hour: 1.4, memory_kind: gddr}
  GB200: {memory_gb: 186, hbm_gbps: 8000, tflops: 2500, cost_per_hour: 10,
          allreduce_latency_us: 46, allreduce_gbps: 320}   # tensor-parallel interconnect (NVLink); default PCIe Gen4
models:
  my-llama: {layers: 32, hidden_size: 4096, num_heads: 32, num_kv_heads: 8, head_dim: 128,
             params_b: 8.03, max_context: 8192}
```
Names are matched case-insensitively; common aliases (`H100` → `H100-SXM`, `A100` → `A100-80GB`) resolve.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from placement.textfiles import parse_yaml, read_text


class CatalogError(ValueError):
    """An unknown name or a malformed catalog file; the message lists the valid choices."""


def _number(value: object) -> bool:
    """A finite int or float, not a bool (YAML's `.nan` and `.inf` are floats the perf model cannot use)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive(row: str, field_name: str, value: object, allow_zero: bool = False) -> None:
    if not _number(value) or value < 0 or (value == 0 and not allow_zero):  # type: ignore[operator]
        bound = "≥ 0" if allow_zero else "> 0"
        raise ValueError(f"{row!r}: {field_name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_gb: float  # GB (1e9 bytes) of device memory
    hbm_gbps: float  # peak memory bandwidth, GB/s
    tflops: float  # dense bf16 (fp16 where no bf16) TFLOP/s, no sparsity
    cost_per_hour: float  # typical on-demand $ per GPU-hour
    memory_kind: str = "hbm"  # "hbm" | "gddr": decode bandwidth efficiency differs
    # Tokens per step at which prefill reaches half its peak MFU (closed-form MFU ramp, REFERENCE.md).
    # None: derived from the GPU's ridge point (FLOP per byte), see `mfu_half_tokens`.
    mfu_half: float | None = None
    # Plateau MFU of large prefills; None → PerfConstants.mfu_max. Calibrated for A100 and H100 only.
    mfu_max: float | None = None
    source: str = ""
    # Tensor-parallel interconnect, as the perf model's all-reduce term sees it (REFERENCE.md, "Roofline
    # perf model"): latency of one all-reduce per log2(tp) step, µs, and the effective all-reduce link
    # bandwidth, GB/s (far below the nominal link rate: fitted end to end, NCCL + launch overheads included).
    # The defaults are the conservative PCIe Gen4 figures of the built-in PCIe rows (unverified).
    allreduce_latency_us: float = 100.0
    allreduce_gbps: float = 16.0

    def __post_init__(self) -> None:
        for field_name in ("memory_gb", "hbm_gbps", "tflops", "allreduce_latency_us", "allreduce_gbps"):
            _positive(self.name, field_name, getattr(self, field_name))
        _positive(self.name, "cost_per_hour", self.cost_per_hour, allow_zero=True)
        if self.memory_kind not in ("hbm", "gddr"):
            raise ValueError(
                f"GPU {self.name!r}: memory_kind must be 'hbm' or 'gddr', got {self.memory_kind!r}"
            )
        if self.mfu_half is not None:
            _positive(self.name, "mfu_half", self.mfu_half)
        if self.mfu_max is not None and not (_number(self.mfu_max) and 0 < self.mfu_max <= 1):
            raise ValueError(f"GPU {self.name!r}: mfu_max must be in (0, 1], got {self.mfu_max!r}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def mfu_half_tokens(self) -> float:
        if self.mfu_half is not None:
            return self.mfu_half
        # A100: ridge 153 FLOP/B ↔ 60 tokens; H100: ridge 295 ↔ 200. Interpolate linearly in the ridge.
        ridge = self.tflops * 1e12 / (self.hbm_gbps * 1e9)
        return max(30.0, 60.0 + (ridge - 153.0) * (140.0 / 142.0))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params_b: float  # parameters, billions
    max_context: int
    dtype_bytes: int = 2
    source: str = ""
    # config.json's vocab_size: token ids from 0 to vocab_size − 1 exist (the simulated worker refuses others
    # with vLLM's 400); None = not known (the simulator then allows Llama-3's 128,256)
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.vocab_size is not None and (
            not isinstance(self.vocab_size, int) or isinstance(self.vocab_size, bool) or self.vocab_size < 1
        ):
            raise ValueError(
                f"model {self.name!r}: vocab_size must be a whole number ≥ 1, got {self.vocab_size!r}"
            )
        for field_name in (
            "layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_context",
            "dtype_bytes",
        ):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"model {self.name!r}: {field_name} must be a whole number ≥ 1, got {value!r}"
                )
        _positive(self.name, "params_b", self.params_b)

    @property
    def params(self) -> float:
        return self.params_b * 1e9

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) · layers · kv_heads · head_dim · dtype_bytes (DESIGN.md, KV budget)."""
        return 2 * self.layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def tp_error(self, tp: int) -> str | None:
        """vLLM's start-up refusal of a tensor-parallel size that does not divide the attention heads, in its
        words; None when `tp` is one vLLM takes."""
        if self.num_heads % tp:
            return (
                f"Total number of attention heads ({self.num_heads}) must be divisible by tensor parallel "
                f"size ({tp})."
            )
        return None


# Tensor-parallel interconnects: GpuSpec.allreduce_latency_us (µs per all-reduce per log2(tp) step) and
# allreduce_gbps (effective all-reduce bandwidth, GB/s). NVLink3/4: fitted to splitwise-sim's Llama-2-70B
# TP2/4/8 prefill and decode on DGX A100-80GB / H100 (../shared/data/calibration/splitwise_sim_perf_model.csv;
# tests/placement/test_perf_model.py). The latency ratio 64/46 ≈ NVLink's bandwidth ratio 900/600. The
# bandwidths are effective rates, not link rates: A100's 90 GB/s also absorbs the compute efficiency TP4/8
# lose on narrower GEMMs; H100's 320 GB/s is bounded below by TP2, whose prefills show no communication cost
# beyond what the TP2-calibrated MFU already holds (140 GB/s, the unconstrained fit, puts the TP2 512-token
# prefill at +27%).
_NVLINK3 = {"allreduce_latency_us": 64.0, "allreduce_gbps": 90.0}  # DGX A100 (NVLink3 + NVSwitch, 600 GB/s)
_NVLINK4 = {"allreduce_latency_us": 46.0, "allreduce_gbps": 320.0}  # DGX H100 (NVLink4 + NVSwitch, 900 GB/s)
# PCIe, no NVLink (unverified): PCIe Gen4 x16 is 32 GB/s a direction, Gen3 16 GB/s; NCCL rings reach ~20
# GB/s (Gen4) of bus bandwidth with peer-to-peer, ~10 without (through the host); taken as 16 / 8 GB/s
# effective, with about twice the NVLink latency. tp > 1 on these parts costs far more than on NVLink, as it
# does in practice. The GpuSpec defaults (rows added from YAML that do not set them) are the Gen4 figures:
# set both fields for a GPU with NVLink.
_PCIE4 = {"allreduce_latency_us": 100.0, "allreduce_gbps": 16.0}
_PCIE3 = {"allreduce_latency_us": 100.0, "allreduce_gbps": 8.0}
# MI300X: Infinity Fabric, 896 GB/s aggregate a GPU (AMD), H100-class on paper; RCCL's small-message latency
# is higher than NCCL's, so the A100 NVLink3 fit is taken (unverified).
_INFINITY_FABRIC = {"allreduce_latency_us": 64.0, "allreduce_gbps": 90.0}

# fmt: off
_BUILTIN_GPUS: tuple[GpuSpec, ...] = (
    # NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, 65 TFLOP/s fp16 (no bf16); AWS g4dn price (unverified)
    GpuSpec("T4", 16, 320, 65, 0.53, "gddr", None, None, "NVIDIA T4 datasheet; AWS g4dn.xlarge on-demand", **_PCIE3),
    # NVIDIA A10G (AWS): 24 GB GDDR6, 600 GB/s, 125 TFLOP/s; $1.01/h AWS g5.xlarge as used by Mélange
    GpuSpec("A10G", 24, 600, 125, 1.01, "gddr", None, None, "AWS A10G spec; Mélange (arXiv 2404.14527) price", **_PCIE4),
    # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOP/s bf16 dense; GCP g2 price (unverified)
    GpuSpec("L4", 24, 300, 121, 0.70, "gddr", None, None, "NVIDIA L4 datasheet; GCP g2-standard-4 on-demand", **_PCIE4),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 362 TFLOP/s bf16 dense; AWS g6e price (unverified)
    GpuSpec("L40S", 48, 864, 362, 1.85, "gddr", None, None, "NVIDIA L40S datasheet; AWS g6e per-GPU on-demand", **_PCIE4),
    # A40: a 2-GPU NVLink bridge exists, but cloud A40s are PCIe-only: PCIe Gen4 figures (unverified).
    # NVIDIA A40 datasheet: 48 GB GDDR6, 696 GB/s, 150 TFLOP/s; CoreWeave price as used by Vidur
    GpuSpec("A40", 48, 696, 150, 1.28, "gddr", None, None, "NVIDIA A40 datasheet; CoreWeave price (Vidur)", **_PCIE4),
    # A100 40GB SXM: NVLink3 as the 80GB part (same DGX/HGX fabric), so its interconnect fit.
    # NVIDIA A100 40GB SXM datasheet: 1,555 GB/s, 312 TFLOP/s; AWS p4d.24xlarge / 8 (unverified)
    GpuSpec("A100-40GB", 40, 1555, 312, 4.10, "hbm", 60, 0.66, "NVIDIA A100 datasheet; AWS p4d.24xlarge/8", **_NVLINK3),
    # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s, 312 TFLOP/s; $3.67/h Azure NC24ads (Mélange)
    GpuSpec("A100-80GB", 80, 2039, 312, 3.67, "hbm", 60, 0.66, "NVIDIA A100 datasheet; Mélange price (Azure)", **_NVLINK3),
    # H100: splitwise-sim's Llama-2-70B TP2 prefills and Lambda's Llama-3-8B TTFT put vLLM at ~47% MFU.
    # NVIDIA H100 SXM datasheet: 80 GB HBM3, 3,350 GB/s, 989 TFLOP/s bf16 dense; CoreWeave (Vidur)
    GpuSpec("H100-SXM", 80, 3350, 989, 4.25, "hbm", 120, 0.50, "NVIDIA H100 datasheet; CoreWeave price (Vidur)", **_NVLINK4),
    # H200: NVLink4 + NVSwitch as H100 SXM (HGX H200), so H100's interconnect fit.
    # NVIDIA H200 datasheet: 141 GB HBM3e, 4,800 GB/s, 989 TFLOP/s; AWS p5e capacity block (unverified)
    GpuSpec("H200", 141, 4800, 989, 5.41, "hbm", 120, 0.50, "NVIDIA H200 datasheet; AWS p5e capacity block/8", **_NVLINK4),
    # MI300X: ROCm vLLM reaches a lower MFU than CUDA on dense GEMMs (0.45, unverified).
    # AMD MI300X datasheet: 192 GB HBM3, 5,300 GB/s, 1,307 TFLOP/s bf16 dense; marketplace (unverified)
    GpuSpec("MI300X", 192, 5300, 1307, 1.80, "hbm", None, 0.45, "AMD MI300X datasheet; GPU marketplace price", **_INFINITY_FABRIC),
)

_BUILTIN_MODELS: tuple[ModelSpec, ...] = (
    # meta-llama/Llama-2-7b-hf config.json: MHA, 4k context
    ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 6.74, 4096, 2, "meta-llama/Llama-2-7b-hf config.json", vocab_size=32000),
    # meta-llama/Llama-2-70b-hf config.json: GQA 8 KV heads (used by splitwise-sim's calibration data)
    ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, 68.98, 4096, 2, "meta-llama/Llama-2-70b-hf config.json", vocab_size=32000),
    # meta-llama/Meta-Llama-3-8B config.json: GQA 8 KV heads, 8k context
    ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 8.03, 8192, 2, "meta-llama/Meta-Llama-3-8B config.json", vocab_size=128256),
    # meta-llama/Meta-Llama-3-70B config.json
    ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 70.55, 8192, 2, "meta-llama/Meta-Llama-3-70B config.json", vocab_size=128256),
    # meta-llama/Llama-3.1-8B config.json: Llama-3-8B's shapes, 128k context (max_position_embeddings 131072)
    ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 8.03, 131072, 2, "meta-llama/Llama-3.1-8B config.json", vocab_size=128256),
    # meta-llama/Llama-3.1-70B config.json: Llama-3-70B's shapes, 128k context
    ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 70.55, 131072, 2, "meta-llama/Llama-3.1-70B config.json", vocab_size=128256),
    # mistralai/Mistral-7B-Instruct-v0.2 config.json: 32k context, no sliding window
    ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 7.24, 32768, 2, "mistralai/Mistral-7B-Instruct-v0.2 config.json", vocab_size=32000),
    # Qwen/Qwen2.5-7B config.json: 28 layers, 28 heads, 4 KV heads, 32k native context
    ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 7.62, 32768, 2, "Qwen/Qwen2.5-7B config.json", vocab_size=152064),
    # Qwen/Qwen2.5-32B config.json: 64 layers, 40 heads, 8 KV heads
    ModelSpec("qwen2.5-32b", 64, 5120, 40, 8, 128, 32.76, 32768, 2, "Qwen/Qwen2.5-32B config.json", vocab_size=152064),
)
# fmt: on

_GPU_ALIASES = {"H100": "H100-SXM", "H100-80GB": "H100-SXM", "A100": "A100-80GB", "A100-80G": "A100-80GB"}
_MODEL_ALIASES = {
    "meta-llama/llama-2-7b-hf": "llama-2-7b",
    "meta-llama/llama-2-70b-hf": "llama-2-70b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b",
    "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b",
    # Hugging Face renamed the 3.1 repos (Meta-Llama-3.1-8B → Llama-3.1-8B): both names are in use
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/meta-llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/meta-llama-3.1-70b-instruct": "llama-3.1-70b",
    "mistralai/mistral-7b-instruct-v0.2": "mistral-7b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen2.5-32b": "qwen2.5-32b",
}


@dataclass(slots=True)
class Catalog:
    """GPU and model rows by canonical name; lookups are case-insensitive and alias-aware."""

    gpus: dict[str, GpuSpec] = field(default_factory=dict)
    models: dict[str, ModelSpec] = field(default_factory=dict)

    def gpu(self, name: str) -> GpuSpec:
        found = _lookup(self.gpus, _GPU_ALIASES, name)
        if found is None:
            raise CatalogError(f"unknown GPU {name!r}; valid GPUs: {', '.join(self.gpus)}")
        return found

    def model(self, name: str) -> ModelSpec:
        found = _lookup(self.models, _MODEL_ALIASES, name)
        if found is None:
            raise CatalogError(f"unknown model {name!r}; valid models: {', '.join(self.models)}")
        return found

    def with_overrides(self, data: dict[str, Any]) -> Catalog:
        """A new catalog with `gpus:` / `models:` rows from parsed YAML merged over this one."""
        if not isinstance(data, dict) or set(data) - {"gpus", "models"}:
            raise CatalogError("catalog file must be a mapping with only 'gpus' and 'models' keys")
        for section in ("gpus", "models"):
            if not isinstance(data.get(section) or {}, dict):
                raise CatalogError(f"catalog file: '{section}' must be a mapping of name → fields")
        gpus = dict(self.gpus)
        models = dict(self.models)
        for name, row in (data.get("gpus") or {}).items():
            gpus[_canonical(gpus, _GPU_ALIASES, name)] = _merge(GpuSpec, gpus, _GPU_ALIASES, name, row)
        for name, row in (data.get("models") or {}).items():
            models[_canonical(models, _MODEL_ALIASES, name)] = _merge(
                ModelSpec, models, _MODEL_ALIASES, name, row
            )
        return Catalog(gpus, models)


def _lookup(rows: dict[str, Any], aliases: dict[str, str], name: str) -> Any:
    key = _canonical(rows, aliases, name)
    return rows.get(key)


def _canonical(rows: dict[str, Any], aliases: dict[str, str], name: str) -> str:
    lowered = {k.lower(): k for k in rows}
    name = str(name)
    if name.lower() in lowered:
        return lowered[name.lower()]
    for alias, target in aliases.items():
        if alias.lower() == name.lower():
            return target
    return name


def _merge(cls: type, rows: dict[str, Any], aliases: dict[str, str], name: str, row: Any) -> Any:
    if not isinstance(row, dict):
        raise CatalogError(f"catalog entry {name!r} must be a mapping of fields")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(row) - fields
    if unknown:
        raise CatalogError(
            f"catalog entry {name!r}: unknown fields {sorted(unknown)}; valid: {sorted(fields)}"
        )
    existing = rows.get(_canonical(rows, aliases, name))
    if existing is None:  # a new row needs every field without a default (named, not Python's TypeError)
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name != "name"
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        missing = [f for f in required if f not in row]
        if missing:
            raise CatalogError(
                f"catalog entry {name!r}: missing fields {missing} (a new entry needs {', '.join(required)})"
            )
    try:
        if existing is not None:
            return dataclasses.replace(existing, **row)
        return cls(name=name, **row)
    except (TypeError, ValueError) as exc:  # missing fields, wrong types, out-of-range values
        raise CatalogError(f"catalog entry {name!r}: {exc}") from None


def builtin_catalog() -> Catalog:
    return Catalog({g.name: g for g in _BUILTIN_GPUS}, {m.name: m for m in _BUILTIN_MODELS})


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The built-in catalog, with the rows of the YAML file at `path` (if any) merged over it."""
    catalog = builtin_catalog()
    if path is None:
        return catalog
    text = read_text(Path(path), CatalogError, f"cannot read catalog file {path}: ")
    data = parse_yaml(text, CatalogError, f"catalog file {path} is not valid YAML") or {}
    return catalog.with_overrides(data)
