"""Helpers every sub-command shares: the exit-2 contract for bad input."""

from __future__ import annotations

from typing import NoReturn

import typer

EXIT_BAD_INPUT = 2


def fail(message: str) -> NoReturn:
    """Print one readable line to stderr and exit 2 (the CLI's bad-input contract)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)
