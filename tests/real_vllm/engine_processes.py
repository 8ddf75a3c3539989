"""The processes of a real vLLM server that run its engines, found by the titles vLLM gives them
(`VLLM::EngineCore`, `VLLM::EngineCore_DP<rank>` for a data-parallel server, and the executor's
`VLLM::Worker` below each), so a test can stop an engine with SIGSTOP while the API server runs on: a hung
engine as the gateway sees it. Linux only (/proc), as these tests are."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


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
