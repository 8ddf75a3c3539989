"""The `mosaic` command line: one Typer app; each sub-command lives in `server/commands/<name>.py`.

The CLI is a contract (DESIGN.md): commands are only ever added. Every command exits 0 on success and 2 with
one readable line on bad input (see `server.commands.common.fail`), never a traceback.
"""

from __future__ import annotations

import importlib
import sys

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


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"mosaic {_version()}")
        raise typer.Exit()


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), as `pip show mosaic-serve` gives it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mosaic-serve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print Mosaic's version and exit."
    ),
) -> None:
    """Mosaic: serve LLMs on heterogeneous GPU fleets (gateway, simulated workers, planner, load generator)."""


def build_app() -> typer.Typer:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


def main() -> None:
    """Run the CLI. Usage errors (unknown option, missing value, bad type) are one line on stderr and exit 2,
    like every other bad input; the boxed usage panel is kept for `--help` only.

    Click's exceptions are recognised by shape, not class: Typer ≥ 0.26 vendors its own copy of click.
    """
    command = typer.main.get_command(build_app())
    try:
        result = command.main(prog_name="mosaic", standalone_mode=False)
    except Exception as exc:
        kind = type(exc).__name__
        ctx = getattr(exc, "ctx", None)
        if kind == "NoArgsIsHelpError":  # `mosaic` alone: show the help
            # Building the error rendered the help already: rich's formatter prints it and returns "" (the
            # message), the plain one returns the text. Print only what was not printed.
            message = str(exc.format_message()) if hasattr(exc, "format_message") else ""
            if message.strip():
                typer.echo(message)
            sys.exit(0)
        if kind == "Abort":
            typer.echo("aborted", err=True)
            sys.exit(130)
        if not hasattr(exc, "format_message") or not hasattr(exc, "exit_code"):
            raise
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        message = " ".join(str(exc.format_message()).split())  # one line, whatever click wrapped
        typer.echo(f"error: {message}{where}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":  # `python -m server.cli`, as the `mosaic` script
    main()
