"""The commands that hold many sockets (serve, worker, replay, profile --url) raise the soft open-files limit:
at a desktop's 1,024 an open-loop replay past ~1,000 requests in flight failed with EMFILE, reported as an
unreachable server. Run in a child process, whose limits the test may lower without touching pytest's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

resource = pytest.importorskip("resource")


def _in_child(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout.strip()


def test_soft_limit_is_raised_within_the_hard_limit() -> None:
    got = _in_child(
        """
        import resource
        from server.commands.common import raise_open_files_limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))
        print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """
    )
    assert got == "4096 4096"  # as far as the hard limit allows, not to 65,536


def test_a_high_soft_limit_is_left_alone() -> None:
    got = _in_child(
        """
        import resource
        from server.commands.common import raise_open_files_limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (3000, 4096))
        print(raise_open_files_limit(2048), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """
    )
    assert got == "3000 3000"  # never lowered


def test_replay_runs_with_the_raised_limit() -> None:
    """The replay command itself raises it before sending (checked where the requests are sent)."""
    got = _in_child(
        """
        import resource
        import loadgen.replay as replay
        from typer.testing import CliRunner
        from server.cli import build_app

        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))
        seen = []

        def fake_run_replay(req, console, summary=False):
            seen.append(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            raise replay.ReplayError("stop here")

        import server.commands.replay as cmd
        cmd.run_replay = fake_run_replay
        result = CliRunner().invoke(build_app(), ["replay", "synthetic:rate=1,n=1", "--url", "http://127.0.0.1:9"])
        print(result.exit_code, seen)
        """
    )
    assert got == "2 [4096]"
