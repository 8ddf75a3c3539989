"""`--lora-modules`: each request names one of the adapters (vLLM's `bench serve` rule), drawn per (seed,
request index), recorded in the report; the CLI takes vLLM's space-separated names and refuses bad ones."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

from loadgen.lora import LoraError, ModelChooser, check_lora_modules
from loadgen.replay import ReplayOutcome, ReplayRequest, run_replay_async
from loadgen.report import load_report
from server.cli import build_app
from server.commands.replay import expand_lora_modules
from tests.cli.test_usage_errors import run_cli
from tests.loadgen.loadgen_fakes import FakeWorker

ADAPTERS = ("sql", "chat-v2", "summarise", "legal")
SPEC = "synthetic:rate=400,n=40,arrival=constant,input=uniform:5:30,output=uniform:1:4,seed=3"


def run(req: ReplayRequest, worker: FakeWorker) -> ReplayOutcome:
    transport = httpx.ASGITransport(app=worker.app())
    with open("/dev/null", "w") as sink:
        return asyncio.run(run_replay_async(req, Console(file=sink), transport))


def test_the_choice_is_fixed_by_seed_and_index_and_differs_across_seeds() -> None:
    a = [ModelChooser("base", ADAPTERS, seed=7).model_for(i) for i in range(200)]
    assert a == [ModelChooser("base", ADAPTERS, seed=7).model_for(i) for i in range(200)]
    # order-free: request 150 names the same adapter whether or not requests 0-149 were drawn first
    assert ModelChooser("base", ADAPTERS, seed=7).model_for(150) == a[150]
    b = [ModelChooser("base", ADAPTERS, seed=8).model_for(i) for i in range(200)]
    assert a != b and set(a) == set(b) == set(ADAPTERS)


def test_random_choice_is_uniform_within_binomial_bounds() -> None:
    """8,000 draws over 4 adapters: each count ~ Binomial(8000, 1/4), sd ≈ 38.7; ±5 sd bounds fail by chance
    with probability ~1e-6, a skewed choice (e.g. one adapter at 30%) fails them by 10 sd."""
    n = 8000
    counts = Counter(ModelChooser("base", ADAPTERS, seed=1).model_for(i) for i in range(n))
    assert set(counts) == set(ADAPTERS)
    for name in ADAPTERS:
        assert 1806 <= counts[name] <= 2194, counts
    # a name given twice is drawn twice as often, as vLLM's random.choice over the list
    twice = Counter(ModelChooser("base", ("a", "a", "b"), seed=1).model_for(i) for i in range(n))
    assert 0.63 < twice["a"] / n < 0.70, twice


def test_round_robin_cycles_in_order_and_no_adapters_names_the_base_model() -> None:
    rr = ModelChooser("base", ADAPTERS, "round-robin", seed=5)
    assert [rr.model_for(i) for i in range(6)] == ["sql", "chat-v2", "summarise", "legal", "sql", "chat-v2"]
    assert {ModelChooser("base", (), seed=5).model_for(i) for i in range(20)} == {"base"}


def test_each_request_body_names_an_adapter_and_the_report_counts_them(tmp_path: Path) -> None:
    worker = FakeWorker()
    req = ReplayRequest(
        SPEC, "http://fake", "base", out=tmp_path / "r.json", progress=False, seed=4, lora_modules=ADAPTERS
    )
    out = run(req, worker)
    sent = [b["model"] for b in worker.received]
    assert len(sent) == 40 and set(sent) <= set(ADAPTERS) and len(set(sent)) > 1
    chooser = ModelChooser("base", ADAPTERS, seed=4)
    # the bodies arrive in send order (constant spacing, one at a time): request i named model_for(i)
    assert sent == [chooser.model_for(i) for i in range(40)]
    report = load_report(tmp_path / "r.json")
    assert report["config"]["model"] == "base"
    assert report["config"]["lora_modules"] == list(ADAPTERS)
    assert report["config"]["lora_assignment"] == "random"
    assert [row["model"] for row in report["requests"]] == sent
    by_model = report["summary"]["requests_by_model"]
    assert by_model == {m: {"sent": c, "completed": c} for m, c in sorted(Counter(sent).items())}
    assert out.metrics.completed == 40


def test_without_adapters_every_body_names_the_model_and_the_config_says_none(tmp_path: Path) -> None:
    worker = FakeWorker()
    run(ReplayRequest(SPEC, "http://fake", "m", out=tmp_path / "r.json", progress=False), worker)
    assert {b["model"] for b in worker.received} == {"m"}
    report = load_report(tmp_path / "r.json")
    assert report["config"]["lora_modules"] is None and report["config"]["lora_assignment"] is None
    assert report["summary"]["requests_by_model"] == {"m": {"sent": 40, "completed": 40}}


def test_failed_requests_count_as_sent_not_completed_per_model() -> None:
    worker = FakeWorker(fail_every=4)
    out = run(ReplayRequest(SPEC, "http://fake", "m", progress=False, lora_modules=("x", "y")), worker)
    by_model = out.report["summary"]["requests_by_model"]
    assert sum(r["sent"] for r in by_model.values()) == 40
    assert sum(r["completed"] for r in by_model.values()) == 30


@pytest.mark.parametrize(
    ("names", "assignment", "message"),
    [
        pytest.param((), "random", "at least one adapter name", id="no names"),
        pytest.param(("sql", ""), "random", "an adapter name is empty", id="an empty name"),
        pytest.param(("my adapter",), "random", "'my adapter' has whitespace", id="a name with a space"),
        pytest.param(("a\tb",), "random", "whitespace or control", id="a name with a tab"),
        pytest.param(("sql",), "shuffle", "--lora-assignment must be one of random, round-robin", id="bad assignment"),
    ],
)  # fmt: skip
def test_bad_adapter_names_are_refused(names: tuple[str, ...], assignment: str, message: str) -> None:
    with pytest.raises(LoraError, match=message):
        check_lora_modules(names, assignment)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["T", "--lora-modules", "a", "b", "--url", "u"], ["T", "--lora-modules", "a", "--lora-modules", "b", "--url", "u"]),
        (["T", "--lora-modules", "a"], ["T", "--lora-modules", "a"]),
        (["T", "--lora-modules=a", "--lora-modules", "b"], ["T", "--lora-modules=a", "--lora-modules", "b"]),
        (["--", "--lora-modules", "a", "b"], ["--", "--lora-modules", "a", "b"]),  # after --: positional
        (["T", "--url", "u"], ["T", "--url", "u"]),
    ],
)  # fmt: skip
def test_space_separated_names_become_one_option_each(args: list[str], expected: list[str]) -> None:
    assert expand_lora_modules(args) == expected


def test_the_flag_without_a_name_is_refused() -> None:
    assert expand_lora_modules(["T", "--lora-modules", "--url", "u"]) is None
    assert expand_lora_modules(["T", "--lora-modules"]) is None


def test_cli_sends_the_adapters_to_a_simulated_worker_serving_them(
    lora_worker_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        build_app(),
        ["replay", SPEC, "--url", lora_worker_url, "--model", "llama-3-8b", "--lora-modules", "sql", "chat-v2",
         "--seed", "2", "--quiet", "--out", str(out)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["config"]["lora_modules"] == ["sql", "chat-v2"]
    by_model = report["summary"]["requests_by_model"]
    assert set(by_model) == {"sql", "chat-v2"} and all(r["sent"] == r["completed"] for r in by_model.values())
    assert sum(r["completed"] for r in by_model.values()) == 40


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--lora-modules", "--quiet"], "--lora-modules needs at least one adapter name", id="flag without names"),
        pytest.param(["--lora-modules", "a b"], "'a b' has whitespace", id="a name with a space"),
        pytest.param(["--lora-assignment", "round-robin"], "give them, or drop it", id="assignment without adapters"),
        pytest.param(["--lora-modules", "a", "--lora-assignment", "x"], "must be one of random, round-robin", id="unknown assignment"),
    ],
)  # fmt: skip
def test_cli_bad_lora_input_exits_2_with_one_line(closed_url: str, args: list[str], message: str) -> None:
    proc = run_cli("replay", SPEC, "--url", closed_url, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_cli_names_the_cause_when_the_flag_took_the_trace(closed_url: str) -> None:
    proc = run_cli("replay", "--url", closed_url, "--lora-modules", "a", SPEC)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "give TRACE before it" in lines[0], lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param([SPEC, "--quiet"], "Missing option '--url'", id="no --url"),
        pytest.param(["--url", "http://127.0.0.1:9"], "Missing argument 'trace'", id="no trace, no adapters"),
        pytest.param([SPEC, "--lora-modules", "a"], "Missing option '--url'", id="adapters, no --url"),
    ],
)
def test_a_missing_argument_is_named_and_lora_modules_blamed_only_when_it_took_the_trace(
    args: list[str], message: str
) -> None:
    """Click consumes the argument list it parses: compared after parsing, every missing option (no --url
    at all) was blamed on --lora-modules."""
    proc = run_cli("replay", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "--lora-modules" not in lines[0], lines
