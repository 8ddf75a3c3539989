"""The chart's vLLM command lines, parsed by vLLM's own CLI parser (the release in .venv-vllm): an argument
vLLM does not know, or a value it refuses, would crash-loop every GPU pod of a pool."""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from vllm_env import VENV_PYTHON

from tests.chart.chartkit import CHART_DIR, EXAMPLES_DIR, RELEASE, container, load_values, render

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(300)]

# Parses each argument list with `vllm serve`'s parser and prints what the chart relies on.
PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for args in json.load(sys.stdin):
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    kv = ns.kv_transfer_config
    out.append({"shutdown_timeout": ns.shutdown_timeout, "kv_role": getattr(kv, "kv_role", None),
                "tp": ns.tensor_parallel_size, "dp": ns.data_parallel_size,
                "prefix_caching": ns.enable_prefix_caching})
print(json.dumps(out))
"""

# Each argument list with one parser (argparse keeps no state between parses): what tp, dp, pp, pcp and dcp
# vLLM takes from it, or null where vLLM refuses it (an ambiguous abbreviation, an unknown flag, a bad config
# file).
RESOLVE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
out = []
for args in json.load(sys.stdin):
    try:
        ns = parser.parse_args(args)
    except (SystemExit, ValueError):
        out.append(None)
    else:
        out.append({"tp": ns.tensor_parallel_size, "dp": ns.data_parallel_size, "pp": ns.pipeline_parallel_size,
                    "pcp": ns.prefill_context_parallel_size, "dcp": ns.decode_context_parallel_size})
print(json.dumps(out))
"""


# One Python of .venv-vllm for the whole module, which runs each script sent to it (a JSON line: the script and
# its stdin) and answers its stdout: importing vLLM takes ~10 s on 2 cores, once instead of once per script.
INTERPRETER = """
import contextlib, io, json, sys, traceback
answers = sys.stdout
for line in sys.stdin:
    job = json.loads(line)
    sys.stdin, out = io.StringIO(job["stdin"]), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(job["script"], {"__name__": "__job__"})
        answers.write(json.dumps({"stdout": out.getvalue()}) + "\\n")
    except BaseException:
        answers.write(json.dumps({"error": traceback.format_exc()}) + "\\n")
    answers.flush()
"""


class VllmInterpreter:
    """`INTERPRETER` running in .venv-vllm's Python; its stderr (argparse's complaints) goes to a temp file."""

    def __init__(self) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        self._proc = subprocess.Popen(
            [str(VENV_PYTHON), "-c", INTERPRETER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )

    def run(self, script: str, stdin: str) -> str:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"script": script, "stdin": stdin}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            self._stderr.seek(0)
            raise AssertionError(f"vLLM's Python exited: {self._stderr.read()[-2000:]}")
        answer = json.loads(line)
        assert "error" not in answer, answer["error"][-2000:]
        return str(answer["stdout"])

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()


_interpreter: list[VllmInterpreter] = []  # started by the first script, stopped after the module


@pytest.fixture(scope="module", autouse=True)
def _stop_interpreter() -> Iterator[None]:
    yield
    while _interpreter:
        _interpreter.pop().close()


def _vllm(script: str, argvs: list[Any]) -> list[Any]:
    """`script` run by .venv-vllm's Python on `argvs` (JSON on stdin), its JSON answer."""
    if not VENV_PYTHON.exists():
        pytest.skip(f"{VENV_PYTHON} missing: `make vllm-env` builds the vLLM environment")
    if not _interpreter:
        _interpreter.append(VllmInterpreter())
    out: list[Any] = json.loads(_interpreter[0].run(script, json.dumps(argvs)))
    return out


def test_every_pool_of_the_pd_example_parses_with_vllms_parser() -> None:
    values = load_values(EXAMPLES_DIR / "heterogeneous-pd.yaml")
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = render(chart, values)
    real = [p["name"] for p in values["pools"] if not p.get("simulated")]
    argvs = [
        [str(a) for a in container(rendered.get("Deployment", f"{RELEASE}-{name}"))["args"]] for name in real
    ]
    parsed = dict(zip(real, _vllm(PARSE, argvs), strict=True))
    assert all(p["shutdown_timeout"] == 100 for p in parsed.values()), parsed  # 120 s grace − 15 s − 5 s
    roles = {name: p["kv_role"] for name, p in parsed.items()}
    assert roles["h100-prefill"] == "kv_producer" and roles["a100-decode"] == "kv_consumer", roles


def test_data_parallel_pools_parse_with_vllms_parser() -> None:
    """dp engines of tp GPUs each: the chart's --data-parallel-size is vLLM's data_parallel_size."""
    pools = [
        {"name": "mixed", "model": "llama-3-8b", "gpu": "L4", "dp": 2},
        {"name": "prefill", "model": "llama-3-8b", "gpu": "L4", "role": "prefill", "tp": 2, "dp": 4},
        {"name": "single", "model": "llama-3-8b", "gpu": "L4", "tp": 2},
    ]
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = render(chart, {"pools": pools})
    argvs = [
        [str(a) for a in container(rendered.get("Deployment", f"{RELEASE}-{p['name']}"))["args"]]
        for p in pools
    ]
    parsed = {p["name"]: out for p, out in zip(pools, _vllm(PARSE, argvs), strict=True)}
    assert {n: (p["tp"], p["dp"]) for n, p in parsed.items()} == {
        "mixed": (1, 2),
        "prefill": (2, 4),
        "single": (2, 1),
    }
    assert parsed["prefill"]["kv_role"] == "kv_producer"


def _spellings(flag: str, short: str) -> list[str]:
    """Every way to write `flag` that vLLM's parser might take: each prefix of the long name and of the short
    form (argparse's abbreviations), the long ones with `-` or `_`, all with and without `=value`."""
    names = [flag[:n] for n in range(3, len(flag) + 1)]
    names += [n.replace("-", "_").replace("__", "--", 1) for n in names if "-" in n[2:]]
    names += [short[:n] for n in range(2, len(short) + 1)]
    return sorted({*names, *(f"{n}=3" for n in names)})


# The sizes refused and the flags that set them; the decode context parallel size is among the spellings as
# the control: vLLM reads it but it adds no GPU (test_the_refused_sizes_are_the_ones_that_multiply_vllms_gpus),
# so it is not refused.
SIZE_FLAGS = (
    ("--tensor-parallel-size", "-tp"),
    ("--data-parallel-size", "-dp"),
    ("--pipeline-parallel-size", "-pp"),
    ("--prefill-context-parallel-size", "-pcp"),
    ("--decode-context-parallel-size", "-dcp"),
)


def _takes(read: dict[str, Any] | None) -> bool:
    """Whether vLLM read a size of 3 (what every spelling sets) as its tp, dp, pp or pcp."""
    return read is not None and 3 in (read["tp"], read["dp"], read["pp"], read["pcp"])


@functools.cache
def _parallel_read() -> dict[str, dict[str, Any] | None]:
    """Each spelling of SIZE_FLAGS, what vLLM's parser reads from it (`RESOLVE`)."""
    spellings = sorted({s for flag, short in SIZE_FLAGS for s in _spellings(flag, short)})
    return dict(zip(spellings, _vllm(RESOLVE, [_argv(s) for s in spellings]), strict=True))


def _argv(spelling: str) -> list[str]:
    return ["m", spelling] if "=" in spelling else ["m", spelling, "3"]


def _parallel_spellings() -> tuple[list[str], list[list[str]], dict[str, bool]]:
    """The spellings, their argument lists, and whether vLLM's parser reads each as the tp, dp, pp or pcp
    size."""
    read = _parallel_read()
    return list(read), [_argv(s) for s in read], {s: _takes(r) for s, r in read.items()}


def test_launched_pools_refuse_exactly_the_extra_args_vllm_reads_as_a_parallel_size() -> None:
    """`launch.extra_args` (the gateway's own vLLM processes, server/vllm_pool.py) are refused at load by the
    same rule as the chart's extraArgs, held to vLLM's parser the same way: tp and dp (set the pool's), pp and
    pcp (not modelled)."""
    from server.config import ConfigError, validate_config

    spellings, argvs, takes = _parallel_spellings()
    refused: dict[str, bool] = {}
    for spelling, argv in zip(spellings, argvs, strict=True):
        launch = {"replicas": 1, "use_gpus": False, "extra_args": argv[1:]}
        pool = {"name": "p", "model": "llama-3-8b", "gpu": "L4", "endpoints": {"launch": launch}}
        try:
            validate_config({"pools": [pool]}, "test")
        except ConfigError as exc:
            assert f"pools.0.endpoints.launch.extra_args: {spelling}: " in str(exc), exc
            refused[spelling] = True
        else:
            refused[spelling] = False
    assert refused == takes, {s: (refused[s], takes[s]) for s in spellings if refused[s] != takes[s]}


def test_the_vllm_worker_refuses_exactly_the_args_vllm_reads_as_a_parallel_size() -> None:
    """`mosaic worker --engine vllm ... -- ARGS` (server/vllm_worker.py) applies the launched pools' rule."""
    from server.vllm_worker import worker_spec

    spellings, argvs, takes = _parallel_spellings()
    refused: dict[str, bool] = {}
    for spelling, argv in zip(spellings, argvs, strict=True):
        try:
            worker_spec(model="m", port=8000, extra_args=["--", *argv[1:]])
        except ValueError as exc:
            assert str(exc).startswith(f"{spelling}: "), exc
            refused[spelling] = True
        else:
            refused[spelling] = False
    assert refused == takes, {s: (refused[s], takes[s]) for s in spellings if refused[s] != takes[s]}


def test_a_vllm_config_file_is_refused_exactly_when_vllm_reads_a_parallel_size_from_it(
    tmp_path: Path,
) -> None:
    """`--config FILE` in a launched pool's extra_args: vLLM turns each key into `--KEY`, so a key sets a size
    in every spelling a flag does; `server.vllm_pool.config_file_settings` finds exactly those."""
    from server.vllm_pool import config_file_settings

    names = [s for flag, short in SIZE_FLAGS for s in _spellings(flag, short)]
    keys = sorted({n.removeprefix("--") for n in names if "=" not in n} | {"tp", "dp", "pp", "pcp", "dcp"})
    argvs = []
    for i, key in enumerate(keys):
        file = tmp_path / f"v{i}.yaml"
        file.write_text(f"{json.dumps(key)}: 3\n", encoding="utf-8")
        argvs.append(["m", "--config", str(file)])
    read = dict(zip(keys, _vllm(RESOLVE, argvs), strict=True))
    takes = {key: _takes(r) for key, r in read.items()}
    refused = {key: bool(config_file_settings(argv[1:])) for key, argv in zip(keys, argvs, strict=True)}
    assert refused == takes, {k: (refused[k], takes[k]) for k in keys if refused[k] != takes[k]}
    assert takes["tensor_parallel_size"] and takes["pipeline-parallel"] and takes["data-parallel-size"]
    assert takes["prefill_context_parallel_size"] and takes["prefill-c"]
    assert not takes["pp"] and not takes["data-parallel"]  # an unknown flag; an ambiguous one
    # an unknown flag; ambiguous (--prefill-schedule-interval too)
    assert not takes["pcp"] and not takes["prefill"]
    read_dcp = read["decode_context_parallel_size"]
    assert read_dcp is not None and read_dcp["dcp"] == 3 and not takes["decode_context_parallel_size"]


def test_the_chart_refuses_exactly_the_extra_args_vllm_reads_as_a_parallel_size() -> None:
    """templates/_helpers.tpl `mosaic.pool.checkParallelArgs` refuses a pool's extraArgs that set vLLM's tensor
    or data parallel size (the chart writes both from tp and dp) or its pipeline or prefill context parallel
    size (not modelled): each spelling is refused at render if and only if vLLM's own parser reads it as that
    flag, so no spelling slips past and none vLLM would refuse anyway (an ambiguous abbreviation) gets the
    chart's message."""
    spellings, argvs, takes = _parallel_spellings()
    refused: dict[str, bool] = {}
    with helm.Chart.load(CHART_DIR) as chart:
        for spelling, argv in zip(spellings, argvs, strict=True):
            pool = {"name": "p", "model": "llama-3-8b", "gpu": "L4", "extraArgs": argv[1:]}
            try:
                render(chart, {"pools": [pool]})
            except helm.HelmRenderError as exc:
                assert "pools[0].extraArgs has" in str(exc), exc
                refused[spelling] = True
            else:
                refused[spelling] = False
    assert refused == takes, {s: (refused[s], takes[s]) for s in spellings if refused[s] != takes[s]}
    # the spellings that matter: abbreviations vLLM takes, the short form, an abbreviation it refuses
    assert takes["--tensor-parallel"] and takes["-t"] and takes["-dp=3"] and not takes["--data-parallel"]
    assert takes["--pi"] and takes["-pp"] and not takes["-p"] and not takes["--p"]  # -p: -pp or -pcp
    # --prefill-c… (--prefill… is also --prefill-schedule-interval), -pc alone (-pc=3 vLLM does not know)
    assert takes["--prefill_c=3"] and takes["-pc"] and takes["-pcp=3"]
    assert not takes["--prefill-"] and not takes["-pc=3"]
    # the control: vLLM reads the decode context parallel size (nowhere refused: it adds no GPU)
    read = _parallel_read()
    assert all((read[s] or {}).get("dcp") == 3 for s in ("--dec", "--decode_context=3", "-dcp", "-dcp=3"))


# vLLM's ParallelConfig for each set of sizes (JSON on stdin): the processes, one a GPU, a replica of vLLM's
# runs (`world_size_across_dp`: world_size is tp × pp × pcp, times dp).
WORLD = """
import json, sys
from vllm.config.parallel import ParallelConfig
print(json.dumps([ParallelConfig(**sizes).world_size_across_dp for sizes in json.load(sys.stdin)]))
"""


def test_the_refused_sizes_are_the_ones_that_multiply_vllms_gpus() -> None:
    """A replica gets tp × dp GPUs, vLLM's world size while pp and pcp are 1: each of those multiplies it and is
    refused (not modelled); dcp does not (it shards the KV cache over the tp × pcp ranks there are) and is
    passed on. Held to vLLM's ParallelConfig, so a release that changes either fails here."""
    from server.vllm_pool import parallel_size_flag

    sizes: list[dict[str, Any]] = [
        {"tensor_parallel_size": 2},
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
        {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2},
        {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},  # vLLM: dcp divides tp when pcp is 1
        {"tensor_parallel_size": 2, "data_parallel_size": 2},
    ]
    assert _vllm(WORLD, sizes) == [2, 4, 4, 2, 4]
    flags = ("--pipeline-parallel-size", "--prefill-context-parallel-size", "--decode-context-parallel-size")
    assert [parallel_size_flag(f) for f in flags] == ["pp", "pcp", None]


# ---- LoRA (`pools[].lora`) ----

# Each argument list parsed by `vllm serve`'s parser: its LoRA settings, and whether vLLM's LoRAConfig (the
# pydantic model the engine builds from them) takes the rank and count; null where the parser refuses the list.
LORA_PARSE = """
import json, sys
from vllm.config.lora import LoRAConfig
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
out = []
for args in json.load(sys.stdin):
    try:
        ns = parser.parse_args(args)
    except (SystemExit, ValueError):
        out.append(None)
        continue
    modules = None if ns.lora_modules is None else [[m.name, m.path] for m in ns.lora_modules]
    config = LoRAConfig(max_lora_rank=ns.max_lora_rank, max_loras=ns.max_loras)
    out.append({"enable_lora": ns.enable_lora, "modules": modules, "max_loras": config.max_loras,
                "max_lora_rank": config.max_lora_rank, "api_server_count": ns.api_server_count,
                "shutdown_timeout": ns.shutdown_timeout})
print(json.dumps(out))
"""

ADAPTERS = [{"name": "sql", "path": "/adapters/sql"}, {"name": "chat", "path": "my-org/llama3-chat-lora"}]
LORA_POOL = {"name": "p", "model": "llama-3-8b", "gpu": "L4", "lora": {"modules": ADAPTERS}}


def _pool_argvs(values: dict[str, Any]) -> dict[str, list[str]]:
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = render(chart, values)
    return {
        p["name"]: [str(a) for a in container(rendered.get("Deployment", f"{RELEASE}-{p['name']}"))["args"]]
        for p in values["pools"]
    }


def test_lora_pools_parse_with_vllms_parser() -> None:
    """The chart's --enable-lora, --lora-modules name=path ..., --max-loras and --max-lora-rank are vLLM's LoRA
    settings, and a flag after the adapters (the chart's --shutdown-timeout) is not read as one."""
    pools = [
        {
            "name": "static",
            "model": "llama-3-8b",
            "gpu": "L4",
            "lora": {"modules": ADAPTERS, "maxLoras": 2, "maxLoraRank": 320},
        },
        {"name": "runtime", "model": "llama-3-8b", "gpu": "L4", "lora": {"runtimeUpdating": True}},
        {
            "name": "dp",
            "model": "llama-3-8b",
            "gpu": "L4",
            "dp": 2,
            "lora": {"modules": ADAPTERS[:1], "runtimeUpdating": True},
            "extraArgs": ["--api-server-count", "1"],
        },
        {"name": "plain", "model": "llama-3-8b", "gpu": "L4"},
    ]
    argvs = _pool_argvs({"pools": pools})
    parsed = dict(zip(argvs, _vllm(LORA_PARSE, list(argvs.values())), strict=True))
    modules = [[a["name"], a["path"]] for a in ADAPTERS]
    assert parsed["static"] == {
        "enable_lora": True, "modules": modules, "max_loras": 2, "max_lora_rank": 320,
        "api_server_count": None, "shutdown_timeout": 100,
    }  # fmt: skip
    assert parsed["runtime"]["enable_lora"] is True and parsed["runtime"]["modules"] is None
    assert (parsed["runtime"]["max_loras"], parsed["runtime"]["max_lora_rank"]) == (1, 16)  # vLLM's defaults
    assert (parsed["dp"]["modules"], parsed["dp"]["api_server_count"]) == (modules[:1], 1)
    assert (parsed["plain"]["enable_lora"], parsed["plain"]["modules"]) == (None, None)
    assert all(p["shutdown_timeout"] == 100 for p in parsed.values()), parsed


def test_the_schemas_lora_ranks_are_vllms() -> None:
    """values.schema.json's maxLoraRank enum is vllm/config/lora.py's MaxLoRARanks (and null: vLLM's default)."""
    script = "import json, typing\nfrom vllm.config.lora import MaxLoRARanks\nprint(json.dumps(typing.get_args(MaxLoRARanks)))"
    ranks = _vllm(script, [])
    with helm.Chart.load(CHART_DIR) as chart:
        lora = chart.schema["definitions"]["poolFields"]["properties"]["lora"]  # type: ignore[index]
    assert lora["properties"]["maxLoraRank"]["enum"] == [None, *ranks]


def _lora_spellings() -> dict[str, list[str]]:
    """Each way to write the LoRA flags the chart writes that vLLM's parser might take → its argument list:
    every prefix of the long names (argparse's abbreviations), with `-` or `_`, with and without `=value`
    (a value vLLM takes for each: an adapter, 3 adapters per batch, rank 32)."""
    flags = {"--enable-lora": None, "--no-enable-lora": None, "--lora-modules": "b=/p", "--max-loras": "3",
             "--max-lora-rank": "32"}  # fmt: skip
    argvs: dict[str, list[str]] = {}
    for flag, value in flags.items():
        names = [flag[:n] for n in range(3, len(flag) + 1)]
        names += [n.replace("-", "_").replace("__", "--", 1) for n in names if "-" in n[2:]]
        for name in names:
            argvs[name] = [name] if value is None else [name, value]
            argvs[f"{name}={value or 1}"] = [f"{name}={value or 1}"]
    return argvs


def _takes_lora(read: dict[str, Any] | None) -> bool:
    """Whether vLLM read a LoRA setting the chart writes (what every spelling sets) from the list."""
    return read is not None and (
        read["enable_lora"] is not None
        or read["modules"] is not None
        or read["max_loras"] == 3
        or read["max_lora_rank"] == 32
    )


def test_the_chart_refuses_exactly_the_extra_args_vllm_reads_as_a_lora_flag() -> None:
    """templates/_helpers.tpl `mosaic.pool.checkLora` refuses, for a pool with LoRA on, the extraArgs that set
    what the chart writes from `lora` (--[no-]enable-lora, --lora-modules, --max-loras, --max-lora-rank): each
    spelling is refused at render if and only if vLLM's own parser reads it as one of them."""
    spellings = _lora_spellings()
    read = _vllm(LORA_PARSE, [["m", *argv] for argv in spellings.values()])
    takes = {s: _takes_lora(r) for s, r in zip(spellings, read, strict=True)}
    refused: dict[str, bool] = {}
    with helm.Chart.load(CHART_DIR) as chart:
        for spelling, argv in spellings.items():
            try:
                render(chart, {"pools": [{**LORA_POOL, "extraArgs": argv}]})
            except helm.HelmRenderError as exc:
                assert "pools[0].extraArgs has" in str(exc), exc
                refused[spelling] = True
            else:
                refused[spelling] = False
    assert refused == takes, {s: (refused[s], takes[s]) for s in spellings if refused[s] != takes[s]}
    # the spellings that matter: the shortest abbreviations vLLM takes, ambiguous ones, a switch with a value
    assert (
        takes["--enable-lor"]
        and takes["--no_enable_lor"]
        and takes["--lora-m=b=/p"]
        and takes["--max-lora-r"]
    )
    assert not takes["--enable-lo"] and not takes["--lora-"] and not takes["--max-lora"]
    assert takes["--max-loras"] and not takes["--enable-lora=1"]


def test_the_chart_takes_exactly_the_api_server_count_of_1_vllm_reads() -> None:
    """Run-time LoRA updating with dp > 1 needs one API server (vLLM 0.32 otherwise starts dp of them and
    refuses VLLM_ALLOW_RUNTIME_LORA_UPDATING): the render takes such a pool if and only if vLLM's parser reads
    an api_server_count of 1 from its extraArgs."""
    flag = "--api-server-count"
    names = [flag[:n] for n in range(3, len(flag) + 1)]
    names += [n.replace("-", "_").replace("__", "--", 1) for n in names if "-" in n[2:]]
    names += ["-a", "-as", "-asc"]
    spellings = {n: [n, "1"] for n in names} | {f"{n}=1": [f"{n}=1"] for n in names}
    spellings["--api-server-count 2"] = [flag, "2"]
    read = _vllm(LORA_PARSE, [["m", *argv] for argv in spellings.values()])
    takes = {s: r is not None and r["api_server_count"] == 1 for s, r in zip(spellings, read, strict=True)}
    accepted: dict[str, bool] = {}
    pool = {**LORA_POOL, "dp": 2, "lora": {"runtimeUpdating": True}}
    with helm.Chart.load(CHART_DIR) as chart:
        for spelling, argv in spellings.items():
            try:
                render(chart, {"pools": [{**pool, "extraArgs": argv}]})
            except helm.HelmRenderError as exc:
                assert "lora.runtimeUpdating with dp 2" in str(exc), exc
                accepted[spelling] = False
            else:
                accepted[spelling] = True
    assert accepted == takes, {s: (accepted[s], takes[s]) for s in spellings if accepted[s] != takes[s]}
    assert takes["--api-s"] and takes["-as"] and takes["-asc=1"] and not takes["-as=1"] and not takes["--api"]
