"""`mosaic serve`: the OpenAI-compatible gateway.

    mosaic serve                                  # embedded default: simulated llama-3-8b on H100/A100/L4
    mosaic serve --config mosaic.yaml --port 8000

With no `--config` it starts the embedded heterogeneous simulated fleet (`server.embedded`), prints the
URL and a ready-to-paste `curl` line, and serves until SIGINT/SIGTERM, which drains in-flight requests
(up to `limits.shutdown_grace_s`) before exiting. A bad config file, an unusable address, or a startup that
fails (e.g. a `launch: vllm` pool whose replicas find too few GPUs; what did start is stopped) exits 2 with
one line.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import Callable

import typer

from server.commands.common import (
    check_log_level,
    check_number,
    configure_logging,
    fail,
    python_log_level,
    raise_open_files_limit,
)
from server.config import ConfigError, MosaicConfig, load_config
from server.discovery import KubernetesUnavailable


def curl_line(url: str, model: str, needs_key: bool) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    auth = ' -H "Authorization: Bearer $MOSAIC_API_KEY"' if needs_key else ""
    line = f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
    if needs_key:  # the client's one key, not the gateway's list (MOSAIC_API_KEYS): an easy pair to mix up
        line += "\n# MOSAIC_API_KEY: one of the gateway's keys (mosaic replay and profile read it too)"
    return line


async def _check_kubernetes_config(config: MosaicConfig) -> None:
    """Pools discovered from Kubernetes need a cluster config: without one, exit 2 with one line now (the
    gateway's startup would otherwise fail inside uvicorn's lifespan, with a traceback and exit 3). Bounded:
    loading a kubeconfig may run an exec credential plugin."""
    from server.discovery import load_kubernetes_config

    for in_cluster in {p.endpoints.kubernetes.in_cluster for p in config.pools if p.endpoints.kubernetes}:
        try:
            await asyncio.wait_for(asyncio.to_thread(load_kubernetes_config, in_cluster), 30)
        except KubernetesUnavailable as exc:
            fail(str(exc))
        except TimeoutError:
            fail("loading the Kubernetes config (for kubernetes endpoints) took over 30 s")


async def _serve(
    config: MosaicConfig, host: str, port: int, log_level: str, embedded: bool, config_name: str | None = None
) -> None:
    """`config_name`: the config file as the user named it, the prefix of a config error found only once the
    gateway is built (a KV profile that does not exist), as `load_config`'s own errors have it."""
    from server.runner import bind_socket, start_gateway_server  # imports uvicorn/fastapi only when serving

    await _check_kubernetes_config(config)
    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    startup_errors: list[Exception] = []  # the gateway's start failed: filled before the server is up
    try:
        running = await start_gateway_server(
            config,
            host,
            port,
            install_signals=True,
            log_level=log_level,
            sock=sock,
            on_startup_error=startup_errors.append,
        )
    except (KubernetesUnavailable, ConfigError) as exc:  # ConfigError: what only the built gateway can check
        sock.close()  # never served: the listening socket would be left to the collector
        prefix = f"{config_name}: " if isinstance(exc, ConfigError) and config_name is not None else ""
        fail(f"{prefix}{exc}")
    if startup_errors:
        # e.g. a launched vLLM pool: too few GPUs, vLLM not installed. What had started is stopped already
        # (server.app's lifespan); the app came up draining, so stop it and exit 2 with one line.
        await running.stop()
        error = startup_errors[0]
        # the traceback, for --log-level debug; the line below is what everyone else needs
        logging.getLogger("mosaic.gateway").debug("gateway startup failed", exc_info=error)
        fail(f"gateway startup failed: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
    # Everything built so far (catalog, config, app, pydantic schemas: ~10⁵ objects) lives as long as the
    # process: move it out of the collector's generations, so a full collection does not scan it (one took
    # ~50 ms, stalling every request in flight, at 32 concurrent requests in bench/gateway_overhead.py).
    gc.collect()  # as vLLM does (vllm.utils.gc_utils.freeze_gc_heap): startup garbage is not frozen
    gc.freeze()
    # A proxied request allocates a few hundred short-lived container objects; at the default gen-0
    # threshold (700) the collector ran every couple of requests (≈ 2% of the gateway's instructions per
    # request, callgrind). 7,000 young objects cost nothing to hold and a tenth of the collections.
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(7000, gen1, gen2)
    gw = running.gateway
    workers: dict[str, int] = {}
    for rec in gw.registry.records():
        workers[rec.pool.name] = workers.get(rec.pool.name, 0) + 1
    # each pool with its own count: a pool at 0 workers (scaled to zero, not started yet) reads as such
    pools = ", ".join(
        f"{p.name} ({p.gpu}, {p.role.value}, {_count(workers.get(p.name, 0), 'worker')})"
        for p in gw.registry.pools()
    )
    n = sum(workers.values())
    what = "embedded simulated fleet" if embedded else _count(n, "worker")
    typer.echo(f"mosaic gateway serving {', '.join(gw.models)} at {running.url} — {what}: {pools}")
    typer.echo(curl_line(running.url, gw.models[0], not gw.keys.open))
    await running.wait()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve(
        config: str | None = typer.Option(
            None, "--config", "-c", help="Gateway config YAML (default: embedded simulated fleet)."
        ),
        host: str | None = typer.Option(
            None, "--host", help="Address to bind (default: config's gateway.host, 127.0.0.1)."
        ),
        port: int | None = typer.Option(
            None, "--port", help="Port to bind (default: config's gateway.port, 8000; 0 = free port)."
        ),
        time_scale: float | None = typer.Option(
            None,
            "--time-scale",
            help="Embedded default only: simulate this many times faster than real time.",
        ),
        log_level: str = typer.Option("warning", "--log-level", help="uvicorn/gateway log level."),
    ) -> None:
        """OpenAI-compatible gateway over a heterogeneous fleet (simulated by default, or real vLLM servers)."""
        if port is not None and not 0 <= port <= 65535:
            fail(f"--port must be in 0..65535, got {port}")
        log_level = check_log_level(log_level)
        try:
            if config is not None:
                if time_scale is not None:
                    fail(
                        "--time-scale applies to the embedded default only; set endpoints.simulated.time_scale in the config"
                    )
                cfg = load_config(config)
            else:
                from server.embedded import default_config

                check_number("--time-scale", time_scale, 1e-3, inclusive=True)  # at most 1000× slower
                cfg = default_config(time_scale=time_scale or 1.0)
        except ConfigError as exc:
            fail(str(exc))
        configure_logging(python_log_level(log_level))
        raise_open_files_limit()
        # uvloop when installed (uvicorn[standard]); uvicorn picks httptools by itself the same way.
        with asyncio.Runner(loop_factory=_uvloop_factory()) as runner:
            runner.run(
                _serve(
                    cfg,
                    host or cfg.gateway.host,
                    cfg.gateway.port if port is None else port,
                    log_level,
                    config is None,
                    None if config is None else str(config),
                )
            )


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]
