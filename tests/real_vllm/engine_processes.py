"""The processes of a real vLLM server that run its engines, found by the titles vLLM gives them
(`VLLM::EngineCore`, `VLLM::EngineCore_DP<rank>` for a data-parallel server, and the executor's
`VLLM::Worker` below each), so a test can stop an engine with SIGSTOP while the API server runs on: a hung
engine as the gateway sees it. Linux only (/proc), as these tests are."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from server.scrape import parse_vllm_metrics

PROC = Path("/proc")
SETTLE_S = 0.3  # the API server handles the outputs the engine sent before it stopped
# vLLM logs a completion's POST as it starts the stream and adds the request to its engine right after; this
# long after, the request runs (a 480-token answer of the tiny model takes the engine over a second on 2 cores)
RUNNING_S = 0.2
POSTED = '"POST /v1/completions HTTP/1.1" 200'


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
    parents = _parents()
    cores = [pid for pid in _below(root, parents) if _title(pid) == engine]
    return sorted({pid for core in cores for pid in (core, *_below(core, parents))})


def completions_posted(log_path: Path) -> int:
    """How many completion requests the server has begun to answer (its access log's 200 lines)."""
    return log_path.read_text(errors="replace").count(POSTED) if log_path.exists() else 0


def stop_once_running(
    pids: list[int], url: str, log_path: Path, posted_before: int, engine: str = "0", timeout_s: float = 60.0
) -> bool:
    """Stop an engine's processes while it generates the next completion sent to the server: once its log shows
    one more completion POST than `posted_before`, and `RUNNING_S` later (`stop_while_running` says whether
    it was stopped with the request running). Not on the client's first tokens: on 2 cores vLLM's engine
    starves its own API server, which may send a whole stream in one burst once generation has ended."""
    deadline = time.monotonic() + timeout_s
    while completions_posted(log_path) <= posted_before:
        assert time.monotonic() < deadline, f"no completion POST in {log_path} within {timeout_s} s"
        time.sleep(0.02)
    time.sleep(RUNNING_S)
    return stop_while_running(pids, url, engine)


def stop_while_running(pids: list[int], url: str, engine: str = "0") -> bool:
    """Stop (SIGSTOP) an engine's processes, then ask the server whether that engine still has a request
    running. True: the engine is stopped with its request running (a hung engine, as the tests mean it). False:
    it had not taken the request yet or had already generated the whole answer; the processes are resumed and
    the caller tries again with a new request."""
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
