"""`mosaic replay TRACE --url U ...`: replay a trace (or a synthetic spec) against an OpenAI-compatible server.

TRACE is a trace file (format auto-detected: azure, burstgpt, burstgpt-lengths, sharegpt-lengths,
mooncake, sharegpt) or a synthetic spec such as `synthetic:rate=20,n=1000,input=512,output=128`
(docs/loadgen.md). The summary tables go to stderr with the progress bar; `--json` prints the report's
summary to stdout for scripts. Exit 0 when the replay ran (even with failed requests: they are in the
report), 2 with one line on bad input.

`--lora-modules A B ...` takes its names as vLLM's `bench serve` does (argparse `nargs="+"`: every word
after the flag up to the next option), so give TRACE before it; `--lora-modules A --lora-modules B` works too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand

from loadgen.client import ENDPOINT_PATHS
from loadgen.formats import FORMATS
from loadgen.lora import LORA_ASSIGNMENTS, LoraError
from loadgen.metrics import Slo
from loadgen.prompts import RERANK_DOCUMENTS
from loadgen.replay import ReplayError, ReplayInterrupted, ReplayRequest, print_outcome, run_replay
from loadgen.schedule import ScheduleError, ScheduleOptions
from loadgen.synthetic import SpecError
from loadgen.trace import TraceError
from server.commands.common import (
    check_number,
    check_report_paths,
    fail,
    raise_open_files_limit,
    table_console,
)

REPLAY_LATEST_SEND_S = 1e7  # 116 days: a replay scheduled past it is a mistaken rate, not a plan
LORA_FLAG = "--lora-modules"


def expand_lora_modules(args: Sequence[str]) -> list[str] | None:
    """`--lora-modules A B C` → `--lora-modules A --lora-modules B --lora-modules C`: click options take a
    fixed number of values, vLLM's flag takes every word up to the next option (or `--`). None when the
    flag is followed by no name (the caller's usage error)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":  # everything after it is positional, as click and argparse read it
            out.extend(args[i - 1 :])
            break
        if arg != LORA_FLAG:
            out.append(arg)
            continue
        names = []
        while i < len(args) and not args[i].startswith("-"):
            names.append(args[i])
            i += 1
        if not names:
            return None
        for name in names:
            out += [LORA_FLAG, name]
    return out


class ReplayCommand(TyperCommand):
    """`mosaic replay` with vLLM's space-separated `--lora-modules` (`expand_lora_modules`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        expanded = expand_lora_modules(args)
        if expanded is None:
            ctx.fail(f"{LORA_FLAG} needs at least one adapter name")  # click's usage error: one line, exit 2
        # before parsing: click consumes the list it is given (compared after, it always differed, and every
        # missing option was blamed on --lora-modules)
        regrouped = expanded != list(args)
        try:
            return super().parse_args(ctx, list(expanded))
        except Exception as exc:  # click's own copy in typer: recognised by shape, as server.cli.main does
            param = getattr(getattr(exc, "param", None), "name", None)
            if type(exc).__name__ == "MissingParameter" and regrouped and param == "trace":
                # `--lora-modules A B TRACE`: the flag took TRACE as a name, as vLLM's argparse would
                ctx.fail(
                    f"Missing argument 'trace': {LORA_FLAG} takes every word up to the next option, give TRACE before it"
                )
            raise


def register(app: typer.Typer) -> None:
    @app.command("replay", cls=ReplayCommand)
    def replay_cmd(
        trace: str = typer.Argument(..., help="Trace file, or a synthetic spec 'synthetic:rate=R,n=N,...'."),
        url: str = typer.Option(..., "--url", help="Base URL of the server, e.g. http://127.0.0.1:8000."),
        format: str | None = typer.Option(
            None, "--format", help=f"Force a reader: {', '.join(FORMATS[:-1])}."
        ),
        rate_scale: float = typer.Option(
            1.0, "--rate-scale", help="Replay the trace's timing X times faster."
        ),
        rate: float | None = typer.Option(
            None, "--rate", help="Fixed arrival rate (req/s), replacing trace timing."
        ),
        burstiness: float = typer.Option(
            1.0, "--burstiness", help="With --rate: gamma shape k (1 = Poisson)."
        ),
        start: float = typer.Option(0.0, "--start", help="Window start, seconds into the trace."),
        duration: float | None = typer.Option(None, "--duration", help="Window length, trace seconds."),
        max_requests: int | None = typer.Option(None, "--max-requests", help="Send at most N requests."),
        model: str = typer.Option("llama-3-8b", "--model", help="Model name sent in each request."),
        lora_modules: list[str] | None = typer.Option(
            None,
            LORA_FLAG,
            help="LoRA adapter names (NAME [NAME ...], as vLLM's bench): each request names one instead of --model.",
        ),
        lora_assignment: str = typer.Option(
            "random",
            "--lora-assignment",
            help=f"With --lora-modules: {' | '.join(LORA_ASSIGNMENTS)} (seeded by --seed).",
        ),
        api_key: str | None = typer.Option(
            None, "--api-key", envvar="MOSAIC_API_KEY", help="Bearer API key."
        ),
        endpoint: str = typer.Option(
            "completions",
            "--endpoint",
            help="completions (token-id prompts) | chat | embeddings (token-id inputs, answered whole: "
            "TTFT = E2EL, no output tokens) | rerank (vLLM's /rerank: the input's words as a query and "
            "--rerank-documents documents, answered whole).",
        ),
        rerank_documents: int = typer.Option(
            RERANK_DOCUMENTS, "--rerank-documents", help="--endpoint rerank: documents per request (≥ 1)."
        ),
        concurrency: int | None = typer.Option(None, "--concurrency", help="Max requests in flight."),
        timeout: float = typer.Option(600.0, "--timeout", help="Per-request timeout, seconds."),
        skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="Count and skip malformed rows."),
        slo_ttft_ms: float | None = typer.Option(None, "--slo-ttft-ms", help="TTFT SLO for goodput (ms)."),
        slo_tpot_ms: float | None = typer.Option(None, "--slo-tpot-ms", help="TPOT SLO for goodput (ms)."),
        slo_e2el_ms: float | None = typer.Option(
            None, "--slo-e2el-ms", help="E2E latency SLO for goodput (ms)."
        ),
        lag_threshold_ms: float = typer.Option(
            5.0, "--lag-threshold-ms", help="Warn when p99 send lag exceeds it."
        ),
        out: Path | None = typer.Option(
            None, "--out", help="Write the JSON report (mosaic.loadgen.report/v1)."
        ),
        plot: Path | None = typer.Option(None, "--plot", help="Write PNG plots into this directory."),
        seed: int = typer.Option(0, "--seed", help="Seed for prompts, synthetic traces and --rate arrivals."),
        quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
        as_json: bool = typer.Option(False, "--json", help="Print the report's summary as JSON on stdout."),
    ) -> None:
        """Replay a trace against a server and report TTFT/TPOT/ITL/E2EL, throughput and goodput (vLLM's definitions)."""
        if endpoint not in ENDPOINT_PATHS:
            fail(f"--endpoint must be one of {', '.join(ENDPOINT_PATHS)}, got {endpoint!r}")
        if not url.startswith(("http://", "https://")):
            fail(f"--url must start with http:// or https://, got {url!r}")
        if rerank_documents < 1:
            fail(f"--rerank-documents must be at least 1, got {rerank_documents}")
        for name, value in (
            ("--timeout", timeout),
            ("--slo-ttft-ms", slo_ttft_ms),
            ("--slo-tpot-ms", slo_tpot_ms),
        ):
            check_number(name, value)
        check_number("--slo-e2el-ms", slo_e2el_ms)
        check_number("--lag-threshold-ms", lag_threshold_ms)
        check_report_paths(out, plot)
        req = ReplayRequest(
            trace=trace,
            url=url,
            model=model,
            format=format,
            endpoint=endpoint,
            api_key=api_key,
            schedule=ScheduleOptions(
                rate_scale=rate_scale,
                rate=rate,
                arrival="gamma" if burstiness != 1.0 else "poisson",
                burstiness=burstiness,
                start_s=start,
                duration_s=duration,
                max_requests=max_requests,
                seed=seed,
                latest_send_s=REPLAY_LATEST_SEND_S,
            ),
            concurrency=concurrency,
            timeout_s=timeout,
            skip_bad_rows=skip_bad_rows,
            slo=Slo(slo_ttft_ms, slo_tpot_ms, slo_e2el_ms),
            lag_threshold_ms=lag_threshold_ms,
            out=out,
            plot_dir=plot,
            seed=seed,
            progress=not quiet,
            lora_modules=tuple(lora_modules or ()),
            lora_assignment=lora_assignment,
            rerank_documents=rerank_documents,
        )
        try:
            console = table_console(stderr=True)
            raise_open_files_limit()
            outcome = run_replay(req, console, summary=False)
        except ReplayInterrupted as e:
            typer.echo(f"{e}", err=True)
            raise typer.Exit(130) from None  # as a shell reports a run stopped by Ctrl-C
        except (TraceError, ScheduleError, SpecError, ReplayError, LoraError) as e:
            fail(str(e))
        m = outcome.metrics
        print_outcome(console, outcome)
        if as_json:
            typer.echo(json.dumps(outcome.report["summary"], indent=1))
        if out is not None:
            typer.echo(f"report: {out}", err=True)
        for p in outcome.plots:
            typer.echo(f"plot: {p}", err=True)
        if outcome.result.interrupted:
            cancelled = m.errors.get("cancelled", 0)
            typer.echo(f"interrupted: {m.sent} requests sent, {cancelled} in flight cancelled", err=True)
            raise typer.Exit(130)  # as a shell reports a run stopped by Ctrl-C
