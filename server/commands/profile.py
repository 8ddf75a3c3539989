"""`mosaic profile (--url U | --sim) --gpu G --model M --out P`: max request rate per length bucket within an SLO.

For every (input, output) bucket the highest Poisson request rate whose p90 TPOT (and p90 TTFT, when
given) meets the SLO with a stable queue and no failures is searched on a 5% rate grid
(`loadgen.profile_search`). `--sim` measures on the engine model (`simulator.profile_driver`: seconds per
profile); `--url` measures a live server in real time (`loadgen.profile_url`). The output is the planner's
profile file (`placement.profiles`, schema mosaic.profile/v1): YAML for .yaml/.yml, JSON otherwise.

`--role prefill|decode` (only with `--sim`) profiles one phase of P/D serving, as the planner reads it:
prefill = max req/s of the bucket's prompts one instance prefills (max_tokens 1) within the p90 TTFT limit
(`--slo-ttft-ms`, required; the TPOT limit does not apply and is not recorded); decode = max req/s of the
bucket's remote-prefilled requests (KV pulled over `--kv-link-gbps`) one instance decodes within the p90
TPOT limit (and TTFT, if given). See `simulator.profile_driver`. A live server cannot be told to act as
one phase without a P/D deployment behind it, so `--url` with a role other than mixed exits 2.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path

import typer
from rich.table import Table

from loadgen.profile_checkpoint import Checkpoint, CheckpointError, checkpoint_path
from loadgen.profile_search import (
    MAX_GRID_RATES,
    SearchConfig,
    SearchResult,
    SearchSlo,
    finest_resolution,
    grid_size,
)
from loadgen.profile_url import ProfileError, preflight, url_measure_factory
from loadgen.profiling import (
    Bucket,
    MeasureFactory,
    ProbePlan,
    ProfileGrid,
    QueueBound,
    buckets,
    profile_grid,
)
from loadgen.replay import ReplayError, check_target
from loadgen.runner import RunOptions, Target
from placement.catalog import CatalogError, load_catalog
from placement.counts import MAX_PLAN_INSTANCES
from placement.perf_model import PerfModel
from placement.profiles import MeasuredPoint, Role, ThroughputProfile, save_profile
from placement.profiles import Slo as ProfileSlo
from server.commands.common import (
    check_number,
    check_output_file,
    fail,
    raise_open_files_limit,
    table_console,
)
from simulator.engine import EngineConfig
from simulator.profile_driver import capacity_hint, engine_max_model_len, sim_measure_factory

DEFAULT_INPUT_EDGES = "1,256,1024,4096,8193"
DEFAULT_OUTPUT_EDGES = "1,64,256,1024,2049"


def parse_edges(name: str, text: str) -> list[int]:
    try:
        edges = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"{name} must be comma-separated integers like {DEFAULT_INPUT_EDGES}, got {text!r}")
    if len(edges) < 2 or edges[0] < 1 or any(b <= a for a, b in itertools.pairwise(edges)):
        fail(f"{name} must be ≥ 1 and strictly increasing, at least two edges, got {text!r}")
    return edges


def check_edges_within_context(name: str, edges: list[int], context: int, model: str) -> None:
    """Exit 2 when a bucket [lo, hi) of `edges` is partly within the model's context and partly past it: its
    rate, probed with the lengths that fit, would stand for the whole bucket, and `mosaic plan` would then
    count requests past the context as served. A bucket wholly past it is fine ("cannot"), as is one ending
    at context + 1 (the default's last edge: an input of `context` tokens leaves room for no output)."""
    for lo, hi in itertools.pairwise(edges):
        if lo < context and hi > context + 1:
            fail(
                f"{name}: the bucket [{lo}, {hi}) crosses {model}'s context of {context:,} tokens, so its "
                f"rate would stand for lengths no instance serves; put an edge at {context + 1} or below"
            )


def _rate(r: float) -> float:
    """A rate as written: 6 significant figures, rounded down (4 decimals wrote a passing 0.00001 req/s
    as 0, "cannot", and a passing 0.000155 as 0.0002, above anything measured)."""
    if r <= 0:
        return 0.0
    digits = 5 - math.floor(math.log10(r))
    return math.floor(r * 10**digits * (1 + 1e-12)) / 10**digits  # the 1e-12: 20.58 is not 20.5799


def build_profile(
    grid: ProfileGrid,
    model: str,
    gpu: str,
    tp: int,
    source: str,
    slo: SearchSlo,
    inp: list[int],
    out: list[int],
    role: Role = Role.MIXED,
) -> ThroughputProfile:
    measured = [
        [
            None
            if m is None
            else MeasuredPoint(
                rate=_rate(m.rate),
                ttft_p90_ms=round(m.ttft_p90_ms, 3),
                tpot_p90_ms=round(m.tpot_p90_ms, 3),
                n=m.n,
            )
            for m in row
        ]
        for row in grid.measured
    ]
    return ThroughputProfile.model_validate(
        {
            "schema": "mosaic.profile/v1",
            "model": model,
            "gpu": gpu,
            "tp": tp,
            "role": role,
            "source": source,
            "slo": ProfileSlo(tpot_ms=slo.tpot_ms, ttft_ms=slo.ttft_ms),
            "input_edges": inp,
            "output_edges": out,
            "max_rate": [[_rate(r) for r in row] for row in grid.max_rate],
            "measured": measured,
        }
    )


def _slo_text(slo: ProfileSlo) -> str:
    """`TPOT p90 ≤ 40 ms, TTFT p90 ≤ 2000 ms`: the targets a profile was measured against."""
    parts = [("TPOT", slo.tpot_ms), ("TTFT", slo.ttft_ms), ("E2E", slo.e2e_ms)]
    return ", ".join(f"{name} p90 ≤ {ms:g} ms" for name, ms in parts if ms is not None)


def _table(profile: ThroughputProfile) -> Table:
    role = "" if profile.role is Role.MIXED else f" ({profile.role.value})"
    t = Table(title=f"{profile.model} on {profile.gpu}{role}: max req/s within {_slo_text(profile.slo)}")
    t.add_column("input \\ output")
    edges_o = profile.output_edges
    for j in range(len(edges_o) - 1):
        t.add_column(f"[{edges_o[j]},{edges_o[j + 1]})", justify="right")
    for i, row in enumerate(profile.max_rate):
        t.add_row(f"[{profile.input_edges[i]},{profile.input_edges[i + 1]})", *(f"{r:.2f}" for r in row))
    return t


def _check_target(target: Target) -> None:
    """Exit 2 with one line unless the URL, the key and one small request work (else every probe fails
    alike, and hours later the profile would be all zeros)."""
    try:
        check_target(target.url, target.api_key)
        preflight(target)
        raise_open_files_limit()  # the search drives hundreds of concurrent requests
    except (ReplayError, ProfileError) as e:
        fail(str(e))


def _open_checkpoint(out: Path, settings: dict[str, object], resume: bool) -> Checkpoint:
    """`--resume`: the interrupted run's checkpoint, which must have these settings. Otherwise a fresh one,
    refused while an unfinished run's checkpoint is there (starting over would overwrite hours of probes)."""
    path = checkpoint_path(out)
    check_output_file(path, "--out")
    if resume:
        try:
            return Checkpoint.load(path, settings)
        except CheckpointError as e:
            fail(f"--resume: {e}")
    if path.exists():
        fail(
            f"--out {out}: an unfinished run's checkpoint is at {path}: pass --resume to continue it, or delete "
            "it to start over"
        )
    return Checkpoint.fresh(path, settings)


def _kept(checkpoint: Checkpoint, total: int) -> str:
    """What an interrupted or failed run leaves behind, for its last line."""
    if not checkpoint.done:
        return ""
    return (
        f"; {len(checkpoint.done)} of {total} buckets are kept in {checkpoint.path}: rerun the same command with "
        "--resume to continue"
    )


def register(app: typer.Typer) -> None:
    @app.command("profile")
    def profile_cmd(
        gpu: str = typer.Option(..., "--gpu", help="GPU type from the catalog (e.g. H100, A100-80GB, L4)."),
        model: str = typer.Option(..., "--model", help="Model from the catalog (e.g. llama-3-8b)."),
        out: Path = typer.Option(..., "--out", help="Profile file to write (.yaml/.yml or .json)."),
        sim: bool = typer.Option(False, "--sim", help="Measure the engine model directly (no HTTP, fast)."),
        url: str | None = typer.Option(
            None, "--url", help="Measure a live server at this base URL (real time)."
        ),
        tp: int = typer.Option(1, "--tp", help="Tensor-parallel degree of one instance."),
        role: str = typer.Option(
            "mixed",
            "--role",
            help="mixed (whole requests), prefill (TTFT-bound, needs --slo-ttft-ms) or decode (TPOT-bound); "
            "prefill/decode need --sim.",
        ),
        kv_link_gbps: float = typer.Option(
            25.0, "--kv-link-gbps", help="--role decode: GB/s the prompt's KV arrives at."
        ),
        slo_tpot_ms: float | None = typer.Option(
            40.0, "--slo-tpot-ms", help="p90 TPOT limit (ms); 0 = none."
        ),
        slo_ttft_ms: float | None = typer.Option(None, "--slo-ttft-ms", help="p90 TTFT limit (ms)."),
        input_edges: str = typer.Option(
            DEFAULT_INPUT_EDGES, "--input-edges", help="Input bucket edges, comma-separated."
        ),
        output_edges: str = typer.Option(DEFAULT_OUTPUT_EDGES, "--output-edges", help="Output bucket edges."),
        seed: int = typer.Option(0, "--seed", help="Seed of the test requests (lengths, arrivals)."),
        resolution: float = typer.Option(0.05, "--resolution", help="Relative step of the rate grid."),
        min_rate: float = typer.Option(0.01, "--min-rate", help="Lowest rate tried; failing it means 0."),
        max_rate: float = typer.Option(2000.0, "--max-rate", help="Highest rate tried."),
        max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="--sim: vLLM max_num_seqs."),
        max_num_batched_tokens: int = typer.Option(
            8192, "--max-num-batched-tokens", help="--sim: token budget per step."
        ),
        served_model: str | None = typer.Option(
            None, "--served-model", help="--url: model name in requests."
        ),
        api_key: str | None = typer.Option(
            None, "--api-key", envvar="MOSAIC_API_KEY", help="--url: bearer key."
        ),
        probe_window_s: float = typer.Option(
            20.0, "--probe-window-s", help="Minimum measured window per probe (s)."
        ),
        probe_requests: int = typer.Option(
            300, "--probe-requests", help="Minimum requests per measured window."
        ),
        probe_e2e_factor: float = typer.Option(
            1.5, "--probe-e2e-factor", help="Measured window ≥ this × the expected end-to-end latency."
        ),
        queue_factor: float = typer.Option(
            5.0, "--queue-factor", help="Sustainable: p90 TTFT ≤ this × unloaded TTFT + 1 s (0 = off)."
        ),
        resume: bool = typer.Option(
            False,
            "--resume",
            help="Continue an interrupted run from its checkpoint (<out>.partial.json), with the same settings.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the profile as JSON on stdout."),
    ) -> None:
        """Profile one GPU type and model: the max request rate per (input, output) bucket within the SLO."""
        if sim == (url is not None):
            fail("give exactly one of --sim or --url URL")
        if url is not None and not url.startswith(("http://", "https://")):
            fail(f"--url must start with http:// or https://, got {url!r}")
        try:
            catalog = load_catalog()
            gpu_spec, model_spec = catalog.gpu(gpu), catalog.model(model)
        except CatalogError as e:
            fail(str(e))
        if not 1 <= tp <= MAX_PLAN_INSTANCES:  # a profile file holds no more (checked before hours of probes)
            fail(f"--tp must be in 1..{MAX_PLAN_INSTANCES:,}, got {tp}")
        for name, value in (
            ("--resolution", resolution),
            ("--min-rate", min_rate),
            ("--max-rate", max_rate),
            ("--probe-window-s", probe_window_s),
            ("--kv-link-gbps", kv_link_gbps),
            ("--slo-ttft-ms", slo_ttft_ms),
        ):
            check_number(name, value)
        for name, value in (
            ("--slo-tpot-ms", slo_tpot_ms),  # 0 = no TPOT limit
            ("--probe-e2e-factor", probe_e2e_factor),
            ("--queue-factor", queue_factor),  # 0 = off
        ):
            check_number(name, value, inclusive=True)
        if not max_rate > min_rate:
            fail(f"--max-rate must exceed --min-rate ({min_rate:g}), got {max_rate:g}")
        if grid_size(min_rate, max_rate, resolution) > MAX_GRID_RATES:
            finest = finest_resolution(min_rate, max_rate)
            if not math.isfinite(finest):
                fail(f"--min-rate {min_rate:g} and --max-rate {max_rate:g} are too far apart for a rate grid")
            fail(
                f"--resolution {resolution:g} makes over {MAX_GRID_RATES:,} rates from --min-rate {min_rate:g} "
                f"to --max-rate {max_rate:g}: give --resolution ≥ {finest:g}"
            )
        coarsest = max_rate / min_rate - 1  # one step from --min-rate past --max-rate: a grid of one rate
        if grid_size(min_rate, max_rate, resolution) < 2:
            fail(
                f"--resolution {resolution:g} leaves only --min-rate {min_rate:g} between it and --max-rate "
                f"{max_rate:g} (every bucket would read {min_rate:g} req/s): give --resolution < {coarsest:g}"
            )
        if probe_requests < 1:
            fail(f"--probe-requests must be ≥ 1, got {probe_requests}")
        if role not in {r.value for r in Role}:
            fail(f"--role must be mixed, prefill or decode, got {role!r}")
        the_role = Role(role)
        if url is not None and the_role is not Role.MIXED:
            fail(f"--role {role} is supported with --sim only (a live server is profiled as mixed)")
        slo = SearchSlo(tpot_ms=slo_tpot_ms or None, ttft_ms=slo_ttft_ms or None)
        if the_role is Role.PREFILL:  # one output token: no TPOT to judge
            if slo.ttft_ms is None:
                fail("--role prefill is judged on TTFT: give --slo-ttft-ms")
            slo = SearchSlo(ttft_ms=slo.ttft_ms)
        if the_role is Role.DECODE and slo.tpot_ms is None:
            fail("--role decode is judged on TPOT: give --slo-tpot-ms")
        if slo.tpot_ms is None and slo.ttft_ms is None:
            fail("give an SLO: --slo-tpot-ms and/or --slo-ttft-ms")
        inp, outp = parse_edges("--input-edges", input_edges), parse_edges("--output-edges", output_edges)
        for name, edges in (("--input-edges", inp), ("--output-edges", outp)):
            check_edges_within_context(name, edges, model_spec.max_context, model_spec.name)
        tp_error = model_spec.tp_error(tp)  # vLLM would not start such an instance: no profile of one
        if tp_error is not None:
            fail(f"--tp {tp}: {tp_error}")
        perf = PerfModel(gpu_spec, model_spec, tp)
        try:
            config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        except ValueError as e:
            fail(str(e))
        if out.suffix.lower() not in (".yaml", ".yml", ".json"):  # the suffix picks the format
            fail(f"--out {out}: name a .yaml, .yml or .json file (the suffix picks the format)")
        check_output_file(out, "--out")
        settings = {
            "gpu": gpu_spec.name,
            "model": model_spec.name,
            "tp": tp,
            "role": the_role.value,
            "source": "sim" if sim else "url",
            "url": url,
            "served_model": served_model,
            "slo_tpot_ms": slo.tpot_ms,
            "slo_ttft_ms": slo.ttft_ms,
            "input_edges": inp,
            "output_edges": outp,
            "seed": seed,
            "resolution": resolution,
            "min_rate": min_rate,
            "max_rate": max_rate,
            "queue_factor": queue_factor,
            "probe_window_s": probe_window_s,
            "probe_requests": probe_requests,
            "probe_e2e_factor": probe_e2e_factor,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "kv_link_gbps": kv_link_gbps,
        }
        checkpoint = _open_checkpoint(out, settings, resume)
        plan = ProbePlan(probe_window_s, probe_requests, probe_e2e_factor)
        factory: MeasureFactory
        console = table_console(stderr=True)
        t0 = time.perf_counter()

        def probing(line: str) -> None:  # --url: each live probe lasts minutes; say what runs
            console.print(f"  {line}  [{time.perf_counter() - t0:.1f} s]", style="dim")

        if sim:
            factory = sim_measure_factory(perf, config, seed, plan, the_role, kv_link_gbps)
        else:
            assert url is not None
            max_len = engine_max_model_len(perf, config) or model_spec.max_context

            def hint(b: Bucket) -> float:
                # an upper bound (the largest batch the KV cache holds, whatever its step time): a live
                # probe lasts ~300 / rate seconds, so the search starts where probes are short and gallops
                # down; a 50 ms-per-token guess started an L4 at 0.06 req/s, in probes of hours
                return capacity_hint(perf, b, math.inf, config, max_len)

            target = Target(url, served_model or model, "completions", api_key)
            _check_target(target)
            factory = url_measure_factory(
                target, model_spec.max_context, seed, plan, RunOptions(), hint, on_probe=probing
            )

        def progress(b: Bucket, res: SearchResult | None) -> None:
            checkpoint.record(b, res)
            if res is None:
                rate = "cannot (does not fit)"
            elif res.unloaded_miss:
                rate = "cannot (misses the SLO, or is refused, one request at a time)"
            elif res.capped:
                rate = f"≥ {res.max_rate:.2f} req/s (passed at the rate grid's top; {len(res.probes)} probes)"
            else:
                rate = f"{res.max_rate:.2f} req/s ({len(res.probes)} probes)"
            console.print(f"{b.label}: {rate}  [{time.perf_counter() - t0:.1f} s]")

        cfg = SearchConfig(min_rate=min_rate, max_rate=max_rate, resolution=resolution)
        total = (len(inp) - 1) * (len(outp) - 1)
        if checkpoint.done:
            console.print(f"resuming: {len(checkpoint.done)} of {total} buckets from {checkpoint.path}")
        try:
            grid = profile_grid(
                inp, outp, factory, slo, cfg, progress, QueueBound(factor=queue_factor), checkpoint.done
            )
        except ProfileError as e:  # unreachable, or refusing every request: no profile is better than zeros
            fail(str(e) + _kept(checkpoint, total))
        except KeyboardInterrupt:
            typer.echo(f"interrupted{_kept(checkpoint, total)}", err=True)
            raise typer.Exit(130) from None  # as a shell reports a run stopped by Ctrl-C
        profile = build_profile(
            grid, model_spec.name, gpu_spec.name, tp, "sim" if sim else "url", slo, inp, outp, the_role
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        save_profile(profile, out)
        checkpoint.remove()
        console.print(_table(profile))
        # buckets that passed at --max-rate itself (this run's or a resumed one's): their limit may be higher
        capped = [b.label for b in buckets(inp, outp) if (r := grid.results.get((b.i, b.j))) and r.capped]
        if capped:  # written as the top of the grid: the planner would buy more instances than needed
            console.print(
                f"{len(capped)} bucket(s) passed at the top of the rate grid (--max-rate {max_rate:g} req/s): "
                f"{', '.join(capped)}; their real limit may be higher: raise --max-rate to measure it"
            )
        console.print(f"profile: {out}  ({time.perf_counter() - t0:.1f} s)")
        if as_json:
            typer.echo(json.dumps(profile.to_dict(), indent=1))
