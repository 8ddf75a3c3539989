"""Which engine of a data-parallel simulated worker runs a request, as vLLM 0.32's API server decides it.

`vllm serve --data-parallel-size N` runs N engines (each its own scheduler and KV cache) behind one API
server. A request names its engine with the `X-data-parallel-rank` header (`requested_rank`: vLLM's
`_get_data_parallel_rank`, where a value `int()` cannot read counts as no header); a rank outside [0, N) is
refused by the engine's input processor (`protocol.check_data_parallel_rank`). Without the header the
API server's load balancer picks (`DpBalancer`, vLLM's `DPLBAsyncMPClient.get_core_engine_for_request`):

    score(engine) = max(in_flight, waiting + running) + waiting · 6 · max(0, kv_usage − 0.5)

the lowest score wins, scanning from a start index that moves on by one after every balanced pick (so
ties rotate). vLLM's `in_flight` is the API server's own count of its unfinished requests on that engine;
`waiting`, `running` and `kv_usage` come from the DP coordinator's snapshot, refreshed every ~100 ms and
bumped locally (`waiting + 1`) for each pick between snapshots. The simulator reads its engines' live
counts instead: there is no coordinator whose lag it could model, and a live count is what the snapshot
plus the local bump approximate. Its `in_flight` counts the sequences a driver holds plus those still
in their API-server overhead (`EngineDriver.arriving`); vLLM picks after tokenisation, the simulator when
the request arrives (the overhead is the same for every engine, so only the order of near-simultaneous
arrivals could differ).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

RANK_HEADER = "x-data-parallel-rank"


def requested_rank(value: str | None) -> int | None:
    """The rank a request's `X-data-parallel-rank` header names, None when absent or not an integer (vLLM
    then balances; it does not refuse such a header)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What vLLM's balancer knows of one engine."""

    waiting: int
    running: int
    kv_usage: float  # 0–1
    in_flight: int  # this API server's unfinished requests on the engine


class DpBalancer:
    """vLLM's choice of engine for a request without a rank (module docstring), for one API server."""

    __slots__ = ("_start",)

    def __init__(self) -> None:
        # vLLM: eng_start_index = engines · client_index // client_count, 0 for the only API server
        self._start = 0

    def pick(self, loads: Sequence[EngineLoad]) -> int:
        """The rank to run on; moves the scan start on by one."""
        n = len(loads)
        best, best_score = 0, math.inf
        for i in range(n):
            rank = (self._start + i) % n
            load = loads[rank]
            score: float = max(load.in_flight, load.waiting + load.running)  # one API server: client_count 1
            if load.waiting:
                # a queue on an engine whose cache is over half full drains slowly: up to 3× its length at 100 %
                score += load.waiting * 6.0 * max(0.0, load.kv_usage - 0.5)
            if score < best_score:  # strict: the first of equal scores in scan order wins
                best, best_score = rank, score
        self._start = (self._start + 1) % n
        return best
