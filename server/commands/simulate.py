"""`mosaic simulate`: replay a trace through the router, KV ledger and autoscaler over a simulated fleet."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import typer
from rich.table import Table

from loadgen.console import percent_down
from loadgen.formats import open_trace
from loadgen.trace import TraceError
from scheduler.autoscaler.factory import POLICY_NAMES, PolicyError, build_policy
from scheduler.routing.config import RoutingConfigError
from server.commands.common import check_number, check_report_paths, fail, table_console
from simulator.cluster import ClusterSimulator
from simulator.cluster_config import FleetConfigError, load_fleet, pool_specs
from simulator.cluster_report import build_report, write_plots
from simulator.trace_adapter import sim_requests


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate(
        trace: str = typer.Option(
            ..., "--trace", help="trace file (any format `mosaic replay` reads) or synthetic: spec"
        ),
        fleet: Path = typer.Option(..., "--fleet", help="fleet YAML: pools, SLO, cold start, intervals"),
        policy: str = typer.Option(
            "mosaic", "--policy", help=f"autoscaling policy: {', '.join(POLICY_NAMES)}"
        ),
        out: Path | None = typer.Option(
            None, "--out", help="write the JSON report (schema mosaic.simulate/v1)"
        ),
        plot: Path | None = typer.Option(None, "--plot", help="write replicas.png and latency.png here"),
        trace_format: str | None = typer.Option(None, "--format", help="force the trace format"),
        rate_scale: float = typer.Option(1.0, "--rate-scale", help="replay the trace this many times faster"),
        rate: float | None = typer.Option(
            None, "--rate", help="Poisson arrivals at this rate (untimed traces)"
        ),
        max_requests: int | None = typer.Option(None, "--max-requests", min=1),
        seed: int = typer.Option(0, "--seed"),
        as_json: bool = typer.Option(False, "--json", help="print the JSON report instead of the table"),
    ) -> None:
        """Discrete-event cluster simulation: GPU-hours, $, SLO attainment, replicas over time."""
        check_number("--rate-scale", rate_scale)
        check_number("--rate", rate)
        check_report_paths(out, plot)
        try:
            cfg = load_fleet(fleet)
            specs = pool_specs(cfg)
            scaling = build_policy(
                policy,
                specs,
                cfg.autoscaler_config(),
                {p.name: p.replicas for p in cfg.pools},
                check_bounds=True,
            )
            source = open_trace(trace, trace_format, seed=seed)
            sim = ClusterSimulator(cfg, scaling, policy)
        except (FleetConfigError, PolicyError, TraceError, RoutingConfigError) as exc:
            fail(str(exc))
        except ValueError as exc:  # anything else the simulator's parts refuse (engine limits, ...)
            fail(f"cannot simulate fleet {fleet}: {exc}")
        if not source.timed and rate is None:
            fail(f"trace {trace} has no arrival times: give --rate")
        try:
            arrivals = sim_requests(source, rate_scale, rate, max_requests, seed)
            first = next(arrivals, None)  # read the first row now: an empty trace has no report to make
        except (TraceError, ValueError) as exc:
            fail(str(exc))
        if first is None:
            fail(f"the trace has no requests: {trace} {source.stats.why_empty()}")
        started = time.perf_counter()
        try:
            result = sim.run(itertools.chain((first,), arrivals))
        except (TraceError, ValueError) as exc:
            fail(str(exc))
        report = build_report(result, time.perf_counter() - started)
        # rows the reader left out (zero lengths, failed in the source, malformed with --skip-bad-rows), as
        # replay's report has them: the requests above are only the rows that were read
        report["trace"] = source.stats.as_dict()
        try:
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=2) + "\n")
            if plot is not None:
                write_plots(report, result, plot)
        except OSError as exc:
            fail(f"cannot write {exc.filename or out or plot}: {exc.strerror or exc}")
        if as_json:
            typer.echo(json.dumps(report, indent=2))
        else:
            table_console().print(summary_table(report))


def summary_table(report: dict) -> Table:
    table = Table(title=f"mosaic simulate — policy {report['policy']}", show_header=False)
    req, slo = report["requests"], report["slo"]
    rows = [
        (
            "requests",
            f"{report['trace_requests']} ({req['completed']} completed, {req['failed']} failed, "
            f"{req['aborted_by_scale_in']} aborted by scale-in)",
        ),
        (
            "simulated time",
            f"{report['simulated_s']:.0f} s in {report['wall_s']:.1f} s wall "
            f"(simulated {report['sim_requests_per_wall_s']:,.0f} requests per wall-clock second)",
        ),
        (
            "SLO attainment",
            f"{percent_down(slo['attainment'])} (TTFT ≤ {slo['ttft_ms']:.0f} ms: "
            f"{percent_down(slo['attainment_ttft'])}, TPOT ≤ {slo['tpot_ms']:.0f} ms: "
            f"{percent_down(slo['attainment_tpot'])})",
        ),
        ("goodput", f"{report['goodput_rps']:.2f} req/s"),
        (
            "GPU-hours",
            ", ".join(f"{g} {h:.2f}" for g, h in report["gpu_hours"]["by_gpu"].items())
            + f" (total {report['gpu_hours']['total']:.2f})",
        ),
        ("cost", f"${report['cost_usd']['total']:.2f}"),
        ("utilization", f"{report['utilization']:.1%}" if report["utilization"] is not None else "-"),
        ("scale events", str(len(report["scale_events"]))),
        ("preemptions", str(report["preemptions"])),
    ]
    topology = report.get("topology")
    if topology:
        rows.append(("topology", topology_summary(topology)))
    for key, value in rows:
        table.add_row(key, value)
    return table


def topology_summary(topology: dict) -> str:
    """One line from the report's `topology` section: KV transfers across domains, the links, and with an
    inventory its nodes, domains, worst cross-domain P/D pairs and clipped scale-ups."""
    transfers = topology["kv_transfers"]
    total = transfers["intra_domain"] + transfers["cross_domain"]
    share = f" ({transfers['cross_domain'] / total:.1%})" if total else ""
    line = (
        f"{transfers['cross_domain']} of {total} KV transfers across domains{share}; "
        f"links {topology['kv_link_gbps']:g} GB/s within, {topology['kv_link_cross_domain_gbps']:g} GB/s across"
    )
    if "nodes" in topology:
        line += (
            f"; {topology['nodes']} nodes in {len(topology['domains'])} domains, "
            f"max {topology['max_cross_domain_pairs']} cross-domain P/D pairs, "
            f"{len(topology['shortfalls'])} clipped scale-ups"
        )
    return line
