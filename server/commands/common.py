"""Helpers every sub-command shares: the exit-2 contract for bad input, the open-files limit."""

from __future__ import annotations

import logging
import math
import os
import resource
import tempfile
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

EXIT_BAD_INPUT = 2
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's names


OPEN_FILES_WANTED = 65536  # sockets: a gateway holds two per streamed request, a replay one per request


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files towards `wanted`, within the hard limit (vLLM's server
    does the same). Many desktops start processes at 1,024: an open-loop replay or a gateway past ~1,000
    concurrent requests then fails with EMFILE, which reads as an unreachable server. Returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. a sandbox that forbids it: keep what we have
            logging.getLogger("mosaic").debug("cannot raise the open-files limit to %d: %s", target, exc)
    return soft


def configure_logging(level: str) -> None:
    """The long-running commands' log format at `level` (`python_log_level`'s name); httpx's one line per
    request (every health check and scrape of every worker: ~150 lines in 4 minutes for one worker) only at
    DEBUG."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


TABLE_WIDTH = 132  # the widest table a command prints (replay's latency table: 8 columns) fits


def table_console(stderr: bool = False) -> Console:
    """A console for the commands' tables: a terminal's own width, and at least TABLE_WIDTH when the output
    is a pipe or a file (rich falls back to 80 columns there and cut numbers to `4,151.…`)."""
    console = Console(stderr=stderr)
    if not console.is_terminal and console.width < TABLE_WIDTH:
        console = Console(stderr=stderr, width=TABLE_WIDTH)
    return console


def fail(message: str) -> NoReturn:
    """Print one readable line to stderr and exit 2 (the CLI's bad-input contract)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def check_output_file(path: Path, option: str) -> None:
    """Fail now, not after the run, when `path` cannot take an output file: it is a directory, or the
    nearest existing folder on its way is a file or not writable. Those checks name the common causes; as
    root they pass what only a write refuses (/proc), so the file is then really opened: appended to when it
    exists, created and removed again when it does not (its folders are created here)."""
    if path.is_dir():
        fail(f"{option} {path}: is a directory")
    _check_creatable(path.parent, option, path)
    existed = path.exists() or path.is_symlink()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        fail(f"{option} {path}: cannot write it ({exc.strerror or exc})")


def check_output_dir(path: Path, option: str) -> None:
    """As `check_output_file`, for a folder outputs are written into: created now (with its parents), and a
    probe file written into it and removed, so that what only a real write refuses (/proc as root, a full
    disk) fails before the run, not after it with the report already written."""
    if path.exists() and not path.is_dir():
        fail(f"{option} {path}: exists and is not a directory")
    _check_creatable(path, option, path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".mosaic-probe-"):
            pass
    except OSError as exc:
        fail(f"{option} {path}: cannot write into it ({exc.strerror or exc})")


def check_report_paths(out: Path | None, plot: Path | None) -> None:
    """`--out` (a report file) and `--plot` (a folder of plots), when given, can be written: checked before
    a run so that a long replay or simulation is not lost to a bad path at its end."""
    if out is not None:
        check_output_file(out, "--out")
    if plot is not None:
        check_output_dir(plot, "--plot")


def _check_creatable(directory: Path, option: str, shown: Path) -> None:
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        fail(f"{option} {shown}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(f"{option} {shown}: {existing} is not writable")


def check_log_level(value: str) -> str:
    """`--log-level`, lower-cased, if uvicorn knows it; else exit 2 (uvicorn would raise KeyError)."""
    level = value.lower()
    if level not in LOG_LEVELS:
        fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return level


def python_log_level(level: str) -> str:
    """The `logging` level for a checked `--log-level` (uvicorn's `trace` is below DEBUG)."""
    return "DEBUG" if level == "trace" else level.upper()


def number_error(name: str, value: float, minimum: float = 0.0, *, inclusive: bool = False) -> str | None:
    """The error line when `value` is not a finite number > `minimum` (≥ with `inclusive`); None when it is.

    NaN fails every comparison, so the test is written as `not value > minimum`, never `value <= minimum`.
    """
    in_range = value >= minimum if inclusive else value > minimum
    if in_range and math.isfinite(value):
        return None
    return f"{name} must be a finite number {'≥' if inclusive else '>'} {minimum:g}, got {value:g}"


def check_number(name: str, value: float | None, minimum: float = 0.0, *, inclusive: bool = False) -> None:
    """Exit 2 with one line unless `value` (an option; None = not given) is finite and > (≥) `minimum`."""
    if value is not None and (message := number_error(name, value, minimum, inclusive=inclusive)):
        fail(message)
