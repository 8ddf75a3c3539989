"""Gateway config: every documented example loads; bad configs fail with one line naming the field."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import yaml

from placement.catalog import CatalogError, load_catalog
from server.config import ConfigError, MosaicConfig, check_catalog, load_config, validate_config
from server.embedded import default_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "docs" / "examples" / "gateway").glob("*.yaml"))
STATIC = {"static": ["http://10.0.0.5:8000"]}


def _pool(**over: object) -> dict[str, object]:
    return {"name": "p", "model": "llama-3-8b", "gpu": "H100", "endpoints": STATIC, **over}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_documented_examples_load(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(
        tmp_path
    )  # relative paths in a config are the config's folder's, wherever mosaic starts
    cfg = load_config(path)
    assert isinstance(cfg, MosaicConfig) and cfg.pools


def test_there_are_documented_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "config.yaml",
        "real-vllm.yaml",
        "kubernetes.yaml",
        "simulated.yaml",
    }


def test_defaults() -> None:
    cfg = validate_config({"pools": [_pool()]})
    assert (cfg.routing.policy, cfg.routing.pd_threshold_tokens) == ("mosaic", 256)
    assert (cfg.scrape.interval_s, cfg.scrape.stale_after_s) == (1.0, 5.0)
    assert (cfg.limits.queue_size, cfg.limits.max_retries, cfg.gateway.port) == (1024, 2, 8000)
    assert cfg.pools[0].role == "mixed" and cfg.kv.enabled
    assert [m.name for m in cfg.model_configs()] == ["llama-3-8b"]  # derived from the pools


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            {"pools": [_pool(gpu="B200")]},
            "test: pools.0.gpu: unknown GPU 'B200'",
            id="unknown GPU names the pool field",
        ),
        pytest.param(
            {"pools": [_pool(model="gpt-9")]},
            "test: pools.0.model: unknown model 'gpt-9'",
            id="unknown model without a models list",
        ),
        pytest.param(
            {"models": [{"name": "m"}], "pools": [_pool()]},
            "test: pools.0.model: model 'llama-3-8b' is not listed under models",
            id="pool model not in the models list",
        ),
        pytest.param(
            {"pools": [_pool()], "kv": {"enabled": False, "batch_admission": {"enabled": True}}},
            "test: kv.batch_admission.enabled: batch admission plans against the KV ledger; it needs kv.enabled: true",
            id="batch admission without the KV ledger is refused rather than silently ignored",
        ),
        pytest.param(
            {"pools": [_pool(role="both")]},
            "test: pools.0.role: Input should be 'prefill', 'decode' or 'mixed'",
            id="bad role",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={})]},
            "test: pools.0.endpoints: give exactly one of static, kubernetes, simulated, launch",
            id="no endpoints",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={**STATIC, "launch": "vllm"})]},
            "test: pools.0.endpoints: give exactly one of static, kubernetes, simulated, launch (got ['static', 'launch'])",
            id="two endpoint kinds",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"static": ["10.0.0.5:8000"]})]},
            "test: pools.0.endpoints.static: '10.0.0.5:8000' is not an http(s):// URL",
            id="static URL without scheme",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"kubernetes": {"namespace": "x"}})]},
            "test: pools.0.endpoints.kubernetes.label_selector: Field required",
            id="kubernetes without a selector",
        ),
        pytest.param(
            {"pools": [_pool(), _pool()]},
            "test: pools.1.name: duplicate pool name 'p'",
            id="duplicate pool names",
        ),
        pytest.param(
            {"pools": [_pool(min_replicas=3, max_replicas=1)]},
            "test: pools.0: max_replicas 1 < min_replicas 3",
            id="replica bounds",
        ),
        pytest.param(
            {"pools": [_pool()], "limits": {"queue_sise": 3}},
            "test: limits.queue_sise: unknown key",
            id="typo in a key is refused",
        ),
        pytest.param(
            {"pools": [_pool()], "routing": {"plugins": [{"type": "nope"}]}},
            "test: routing.plugins[0] (nope).type: unknown plugin type 'nope'",
            id="routing errors come from the router's own config",
        ),
        pytest.param(
            {"pools": [_pool()], "kv": {"mode": "yolo"}},
            "test: kv.mode: Input should be 'worst_case' or 'predicted'",
            id="kv section validated",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"simulated": {"replicas": 10**9}})]},
            "test: pools.0.endpoints.simulated.replicas: Input should be less than or equal to 256",
            id="a billion simulated workers (serve hung starting them)",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"simulated": {"time_scale": math.inf}})]},
            "test: pools.0.endpoints.simulated.time_scale: Input should be a finite number",
            id="an infinite time scale (froze the simulated clock)",
        ),
        pytest.param(
            {
                "pools": [
                    _pool(endpoints={"simulated": {"lora_modules": ["sql", {"name": "sql", "path": "/b"}]}})
                ]
            },
            "test: pools.0.endpoints.simulated.lora_modules: duplicate LoRA adapter name 'sql'",
            id="one LoRA adapter name twice (vLLM refuses to start)",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"simulated": {"lora_modules": ["sql", "llama-3-8b"]}})]},
            "test: pools.0.endpoints.simulated.lora_modules.1.name: LoRA adapter 'llama-3-8b' takes the name the "
            "pool's workers serve the base model as",
            id="a LoRA adapter named as the pool's model",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"simulated": {"lora_modules": [{"name": "sql", "url": "/a"}]}})]},
            "test: pools.0.endpoints.simulated.lora_modules.0.url: unknown key",
            id="a LoRA adapter's unknown key",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"simulated": {"lora_modules": [""]}})]},
            "test: pools.0.endpoints.simulated.lora_modules.0.name: String should have at least 1 character",
            id="a LoRA adapter without a name",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"simulated": {"lora_modules": ["sql"], "max_loras": 0}})]},
            "test: pools.0.endpoints.simulated.max_loras: Input should be greater than or equal to 1",
            id="max_loras 0",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"simulated": {"allow_runtime_lora_updating": "sometimes"}})]},
            "test: pools.0.endpoints.simulated.allow_runtime_lora_updating: Input should be a valid boolean, "
            "unable to interpret input",
            id="runtime LoRA updating not a boolean",
        ),
        pytest.param(
            {"pools": [_pool(endpoints={"simulated": {"allow_runtime_lora_update": True}})]},
            "test: pools.0.endpoints.simulated.allow_runtime_lora_update: unknown key",
            id="runtime LoRA updating misspelt",
        ),
        pytest.param(
            {"pools": [_pool(dp=0)]},
            "test: pools.0.dp: Input should be greater than or equal to 1",
            id="a worker of no engine",
        ),
        pytest.param(
            {"pools": [_pool()], "scrape": {"interval_s": math.nan}},
            "test: scrape.interval_s: Input should be a finite number",
            id="a NaN interval",
        ),
        pytest.param({"pools": []}, "test: pools: List should have at least 1 item", id="no pools"),
        pytest.param(
            {"pools": [_pool(role="prefill"), _pool(name="q", model="llama-3-70b", role="decode")]},
            "test: pools.0.role: model 'llama-3-8b' has only prefill pools (p): a prefill worker does not "
            "finish a request; add a decode or mixed pool",
            id="a model with prefill pools only: every request 503 no_worker_for_role",
        ),
        pytest.param(["not", "a", "mapping"], "test: top level must be a mapping", id="not a mapping"),
    ],
)
def test_bad_configs_name_the_field(data: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(data, "test")
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_load_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d"):
        load_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"pools": [_pool()]}))
    assert load_config(good).pools[0].gpu == "H100"


def test_embedded_default_is_heterogeneous() -> None:
    cfg = default_config(time_scale=7.0)
    assert [(p.name, p.gpu, p.role) for p in cfg.pools] == [
        ("prefill-h100", "H100-SXM", "prefill"),
        ("decode-a100", "A100-80GB", "decode"),
        ("mixed-l4", "L4", "mixed"),
    ]
    assert all(p.endpoints.simulated and p.endpoints.simulated.time_scale == 7.0 for p in cfg.pools)
    assert sum(p.endpoints.simulated.replicas for p in cfg.pools if p.endpoints.simulated) == 5


def test_launch_vllm_pool_builds_a_launched_source() -> None:
    """`launch: vllm` (the real-vLLM launcher's section) parses, and the gateway discovers through
    `server.vllm_source.LaunchedPoolSource` — constructed, nothing started until the lifespan runs."""
    from server.gateway import Gateway
    from server.vllm_source import LaunchedPoolSource

    cfg = validate_config(
        {
            "pools": [
                _pool(endpoints={"launch": "vllm"}),
                _pool(name="q", endpoints={"launch": {"replicas": 0, "use_gpus": False}}),
            ]
        }
    )
    assert [p.endpoints.kind for p in cfg.pools] == ["launch", "launch"]
    assert cfg.pools[0].endpoints.launch is not None and cfg.pools[0].endpoints.launch.replicas == 1
    gw = Gateway(cfg)
    assert all(isinstance(s, LaunchedPoolSource) for s in gw.sources.values())

    async def cleanup() -> None:  # no replica was started; stop() removes their log folders
        for source in gw.sources.values():
            await source.stop()
        await gw.upstream.aclose()
        await gw.registry.stop()

    asyncio.run(cleanup())


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_documented_gateway_example_loads(
    path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The READMEs point users at these files: each must be a valid config (a section renamed or added,
    like `cors`, cannot leave an example behind that the gateway then refuses)."""
    monkeypatch.chdir(
        tmp_path
    )  # relative paths in a config are the config's folder's, wherever mosaic starts
    cfg = load_config(path)
    assert cfg.pools
    if path.name == "config.yaml":  # the annotated example shows every section
        data = yaml.safe_load(path.read_text())
        assert set(MosaicConfig.model_fields) <= set(data)
        # its catalog file's rows are merged over the built-in ones: a price of its own, a model of its own
        catalog = check_catalog(cfg)
        assert catalog.gpu("A100-80GB").cost_per_hour == 1.60
        assert catalog.model("llama-3.2-3b").layers == 28
        with pytest.raises(CatalogError):
            load_catalog().model("llama-3.2-3b")
        assert catalog.gpu("H100-SXM").cost_per_hour == load_catalog().gpu("H100-SXM").cost_per_hour


def test_the_examples_folder_is_found() -> None:
    assert len(EXAMPLES) >= 6


def test_simulated_pool_lora_adapters_reach_each_worker() -> None:
    """`lora_modules: [name or {name, path}]` and `max_loras` become each simulated worker's vLLM flags."""
    from server.embedded import simulated_source
    from simulator.lora import LoraModule

    sim = {"replicas": 2, "lora_modules": ["sql", {"name": "chat", "path": "/adapters/chat"}], "max_loras": 2}
    cfg = validate_config({"pools": [_pool(endpoints={"simulated": sim})]})
    source = simulated_source(cfg, cfg.pools[0])
    for index in (0, 1):
        worker = source.worker_config(index)
        # a bare name is its own path (as a Hugging Face adapter id would be)
        assert worker.lora_modules == (LoraModule("sql", "sql"), LoraModule("chat", "/adapters/chat"))
        assert worker.engine.max_loras == 2
    plain = validate_config({"pools": [_pool(endpoints={"simulated": {}})]})
    worker = simulated_source(plain, plain.pools[0]).worker_config(0)
    assert (worker.lora_modules, worker.engine.max_loras) == ((), 1)  # LoRA off; vLLM's default max_loras


def test_simulated_pool_runtime_lora_updating_reaches_each_worker_with_lora_on() -> None:
    """`allow_runtime_lora_updating` (off by default) gives each worker vLLM's load/unload routes, and LoRA with
    them: a pool configured to load adapters at run time is one vLLM would start with --enable-lora."""
    from server.embedded import simulated_source

    plain = validate_config({"pools": [_pool(endpoints={"simulated": {}})]})
    assert plain.pools[0].endpoints.simulated is not None
    assert plain.pools[0].endpoints.simulated.allow_runtime_lora_updating is False
    worker = simulated_source(plain, plain.pools[0]).worker_config(0)
    assert (worker.allow_runtime_lora_updating, worker.enable_lora) == (False, False)
    sim = {"replicas": 2, "allow_runtime_lora_updating": True}
    cfg = validate_config({"pools": [_pool(endpoints={"simulated": sim})]})
    source = simulated_source(cfg, cfg.pools[0])
    for index in (0, 1):
        worker = source.worker_config(index)
        assert (worker.allow_runtime_lora_updating, worker.enable_lora, worker.lora_modules) == (
            True,
            True,
            (),
        )


def test_a_relative_catalog_path_is_the_config_files_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "rows.yaml").write_text("gpus:\n  L4:\n    cost_per_hour: 0.5\n")
    (tmp_path / "conf" / "mosaic.yaml").write_text(
        yaml.safe_dump({"pools": [_pool(gpu="L4")], "catalog": "rows.yaml"})
    )
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config("conf/mosaic.yaml")
    assert cfg.catalog == str(tmp_path / "conf" / "rows.yaml")
    assert check_catalog(cfg).gpu("L4").cost_per_hour == 0.5


def test_a_symlinked_config_reads_relative_paths_beside_the_link(tmp_path: Path) -> None:
    """A ConfigMap mount: `config.yaml` links into a timestamped folder; `rows.yaml` is reached beside the link
    (the folder behind it goes at the ConfigMap's next update)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "mount").mkdir()
    (tmp_path / "data" / "config.yaml").write_text(
        yaml.safe_dump({"pools": [_pool(gpu="L4")], "catalog": "rows.yaml"})
    )
    (tmp_path / "mount" / "rows.yaml").write_text("gpus:\n  L4:\n    cost_per_hour: 0.5\n")
    (tmp_path / "mount" / "config.yaml").symlink_to(tmp_path / "data" / "config.yaml")
    cfg = load_config(tmp_path / "mount" / "config.yaml")
    assert check_catalog(cfg).gpu("L4").cost_per_hour == 0.5
    assert cfg.source_dir == tmp_path / "mount"


def test_a_tp_that_does_not_divide_the_models_heads_is_refused_at_load() -> None:
    """vLLM refuses to start such an engine, as `mosaic worker --tp` does; the gateway started a simulated
    pool of it (and a static one) without a word."""
    pool = {"name": "p", "model": "llama-3-8b", "gpu": "L4", "tp": 3, "endpoints": {"static": ["http://x:1"]}}
    with pytest.raises(ConfigError) as err:
        validate_config({"pools": [pool]}, "c.yaml")
    assert str(err.value) == (
        "c.yaml: pools.0.tp: Total number of attention heads (32) must be divisible by tensor parallel size (3)."
    )
    assert check_catalog(validate_config({"pools": [{**pool, "tp": 4}]}))


@pytest.mark.parametrize(
    ("section", "field"),
    [
        pytest.param({"gateway": {"port": False}}, "gateway.port", id="port: false served on a random port"),
        pytest.param({"slo": {"ttft_ms": True}}, "slo.ttft_ms", id="ttft_ms: true held TTFT to 1 ms"),
        pytest.param({"kv": {"watermark": True}}, "kv.watermark", id="a KV number"),
        pytest.param({"routing": {"weights": {"cost": True}}}, "routing.weights", id="a mapping's value"),
    ],
)
def test_a_boolean_where_a_number_goes_is_refused(section: dict[str, object], field: str) -> None:
    """Pydantic's lax mode read YAML's true/false/yes/no as 1 and 0 in number fields, silently."""
    pool = {"name": "p", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"static": ["http://x:1"]}}
    with pytest.raises(ConfigError) as err:
        validate_config({"pools": [pool], **section})
    assert field in str(err.value) and "Input should be a number, not a boolean" in str(err.value)


def test_a_boolean_replica_count_is_refused() -> None:
    pool = {"name": "p", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"simulated": {"replicas": True}}}
    with pytest.raises(
        ConfigError, match=r"pools\.0\.endpoints\.simulated\.replicas: .*not a boolean \(true\)"
    ):
        validate_config({"pools": [pool]})


def test_only_number_types_count_as_numbers() -> None:
    from typing import Annotated

    from scheduler.config_numbers import is_number_type

    assert all(is_number_type(t) for t in (int, float, int | None, float | int, Annotated[int, "x"]))
    assert not any(is_number_type(t) for t in (bool, str, int | str, list[int], bool | None))
    from scheduler.config_numbers import boolean_number

    assert boolean_number(dict[str, float], {"a": 1.0, "b": False}) is False
    assert boolean_number(list[int] | None, [1, True]) is True
    assert boolean_number(dict[str, bool], {"a": True}) is None and boolean_number(list[int], [1, 2]) is None
