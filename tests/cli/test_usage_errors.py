"""Every command's usage errors (missing value, bad type, unknown option or command) are one line and exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from server.cli import main; main()", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["worker", "--gpu"], "Option '--gpu' requires an argument", id="option without its value"
        ),
        pytest.param(
            ["worker", "--gpu", "H100", "--model", "llama-3-8b", "--port", "abc"],
            "Invalid value for '--port'",
            id="a word where a port number goes",
        ),
        pytest.param(["nosuch"], "No such command 'nosuch'", id="unknown command"),
        pytest.param(["replay"], "Missing argument 'trace'", id="missing positional argument"),
        pytest.param(
            ["simulate", "--trace", "x", "--fleet", "y", "--max-requests", "0"],
            "--max-requests",
            id="value below the option's minimum",
        ),
    ],
)
def test_usage_error_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in proc.stderr


def test_help_exits_0_and_lists_every_command() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("serve", "worker", "replay", "profile", "plan", "simulate", "kv-layout", "autoscale"):
        assert command in proc.stdout


def test_no_arguments_prints_the_help_once() -> None:
    """`mosaic` alone shows the help as `mosaic --help` does, once: rich's help prints itself while the
    no-args error is built, so echoing `ctx.get_help()` again printed the whole screen twice."""
    proc = run_cli()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Usage: mosaic") == 1, proc.stdout
    assert proc.stdout.strip() == run_cli("--help").stdout.strip()


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"mosaic {version('mosaic-serve')}"
