from __future__ import annotations

import re
from pathlib import Path

import pytest

from placement.catalog import CatalogError, GpuSpec, load_catalog

REQUIRED_GPUS = ["T4", "A10G", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-SXM", "H200", "MI300X"]
REQUIRED_MODELS = ["llama-2-7b", "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b", "qwen2.5-32b"]


def test_builtin_rows_present_with_sources() -> None:
    catalog = load_catalog()
    for name in REQUIRED_GPUS:
        gpu = catalog.gpu(name)
        assert gpu.memory_gb > 0 and gpu.hbm_gbps > 0 and gpu.tflops > 0 and gpu.cost_per_hour > 0
        assert gpu.source
    for name in REQUIRED_MODELS:
        assert catalog.model(name).source


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        pytest.param("llama-2-7b", 524_288, id="llama-2-7b MHA: 2·32·32·128·2 = 512 KiB per token"),
        pytest.param("llama-3-8b", 131_072, id="llama-3-8b GQA: 2·32·8·128·2 = 128 KiB per token"),
        pytest.param("qwen2.5-7b", 57_344, id="qwen2.5-7b: 2·28·4·128·2 = 56 KiB per token"),
    ],
)
def test_kv_bytes_per_token(model: str, expected: int) -> None:
    assert load_catalog().model(model).kv_bytes_per_token == expected


def test_aliases_and_case() -> None:
    catalog = load_catalog()
    assert catalog.gpu("h100").name == "H100-SXM"
    assert catalog.gpu("A100").name == "A100-80GB"
    assert catalog.model("meta-llama/Meta-Llama-3-8B-Instruct").name == "llama-3-8b"


@pytest.mark.parametrize(
    "name",
    ["meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"],
)
def test_llama_3_1_is_its_own_row_with_128k_context(name: str) -> None:
    """Llama-3.1 has Llama-3's shapes but a 128k context (it was aliased to llama-3-8b, 8k: a fleet of it was
    sized and simulated as if no request could pass 8,192 tokens)."""
    catalog = load_catalog()
    spec = catalog.model(name)
    assert (spec.name, spec.max_context) == ("llama-3.1-8b", 131_072)
    assert spec.kv_bytes_per_token == catalog.model("llama-3-8b").kv_bytes_per_token
    assert catalog.model("meta-llama/Llama-3.1-70B-Instruct").max_context == 131_072


def test_unknown_names_list_valid_choices() -> None:
    catalog = load_catalog()
    with pytest.raises(CatalogError, match="valid GPUs: T4, A10G"):
        catalog.gpu("B200")
    with pytest.raises(CatalogError, match="llama-3-8b"):
        catalog.model("gpt-5")


def test_yaml_overrides_and_additions(tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "gpus:\n  l4: {cost_per_hour: 0.5}\n"
        "  RTX-6000-Ada: {memory_gb: 48, hbm_gbps: 960, tflops: 364, cost_per_hour: 1.4, memory_kind: gddr}\n"
        "models:\n  tiny: {layers: 2, hidden_size: 128, num_heads: 4, num_kv_heads: 2, head_dim: 32,"
        " params_b: 0.0008, max_context: 512}\n"
    )
    catalog = load_catalog(path)
    assert catalog.gpu("L4").cost_per_hour == 0.5
    assert catalog.gpu("L4").memory_gb == 24  # untouched fields keep the built-in value
    assert catalog.gpu("rtx-6000-ada").tflops == 364
    assert catalog.model("tiny").kv_bytes_per_token == 2 * 2 * 2 * 32 * 2


def test_interconnect_fields_default_and_override(tmp_path: Path) -> None:
    catalog = load_catalog()
    assert (catalog.gpu("H100-SXM").allreduce_latency_us, catalog.gpu("H100-SXM").allreduce_gbps) == (46, 320)
    assert catalog.gpu("H200").allreduce_gbps == catalog.gpu("H100-SXM").allreduce_gbps  # same NVLink4
    assert catalog.gpu("A100-80GB").allreduce_gbps == 90
    assert catalog.gpu("L4").allreduce_gbps < catalog.gpu("A100-80GB").allreduce_gbps  # PCIe, no NVLink
    # positional construction (fields up to `source`) still works; the interconnect takes the PCIe defaults
    spec = GpuSpec("X", 24, 300, 121, 0.7, "gddr", None, None, "a source")
    assert (spec.source, spec.allreduce_latency_us, spec.allreduce_gbps) == ("a source", 100.0, 16.0)
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "gpus:\n  h100: {allreduce_gbps: 400}\n"
        "  RTX-6000-Ada: {memory_gb: 48, hbm_gbps: 960, tflops: 364, cost_per_hour: 1.4,"
        " allreduce_latency_us: 80, allreduce_gbps: 12}\n"
    )
    overridden = load_catalog(path)
    assert overridden.gpu("H100-SXM").allreduce_gbps == 400
    assert overridden.gpu("H100-SXM").allreduce_latency_us == 46  # untouched field keeps the built-in value
    assert (
        overridden.gpu("rtx-6000-ada").allreduce_latency_us,
        overridden.gpu("rtx-6000-ada").allreduce_gbps,
    ) == (
        80,
        12,
    )


def test_bad_catalog_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("gpus:\n  L4: {bandwidth: 3}\n")
    with pytest.raises(CatalogError, match="unknown fields \\['bandwidth'\\]"):
        load_catalog(path)
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(
            "gpus: {L4: {memory_gb: abc}}\n",
            "memory_gb must be a finite number > 0, got 'abc'",
            id="a string where a number goes",
        ),
        pytest.param(
            "gpus: {L4: {hbm_gbps: 0}}\n", "hbm_gbps must be a finite number > 0, got 0", id="zero bandwidth"
        ),
        pytest.param(
            "gpus: {L4: {hbm_gbps: -5}}\n", "hbm_gbps must be a finite number > 0", id="negative bandwidth"
        ),
        pytest.param(
            "gpus: {H100: {allreduce_gbps: 0}}\n",
            "allreduce_gbps must be a finite number > 0, got 0",
            id="zero all-reduce bandwidth",
        ),
        pytest.param(  # YAML's .nan and .inf: the perf model worked on with them (a worker served)
            "gpus: {A100-80GB: {hbm_gbps: .nan}}\n", "hbm_gbps must be a finite number > 0, got nan", id="NaN"
        ),
        pytest.param("gpus: {L4: {tflops: .inf}}\n", "tflops must be a finite number > 0, got inf", id="inf"),
        pytest.param(
            "models: {llama-3-8b: {params_b: .nan}}\n",
            "params_b must be a finite number > 0, got nan",
            id="a NaN model size (was 'cannot convert float NaN to integer')",
        ),
        pytest.param(
            "gpus: {L4: {allreduce_latency_us: -3}}\n",
            "allreduce_latency_us must be a finite number > 0, got -3",
            id="negative all-reduce latency",
        ),
        pytest.param(
            "gpus: {L4: {allreduce_gbps: fast}}\n",
            "allreduce_gbps must be a finite number > 0, got 'fast'",
            id="a word for the all-reduce bandwidth",
        ),
        pytest.param("gpus: [1, 2]\n", "'gpus' must be a mapping", id="a list instead of a mapping"),
        pytest.param(
            "gpus: {L4: {memory_kind: sram}}\n",
            "memory_kind must be 'hbm' or 'gddr'",
            id="unknown memory kind",
        ),
        pytest.param(
            "models: {m: {layers: 2.5, hidden_size: 8, num_heads: 1, num_kv_heads: 1, head_dim: 8,"
            " params_b: 1, max_context: 64}}\n",
            "layers must be a whole number",
            id="fractional layers",
        ),
        pytest.param("models: {m: {layers: 2}}\n", "missing", id="a new model without its fields"),
    ],
)
def test_bad_catalog_values_are_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(CatalogError, match=re.escape(message)):
        load_catalog(path)


def test_a_new_row_missing_fields_names_them_not_pythons_constructor(tmp_path: Path) -> None:
    path = tmp_path / "new.yaml"
    path.write_text("gpus:\n  NEW: {memory_gb: 48}\nmodels:\n  tiny: {layers: 2, hidden_size: 64}\n")
    with pytest.raises(CatalogError) as err:
        load_catalog(path)
    assert str(err.value) == (
        "catalog entry 'NEW': missing fields ['hbm_gbps', 'tflops', 'cost_per_hour'] "
        "(a new entry needs memory_gb, hbm_gbps, tflops, cost_per_hour)"
    )
    path.write_text("models:\n  tiny: {layers: 2, hidden_size: 64}\n")
    with pytest.raises(CatalogError, match=r"^catalog entry 'tiny': missing fields \['num_heads', "):
        load_catalog(path)
    path.write_text("models:\n  llama-3-8b: {max_context: 4096}\n")  # an override of a built-in row
    assert load_catalog(path).model("llama-3-8b").max_context == 4096
