"""`mosaic autoscale`: only the autoscaler controller — discovery, scraping, decisions, scaling; no API serving.

    mosaic autoscale --config /etc/mosaic/config.yaml          # what the Helm chart's controller Deployment runs
    mosaic autoscale --config mosaic.yaml --cycles 3 --json    # three decisions as JSON lines, then exit
    mosaic autoscale --config mosaic.yaml --metrics-port 9090  # also serve the controller's /metrics

It reads the gateway's config, finds and scrapes the pools' workers through the gateway's own registry
and discovery (`server.gateway.Gateway`, never served over HTTP), and every `autoscaler.interval_s` runs the
policy and applies it through `autoscaler.actuator`: `kubernetes` patches the scale subresource of each
pool's Deployment (`autoscaler.kubernetes.deployments`, default: every kubernetes pool, Deployment named
after the pool), or of the pool's per-domain Deployments (`autoscaler.kubernetes.domains`, placed by the
topology solver with `autoscaler.nodes`; namespace from `autoscaler.kubernetes.namespace`, else `$POD_NAMESPACE`, else `default`),
`dry-run` only records and prints. The gateway-side signals (admission queue, gateway TTFT/TPOT, arrival
rate, lengths) come from scraping the gateways' `/metrics` (`autoscaler.gateways`: static URLs or gateway
pods by label selector; `server.gateway_scrape`), merged over the replicas; without it they are absent.
The `embedded` actuator (simulated workers inside `mosaic serve`) is refused here. Runs until SIGTERM/SIGINT (or `--cycles`). A bad config, a missing `kubernetes`
package or cluster config exits 2 with one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from server.commands.common import check_log_level, configure_logging, fail, python_log_level
from server.config import AuthConfig, ConfigError, MosaicConfig, load_config

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from server.autoscaling import AutoscalerController
    from server.gateway_scrape import GatewayScraper


def kubernetes_deployments(cfg: MosaicConfig) -> dict[str, str]:
    """Pool → Deployment the kubernetes actuator scales (config mapping, else every kubernetes pool by name
    that `autoscaler.kubernetes.domains` does not split per domain, but a pooling one: never scaled)."""
    k = cfg.autoscaler.kubernetes
    if k.deployments:
        return dict(k.deployments)
    return {
        p.name: p.name
        for p in cfg.pools
        if p.endpoints.kubernetes is not None and p.name not in k.domains and p.runner == "generate"
    }


def kubernetes_domains(cfg: MosaicConfig) -> dict[str, dict[str, str]]:
    """Pool → {domain → Deployment}: the pools scaled as one Deployment per network domain."""
    return {pool: dict(by) for pool, by in cfg.autoscaler.kubernetes.domains.items()}


def observer_config(cfg: MosaicConfig) -> MosaicConfig:
    """The config of the gateway object this command builds to observe the pools (its registry and discovery,
    never served): its own in-process controller off (this process is it), no KV peers (it reserves no KV),
    no API keys (it serves no API: the chart's controller pod has no key Secret, and requiring one made it
    exit at start-up), and without the pools' vLLM keys (it only reads /health and /metrics, which vLLM
    does not guard)."""
    return cfg.model_copy(
        update={
            "autoscaler": cfg.autoscaler.model_copy(update={"enabled": False}),
            "pools": [p.model_copy(update={"api_key_env": None}) for p in cfg.pools],
            "gateway": cfg.gateway.model_copy(update={"peers": None}),
            "auth": AuthConfig(),
        }
    )


def _apps_api(in_cluster: bool | None) -> Any:
    from server.discovery import KubernetesUnavailable, load_kubernetes_config

    try:
        return load_kubernetes_config(in_cluster, "the kubernetes actuator").AppsV1Api()
    except KubernetesUnavailable as exc:
        fail(str(exc))


@dataclass(slots=True)
class Standalone:
    """What `mosaic autoscale` runs: the controller, the gateways' scraper (None without
    `autoscaler.gateways`) and the pools the actuator manages."""

    controller: AutoscalerController
    scraper: GatewayScraper | None
    managed: frozenset[str]
    registry: CollectorRegistry  # the controller's metrics (mosaic_autoscaler_*, gateway scrapes)


@contextlib.asynccontextmanager
async def standalone(
    cfg: MosaicConfig, apps_api: Any | None = None, gateway_lister: Any | None = None
) -> AsyncIterator[Standalone]:
    """Build and start (registry, gateway scraper) the standalone controller; stop everything on exit.
    `apps_api` / `gateway_lister` replace the Kubernetes clients (tests)."""
    from prometheus_client import CollectorRegistry

    from scheduler.actuators.dry_run import DryRunActuator
    from scheduler.actuators.kubernetes import KubernetesActuator
    from server.autoscaler_setup import controller_for
    from server.autoscaling import ActuatorFactory
    from server.discovery import KubernetesUnavailable, Source, StaticSource
    from server.gateway import Gateway
    from server.gateway_scrape import GatewayScraper, scrape_interval

    a = cfg.autoscaler
    factory: ActuatorFactory
    built: list[AutoscalerController] = []  # the controller, once built: its placer goes to the actuator
    if a.actuator == "kubernetes":
        deployments, domains = kubernetes_deployments(cfg), kubernetes_domains(cfg)
        if not deployments and not domains:
            fail(
                "autoscaler: no pool to scale: map pools to Deployments in autoscaler.kubernetes.deployments"
            )
        namespace = a.kubernetes.namespace or os.environ.get("POD_NAMESPACE") or "default"
        api = apps_api if apps_api is not None else _apps_api(a.kubernetes.in_cluster)
        managed = frozenset(deployments) | frozenset(domains)

        def factory(initial: Mapping[str, int]) -> Any:
            book = built[0].placement if built else None
            placer = book.placer if book is not None else None
            return KubernetesActuator(api, namespace, deployments, domains, placer)
    else:
        managed = frozenset(p.name for p in cfg.pools)

        def factory(initial: Mapping[str, int]) -> Any:
            return DryRunActuator(initial, keep=a.history)

    # `launch: vllm` pools: their vLLM processes belong to the `mosaic serve` that launched them (on its
    # machine, on ports it picked, scaled by its embedded actuator). This process only observes, so it must
    # not start a second set on GPUs the gateway already allocated: such a pool is listed empty here, and
    # its load is seen through the gateways' /metrics (`autoscaler.gateways`).
    passive: dict[str, Source] = {
        p.name: StaticSource([]) for p in cfg.pools if p.endpoints.launch is not None
    }
    try:
        gw = Gateway(observer_config(cfg), sources=passive)
    except ConfigError as exc:  # what only the built gateway checks (e.g. the KV section): one line, exit 2
        fail(str(exc))
    # The controller's own metrics only (mosaic_autoscaler_*, placement, gateway scrapes): the gateway
    # object's request and worker families, served here, read 0 in-flight and no KV reservations under the
    # same names as the real gateways' (it routes nothing), which any query not split by pod then mixed in.
    own = CollectorRegistry()
    scraper = (
        GatewayScraper(
            a.gateways,
            scrape_interval(a.gateways, a.interval_s),
            own,
            lister=gateway_lister,
            clock=gw.clock,
        )
        if a.gateways is not None
        else None
    )
    try:
        controller = controller_for(
            cfg,
            gw.registry,
            own,
            actuator_factory=factory,
            managed=managed,
            gateway=scraper.snapshots
            if scraper is not None
            else dict,  # no gateways: no gateway-side signals
            offload=a.actuator == "kubernetes",
            clock=gw.clock,
        )
    except ConfigError as exc:
        await gw.stop()
        fail(str(exc))
    built.append(controller)
    try:
        try:
            await gw.registry.start()
            if scraper is not None:
                await scraper.start()  # one round now: the controller's first observation is the baseline
        except KubernetesUnavailable as exc:
            fail(str(exc))
        yield Standalone(controller, scraper, managed, own)
    finally:
        await controller.stop()
        if scraper is not None:
            await scraper.stop()
        await gw.stop()


async def _run(
    cfg: MosaicConfig,
    cycles: int,
    as_json: bool,
    apps_api: Any | None,
    gateway_lister: Any | None = None,
    metrics: tuple[str, int] | None = None,
) -> None:
    a = cfg.autoscaler
    async with contextlib.AsyncExitStack() as stack:
        run = await stack.enter_async_context(standalone(cfg, apps_api, gateway_lister))
        if metrics is not None:
            from server.metrics_endpoint import metrics_endpoint

            try:
                port = await stack.enter_async_context(metrics_endpoint(run.registry, *metrics))
            except OSError as exc:
                fail(f"--metrics-port {metrics[1]}: cannot listen on {metrics[0]}: {exc.strerror or exc}")
            typer.echo(f"mosaic autoscale: metrics on http://{metrics[0]}:{port}/metrics", err=True)
        scraper = run.scraper
        gateways = (
            f"gateways {len(scraper.endpoints)} ({len(scraper.latest)} scraped)"
            if scraper is not None
            else "no autoscaler.gateways: gateway-side signals absent"
        )
        typer.echo(
            f"mosaic autoscale: policy {a.policy}, actuator {a.actuator}, every {a.interval_s:g} s; "
            f"pools {', '.join(sorted(run.managed)) or 'none'}; {gateways}",
            err=as_json,
        )

        def report(decision: dict[str, Any]) -> None:
            if (
                as_json
            ):  # the whole record /admin/autoscaler shows: observation (admission queue) and placement too
                typer.echo(json.dumps(decision))

        loop = asyncio.get_running_loop()
        task = loop.create_task(run.controller.run(cycles, report))
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task


def register(app: typer.Typer) -> None:
    @app.command("autoscale")
    def autoscale(
        config: str = typer.Option(
            ..., "--config", "-c", help="Gateway config YAML with an `autoscaler:` section."
        ),
        cycles: int = typer.Option(
            0, "--cycles", min=0, help="Stop after this many decisions (0: run until SIGTERM)."
        ),
        as_json: bool = typer.Option(
            False,
            "--json",
            help="Print each decision record (targets, reasons, signals, observation, actions, placement) as one JSON line.",
        ),
        log_level: str = typer.Option(
            "info", "--log-level", help="Log level (decisions and scale actions log at info)."
        ),
        metrics_port: int = typer.Option(
            0,
            "--metrics-port",
            min=0,
            max=65535,
            help="Serve the controller's /metrics on this port (0: off).",
        ),
        metrics_host: str = typer.Option(
            "0.0.0.0", "--metrics-host", help="Address of the /metrics listener."
        ),
    ) -> None:
        """Run only the P/D autoscaler controller (no API serving): scrape the pools, decide, scale Deployments."""
        level = python_log_level(check_log_level(log_level))
        try:
            cfg = load_config(config)
        except ConfigError as exc:
            fail(str(exc))
        if "autoscaler" not in cfg.model_fields_set:  # its actuator defaults to embedded: say what is missing
            fail(
                f"{config}: no autoscaler section: mosaic autoscale needs one with actuator kubernetes or dry-run "
                "(docs/autoscaling-live.md)"
            )
        if cfg.autoscaler.actuator == "embedded":
            fail(
                f"{config}: autoscaler.actuator: embedded starts simulated workers inside `mosaic serve`; "
                "mosaic autoscale needs kubernetes or dry-run"
            )
        configure_logging(level)
        metrics = (metrics_host, metrics_port) if metrics_port else None
        asyncio.run(_run(cfg, cycles, as_json, None, metrics=metrics))
