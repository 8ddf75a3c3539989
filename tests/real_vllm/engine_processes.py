"""The processes of a real vLLM server that run its engines, found by the titles vLLM gives them
(`VLLM::EngineCore`, `VLLM::EngineCore_DP<rank>` for a data-parallel server, and the executor's
`VLLM::Worker` below each), so a test can stop an engine with SIGSTOP while the API server runs on: a hung
engine as the gateway sees it. Linux only (/proc), as these tests are."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import httpx

from server.scrape import parse_vllm_metrics

PROC = Path("/proc")
SETTLE_S = 0.3  # the API server handles the outputs the engine sent before it stopped
# how long the engine runs between two looks (each stops it): a 480-token answer of the tiny model takes the
# engine over a second even on a fast machine, so a look falls inside it
RUNNING_S = 0.2
NICEST = 19  # the lowest CPU priority a process can have
# requests a test sends before it gives up stopping the engine with one running (`stop_once_running`): one
# in ~30 ended first on a loaded 2-core machine, the engine niced
TRIES = 5


def _parents() -> dict[int, int]:
    parents = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def _below(root: int, parents: dict[int, int]) -> set[int]:
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _title(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def engine_processes(root: int, engine: str = "VLLM::EngineCore") -> list[int]:
    """The pids below `root` of the engine process titled `engine` and of every process below it (its
    executor's workers), in pid order; [] when there is none."""
    return _engines_below(root, lambda title: title == engine)


def _engines_below(root: int, is_engine: Callable[[str], bool]) -> list[int]:
    """The pids below `root` of the processes whose title `is_engine`, and of every process below them."""
    parents = _parents()
    cores = [pid for pid in _below(root, parents) if is_engine(_title(pid))]
    return sorted({pid for core in cores for pid in (core, *_below(core, parents))})


def stop_once_running(
    pids: list[int], url: str, client: threading.Thread, engine: str = "0", timeout_s: float = 60.0
) -> bool:
    """Stop an engine's processes while it generates a request the caller has just sent: `RUNNING_S` after it,
    and again every `RUNNING_S` while `client` (the caller's thread reading the answer) runs, stop the engine
    and ask the server whether that engine has a request running (`stop_while_running`). True once it has,
    the engine left stopped; False when the answer ended first (the caller tries again with a new request).
    Neither the client's first tokens nor the server's access log say when the request runs: on 2 cores
    vLLM's engine starves its own API server, which may send the stream's head and write the log line only
    once generation has ended. Stopped, the engine leaves the API server the CPU to publish its last step.
    On a server whose engine was not niced (`yield_cpu_to_api_server`) a look often comes after the whole
    answer: 36 of 60 requests caught running on the DP server here, against 58 of 60 niced."""
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(RUNNING_S)
        if not client.is_alive():
            return False
        if stop_while_running(pids, url, engine):
            return True
        assert time.monotonic() < deadline, f"engine {engine} ran no request within {timeout_s} s"


def yield_cpu_to_api_server(root: int) -> None:
    """Every thread of the engine processes below `root` (`VLLM::EngineCore*` and their executors' workers)
    at the lowest CPU priority, nice 19, for the server's life. On 2 cores vLLM's busy engine otherwise
    starves its own API server, which then answers `/metrics` and sends a stream's tokens late, at worst only
    once generation has ended, and the timing of every test that watches a request run goes with it.
    The engine's processes share an autogroup with the API server, so this hands the API server the CPU it
    needs first, as a production host with cores to spare does; the engine still gets every cycle left.
    Threads started later inherit the nice value of the thread that starts them."""
    for pid in _engines_below(root, lambda title: title.startswith("VLLM::EngineCore")):
        with suppress(FileNotFoundError):  # a process that ended meanwhile
            for task in (PROC / str(pid) / "task").iterdir():
                # a thread that ended meanwhile; a sandbox that refuses it (the engine then keeps its priority,
                # and the tests that watch a request run retry more often)
                with suppress(ProcessLookupError, PermissionError):
                    os.setpriority(os.PRIO_PROCESS, int(task.name), NICEST)


def stop_while_running(pids: list[int], url: str, engine: str = "0") -> bool:
    """Stop (SIGSTOP) an engine's processes, then ask the server whether that engine still has a request
    running. True: the engine is stopped with its request running (a hung engine, as the tests mean it). False:
    it had not taken the request yet or had already generated the whole answer; the processes are
    resumed."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(SETTLE_S)
        marks = parse_vllm_metrics(httpx.get(f"{url}/metrics", timeout=10).text).engine_marks
    except BaseException:
        resume(pids)
        raise
    if any(mark.engine == engine and mark.num_running for mark in marks):
        return True
    resume(pids)
    return False


def stop_while_idle(pids: list[int], url: str, timeout_s: float = 60.0) -> None:
    """Stop (SIGSTOP) the engine's processes once the server shows it idle: every engine with nothing
    running or waiting (a request aborted just before may still be leaving it). Nothing else sends requests
    to the server meanwhile, so once stopped it stays as it was: an engine that will hang in its next step."""
    deadline = time.monotonic() + timeout_s
    while True:
        marks = parse_vllm_metrics(httpx.get(f"{url}/metrics", timeout=10).text).engine_marks
        if marks and not any(m.num_running or m.num_waiting for m in marks):
            break
        assert time.monotonic() < deadline, f"the engine was not idle within {timeout_s} s: {marks}"
        time.sleep(0.2)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def resume(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
