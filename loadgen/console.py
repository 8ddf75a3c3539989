"""What the user sees: a `rich` progress bar while the replay runs, then vLLM-style summary tables.

The progress bar counts finished requests against the total when it is known (`--max-requests`, a
synthetic `n`), shows requests in flight and errors, and refreshes 4 times a second from a rich thread
(cheap next to the event loop). A replay whose p99 send lag exceeds the threshold ends with a red
banner: its offered load was not the one asked for.
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from loadgen.client import RequestRecord
from loadgen.metrics import Metrics, Stats


class ProgressDisplay:
    """An `Observer` for `loadgen.runner.replay` that drives a rich progress bar."""

    def __init__(self, console: Console, total: int | None, description: str = "replay") -> None:
        self.in_flight = 0
        self.errors = 0
        self.done_count = 0
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("in flight {task.fields[in_flight]:>4}  errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            console=console,
            refresh_per_second=4,
            transient=False,
        )
        self._task: TaskID = self._progress.add_task(description, total=total, in_flight=0, errors=0)

    def __enter__(self) -> ProgressDisplay:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def sent(self, rec: RequestRecord) -> None:
        self.in_flight += 1
        self._progress.update(self._task, in_flight=self.in_flight)

    def done(self, rec: RequestRecord) -> None:
        self.in_flight -= 1
        self.done_count += 1
        self.errors += not rec.success
        self._progress.update(self._task, advance=1, in_flight=self.in_flight, errors=self.errors)


def _fmt(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def percent_down(fraction: float, decimals: int = 2) -> str:
    """`fraction` as a percentage rounded down: an attainment short of 1 never reads 100.00% (one failed
    request in 20,000 is 99.99%, not a rounded-up 100.00% beside "1 failed")."""
    scale = 10**decimals
    value = math.floor(fraction * 100 * scale + 1e-6) / scale  # the epsilon absorbs binary error (0.29)
    return f"{value:.{decimals}f}%"


def summary_table(m: Metrics, title: str = "Serving benchmark result") -> Table:
    """The headline numbers, in vLLM benchmark_serving's order and wording."""
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("Successful requests", f"{m.completed}"),
        ("Failed requests", f"{m.failed}"),
        ("Benchmark duration (s)", _fmt(m.duration_s)),
        ("Total input tokens", f"{m.total_input_tokens}"),
        ("Total generated tokens", f"{m.total_output_tokens}"),
        ("Request throughput (req/s)", _fmt(m.request_throughput)),
        ("Output token throughput (tok/s)", _fmt(m.output_throughput)),
        ("Total token throughput (tok/s)", _fmt(m.total_token_throughput)),
    ]
    if m.goodput is not None:
        rows.append(("Request goodput (req/s)", _fmt(m.goodput)))
        rows.append(("SLO attainment (%)", percent_down(m.slo_attainment or 0.0).removesuffix("%")))
    for label, value in rows:
        t.add_row(label, value)
    return t


def latency_table(m: Metrics) -> Table:
    """TTFT / TPOT / ITL / E2EL / send lag, one row each, in ms."""
    t = Table(
        title="Latency (ms; TPOT excludes the first token; ITL = gaps between chunks)", title_justify="left"
    )
    for col in ("metric", "mean", "median", "p90", "p95", "p99", "max", "n"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for name, s in (
        ("TTFT", m.ttft),
        ("TPOT", m.tpot),
        ("ITL", m.itl),
        ("E2EL", m.e2el),
        ("send lag", m.send_lag),
    ):
        t.add_row(name, *_stat_cells(s))
    return t


def _stat_cells(s: Stats) -> list[str]:
    return [_fmt(s.mean), _fmt(s.median), _fmt(s.p90), _fmt(s.p95), _fmt(s.p99), _fmt(s.max), str(s.count)]


def print_summary(console: Console, m: Metrics) -> None:
    console.print(summary_table(m))
    console.print(latency_table(m))
    if m.errors:
        console.print("errors: " + ", ".join(f"{k} {v}" for k, v in m.errors.items()), style="yellow")
    if m.output_length_mismatches:
        console.print(
            f"{m.output_length_mismatches} completed request(s) returned a different number of tokens than max_tokens",
            style="yellow",
        )
    if m.lag_exceeded:
        console.print(lag_banner(m))


def lag_banner(m: Metrics) -> Panel:
    return Panel(
        f"p99 send lag {m.send_lag.p99:.1f} ms exceeds {m.lag_threshold_ms:g} ms: the generator could not keep the "
        "trace's schedule (machine overloaded or rate too high for one process). The offered load was lower "
        "and burstier than requested; do not trust the throughput/latency figures as a measure of the target.",
        title="WARNING: load generator lag",
        style="bold red",
    )
