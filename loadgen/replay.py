"""A whole replay as one call: trace → schedule → requests → metrics → report, table and plots.

`mosaic replay` is a thin shell over `run_replay`; tests and benches call it directly. Input errors
(`TraceError`, `ScheduleError`) are raised before any request is sent when they can be known up front,
and as soon as the bad row is reached otherwise (in-flight requests are then cancelled).

Ctrl-C (SIGINT, on the main thread) stops the replay rather than killing it: nothing more is sent, the
requests in flight are cancelled (error type `cancelled`), and the metrics, report and plots of what was
measured are written with `summary.interrupted: true`. A second Ctrl-C kills it as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from loadgen.client import one_line
from loadgen.console import ProgressDisplay, print_summary
from loadgen.formats import Trace, open_trace
from loadgen.lora import LoraError, check_lora_modules
from loadgen.metrics import Metrics, Slo, compute_metrics
from loadgen.plots import write_plots
from loadgen.prompts import RERANK_DOCUMENTS
from loadgen.report import ReplayConfig, build_report, write_report
from loadgen.runner import FATAL_ERRORS, GIVE_UP_AFTER, RunOptions, RunResult, Target, replay
from loadgen.schedule import ScheduleOptions, schedule
from loadgen.synthetic import parse_spec


class ReplayError(ValueError):
    """Replay options that cannot work (bad concurrency or timeout, nothing to send)."""


class ReplayInterrupted(ReplayError):
    """Ctrl-C before the first request was sent: nothing to report (the CLI exits 130, as for any Ctrl-C)."""


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """Everything `mosaic replay` takes."""

    trace: str
    url: str
    model: str
    format: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    concurrency: int | None = None
    timeout_s: float | None = 600.0
    skip_bad_rows: bool = False
    slo: Slo = field(default_factory=Slo)
    lag_threshold_ms: float = 5.0
    out: Path | None = None
    plot_dir: Path | None = None
    seed: int = 0
    progress: bool = True
    # each request names one of these LoRA adapters instead of `model` (loadgen.lora); () = none
    lora_modules: tuple[str, ...] = ()
    lora_assignment: str = "random"  # random | round-robin
    rerank_documents: int = RERANK_DOCUMENTS  # --endpoint rerank: documents per request


@dataclass(slots=True)
class ReplayOutcome:
    metrics: Metrics
    result: RunResult
    report: dict[str, Any]
    plots: list[Path] = field(default_factory=list)


def check_target(url: str, api_key: str | None) -> None:
    """Refuse a URL no request could reach and a key no header can carry, before anything is sent (each
    would otherwise fail every request alike, or raise out of the first one)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ReplayError(f"--url {url!r} is not a valid URL: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ReplayError(f"--url must be http(s)://HOST[:PORT][/PATH], got {url!r}")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise ReplayError(f"--url port must be 1-65535, got {parsed.port}")
    if api_key is not None and not (api_key.isascii() and api_key.isprintable()):
        raise ReplayError(
            "--api-key (or MOSAIC_API_KEY) must be printable ASCII: it is sent in an HTTP header"
        )


def prepare(req: ReplayRequest) -> Trace:
    """Check the target, open and check the trace and the schedule options before anything is sent."""
    check_target(req.url, req.api_key)
    if req.lora_modules:
        check_lora_modules(req.lora_modules, req.lora_assignment)
    elif req.lora_assignment != "random":  # vLLM ignores it then; here it is a forgotten --lora-modules
        raise LoraError("--lora-assignment picks among --lora-modules: give them, or drop it")
    trace = open_trace(req.trace, req.format, req.skip_bad_rows, req.seed)
    try:
        req.schedule.validate(trace.timed)
        if req.concurrency is not None and req.concurrency <= 0:
            raise ReplayError(f"--concurrency must be > 0, got {req.concurrency}")
        if req.timeout_s is not None and req.timeout_s <= 0:
            raise ReplayError(f"--timeout must be > 0 seconds, got {req.timeout_s}")
    except BaseException:
        trace.close()  # a pipe opened to detect its format
        raise
    return trace


def _known_total(req: ReplayRequest, trace: Trace) -> int | None:
    total = req.schedule.max_requests
    if trace.format == "synthetic":
        spec = parse_spec(trace.source)
        if spec.n is not None and spec.duration_s is None:
            total = spec.n if total is None else min(spec.n, total)
    return total


def _refused(url: str, result: RunResult, first_n: bool) -> str:
    """The one line for a replay whose requests all failed in a way no load explains (`FATAL_ERRORS`):
    nothing listens at the URL, or the server refuses us (the key, the path or the model name is wrong).
    `first_n`: the replay gave up after its first `GIVE_UP_AFTER` requests, else it played them all."""
    fatal = [r for r in result.records if r.error_type in FATAL_ERRORS]
    which = f"the first {GIVE_UP_AFTER} requests" if first_n else "every request"
    if all(r.error_type == "connect_error" for r in fatal):
        first = fatal[0].error if fatal else None
        failed = f"{which} all failed" if first_n else f"{which} failed"
        return f"cannot connect to {url}: {failed} to connect ({one_line(first or 'connect_error')})"
    refused = next(r for r in fatal if r.error_type != "connect_error")
    kinds = ", ".join(sorted({r.error_type or "" for r in fatal}))
    return f"{url} refused {which} ({kinds}): {one_line(refused.error or '')}"


async def run_replay_async(
    req: ReplayRequest, console: Console | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> ReplayOutcome:
    console = console or Console(stderr=True)
    trace = prepare(req)
    target = Target(
        req.url,
        req.model,
        req.endpoint,
        req.api_key,
        tuple(req.lora_modules),
        req.lora_assignment,
        req.rerank_documents,
    )
    opts = RunOptions(req.concurrency, req.timeout_s, req.seed)
    scheduled = schedule(trace, req.schedule)
    with _stop_on_sigint() as stop:
        if req.progress:
            with ProgressDisplay(console, _known_total(req, trace)) as progress:
                result = await replay(scheduled, target, opts, progress, transport, stop)
        else:
            result = await replay(scheduled, target, opts, None, transport, stop)
    if result.gave_up:
        raise ReplayError(
            _refused(req.url, result, f"the first {GIVE_UP_AFTER} requests all") + "; the rest were not sent"
        )
    if not result.records:
        if result.interrupted:
            raise ReplayInterrupted("interrupted before any request was sent")
        raise ReplayError("no requests to send: the trace (or the --start/--duration window) is empty")
    metrics = compute_metrics(result.records, result.duration_s, req.slo, req.lag_threshold_ms)
    if metrics.completed == 0 and set(metrics.errors) <= FATAL_ERRORS:
        # Nothing was measured: say so before --out replaces an earlier run's report with an empty one.
        raise ReplayError(_refused(req.url, result, first_n=False))
    s = req.schedule
    config = ReplayConfig(
        trace=req.trace,
        format=trace.format,
        url=req.url,
        endpoint=req.endpoint,
        model=req.model,
        rate_scale=s.rate_scale,
        rate=s.rate,
        # the re-timing `--rate` applies; with the trace's own times there is none to report
        arrival=s.arrival if s.rate is not None else None,
        burstiness=s.burstiness if s.rate is not None else None,
        start_s=s.start_s,
        duration_s=s.duration_s,
        max_requests=s.max_requests,
        concurrency=req.concurrency,
        timeout_s=req.timeout_s,
        seed=req.seed,
        lora_modules=tuple(req.lora_modules) if req.lora_modules else None,
        lora_assignment=req.lora_assignment if req.lora_modules else None,
        extra={"rerank_documents": req.rerank_documents} if req.endpoint == "rerank" else {},
    )
    trace_stats = {"source": trace.source, "format": trace.format, **trace.stats.as_dict()}
    report = build_report(config, metrics, result.records, trace_stats, result.started_at)
    report["summary"]["interrupted"] = result.interrupted
    outcome = ReplayOutcome(metrics, result, report)
    try:
        if req.out is not None:
            write_report(report, req.out)
        if req.plot_dir is not None:
            outcome.plots = write_plots(result.records, req.plot_dir)
    except OSError as exc:
        where = exc.filename or req.out or req.plot_dir
        raise ReplayError(f"cannot write {where}: {exc.strerror or exc}") from None
    return outcome


@contextlib.contextmanager
def _stop_on_sigint() -> Iterator[asyncio.Event]:
    """An event the first SIGINT sets (the replay then stops and reports); the handler is removed at once,
    so a second SIGINT interrupts as Python does. Without a main-thread loop, an event nothing sets."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread, or no signals here
        yield stop
        return
    try:
        yield stop
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def run_replay(req: ReplayRequest, console: Console | None = None, summary: bool = True) -> ReplayOutcome:
    """Run a replay to completion on a fresh event loop and (unless `summary=False`) print its summary."""
    console = console or Console(stderr=True)
    outcome = asyncio.run(run_replay_async(req, console))
    if summary:
        print_outcome(console, outcome)
    return outcome


def print_outcome(console: Console, outcome: ReplayOutcome) -> None:
    """The summary tables, and the trace rows the run left out (malformed and skipped, or not replayable):
    only the report had said so (`trace.skipped_bad_rows`), and a run on a fraction of its trace looked whole."""
    print_summary(console, outcome.metrics)
    trace = outcome.report["trace"]
    left = [(kind, trace[f"{kind}_by_reason"]) for kind in ("skipped", "dropped")]
    said = [
        f"{kind} {sum(by.values())} ({', '.join(f'{w} {n}' for w, n in by.items())})"
        for kind, by in left
        if by
    ]
    if said:
        console.print(f"trace rows left out: {'; '.join(said)} of {trace['rows']}", style="yellow")
