"""The `mosaic` command line: one Typer app; each sub-command lives in `server/commands/<name>.py`.

The CLI is a contract (DESIGN.md): commands are only ever added. Every command exits 0 on success and 2 with
one readable line on bad input (see `server.commands.common.fail`), never a traceback.
"""

from __future__ import annotations

import importlib

import typer

# Sub-command modules, in the order `mosaic --help` lists them. Each exposes `register(app)`.
COMMAND_MODULES: tuple[str, ...] = (
    "server.commands.worker",
    "server.commands.plan",
    "server.commands.serve",
    "server.commands.simulate",
    "server.commands.replay",
    "server.commands.profile",
    "server.commands.kv_layout",
    "server.commands.autoscale",
)

app = typer.Typer(
    name="mosaic",
    help="Mosaic: serve LLMs on heterogeneous GPU fleets (gateway, simulated workers, planner, load generator).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def build_app() -> typer.Typer:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


def main() -> None:
    build_app()()
