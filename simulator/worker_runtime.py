"""Runs the engine model in real (scaled) time inside an asyncio loop, and hands tokens to HTTP handlers.

Clock. Simulated time runs `time_scale` times faster than the wall clock. One asyncio task steps the
engine while it has work: step k starts when step k−1 ended (simulated), and the task sleeps until the
wall-clock instant of the step's end before delivering its tokens, so a stream's chunks leave at the
engine's step times. When the host cannot keep up (large time scales: a step's wall share is below the
Python cost of running it), the task does not sleep at all — it yields once per step so handlers can write
— and the simulated clock is re-anchored to the engine's pace rather than racing ahead. Sleeps shorter than
1 ms are skipped for the same reason (the event loop's timer granularity). The task exits when the engine
has no work and restarts on the next request.

Arrivals are stamped with the simulated clock, clamped to the end of the step in flight (a request that
arrives during a step is admitted at the next one, as in vLLM). Idle gaps longer than an hour of simulated
time count as an hour, so huge time scales do not blow simulated timestamps up.

Per-request API-server time (`engine.api_overhead_s`, tokenisation and scheduling) delays admission by its
wall share when that is at least 1 ms; the request's `arrival` stays the moment it reached the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence

from simulator.engine import Engine, StepResult
from simulator.lora import LoraRequestStates
from simulator.metrics import WorkerMetrics
from simulator.requests import EngineRequest, FinishReason, RequestRecord

IDLE_GAP_CAP_S = 3600.0
_MIN_SLEEP_S = 0.001
_LATE_REBASE_S = 0.002


class SimClock:
    """Simulated seconds = anchor_sim + (wall − anchor_wall) · time_scale, with idle gaps capped."""

    __slots__ = ("anchor_sim", "anchor_wall", "time_scale")

    def __init__(self, time_scale: float) -> None:
        if not 0 < time_scale < math.inf:  # NaN fails both; inf would freeze simulated time at its anchor
            raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
        self.time_scale = time_scale
        self.anchor_sim = 0.0
        self.anchor_wall = time.monotonic()

    def now(self) -> float:
        return self.anchor_sim + min((time.monotonic() - self.anchor_wall) * self.time_scale, IDLE_GAP_CAP_S)

    def wall_at(self, sim: float) -> float:
        return self.anchor_wall + (sim - self.anchor_sim) / self.time_scale

    def rebase(self, sim: float) -> None:
        self.anchor_sim = sim
        self.anchor_wall = time.monotonic()

    def slide(self, sim: float) -> None:
        """Move the anchor along the clock's own line to `sim` (no drift): the idle-gap cap then counts from
        the last step, not from the last rebase (after an hour of on-time steps the clock froze)."""
        self.anchor_wall = self.wall_at(sim)
        self.anchor_sim = sim


class Ticket:
    """One request's progress as its HTTP handler sees it. `event` is set on new tokens (streams) and at end."""

    __slots__ = ("arrival", "done", "event", "last_token", "produced", "record", "request", "stream")

    def __init__(
        self, request: EngineRequest, arrival: float, stream: bool, event: asyncio.Event | None = None
    ) -> None:
        self.request = request
        self.arrival = arrival
        self.stream = stream
        self.produced = 0  # tokens emitted (counted for streams only)
        self.last_token = arrival  # simulated time of the last token (for ITL after a preemption)
        self.done = False
        self.record: RequestRecord | None = None
        # shared by the sequences of one API request (a batch, n > 1): one handler waits on any of them
        self.event = event if event is not None else asyncio.Event()

    async def wait_done(self) -> RequestRecord:
        while not self.done:
            self.event.clear()
            await self.event.wait()
        assert self.record is not None
        return self.record


class EngineDriver:
    """Owns the stepping task of one engine; `submit` / `abort` requests; delivers tokens to tickets."""

    def __init__(self, engine: Engine, metrics: WorkerMetrics, time_scale: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.clock = SimClock(time_scale)
        self.on_kv_received: Callable[[str], None] | None = None
        self._tickets: dict[str, Ticket] = {}
        self._streams: dict[str, Ticket] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._busy_until: float | None = None
        self._last_end = 0.0
        self._overhead_wall = engine.api_overhead_s / time_scale
        self.arriving = 0  # sequences in their API-server overhead, not yet in the engine (data_parallel.py)

    @property
    def inflight(self) -> int:
        return len(self._tickets)

    def now(self) -> float:
        t = self.clock.now()
        return t if self._busy_until is None else min(t, self._busy_until)

    async def submit(self, req: EngineRequest, stream: bool) -> Ticket:
        """Queue `req` in the engine (after the API overhead); ValueError from the engine propagates."""
        (tk,) = await self.submit_all([req], stream)
        return tk

    async def submit_all(self, reqs: Sequence[EngineRequest], stream: bool) -> list[Ticket]:
        """Queue the sequences of one API request together (one API overhead, one arrival, one shared
        wake-up event: `Ticket.event`)."""
        arrival = self.now()
        if self._overhead_wall >= _MIN_SLEEP_S:
            self.arriving += len(reqs)
            try:
                await asyncio.sleep(self._overhead_wall)
            finally:
                self.arriving -= len(reqs)
        now = max(self.now(), arrival)
        self.engine.expire_held(now)
        event = asyncio.Event()
        tickets: list[Ticket] = []
        try:
            for req in reqs:
                self.engine.add_request(req, now, arrival=arrival)
                tk = Ticket(req, arrival, stream, event)
                tickets.append(tk)
                self._tickets[req.request_id] = tk
                if stream:
                    self._streams[req.request_id] = tk
        except ValueError:  # all of the request's sequences or none
            for tk in tickets:
                self.abort(tk)
            raise
        self._ensure_running()
        return tickets

    def kick(self) -> None:
        """KV was freed outside a step (a P/D hold released or timed out): a request waiting for blocks
        may be admitted now, so step again if there is work."""
        if self.engine.has_work():
            self._ensure_running()

    def _ensure_running(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        else:
            self._wake.set()

    def abort(self, tk: Ticket) -> None:
        """The client went away: drop the request from the engine (no success counted)."""
        if tk.done:
            return
        rid = tk.request.request_id
        self._tickets.pop(rid, None)
        self._streams.pop(rid, None)
        tk.record = self.engine.abort(rid, self.now())
        tk.done = True
        tk.event.set()
        lora = self.metrics.lora
        if lora is not None and tk.request.lora is not None:  # vLLM's abort_requests: request_finished now
            lora.finished(rid, tk.request.lora)

    def abort_all(self) -> int:
        """Abort every request in the engine (the server is stopping, as vLLM's default
        `--shutdown-timeout 0` does): each ends with finish_reason `abort`. Returns how many."""
        tickets = list(self._tickets.values())
        for tk in tickets:
            self.abort(tk)
        return len(tickets)

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------ the stepping task
    async def _run(self) -> None:
        eng, clock = self.engine, self.clock
        try:
            t = max(self._last_end, clock.now())
            clock.rebase(t)
            while eng.has_work():
                res = eng.step(t)
                if res.preempted:
                    self._on_preempted(res)
                if res.kv_received and self.on_kv_received is not None:
                    for rid in res.kv_received:
                        self.on_kv_received(rid)
                if res.idle:
                    if res.preempted:
                        continue
                    nxt = eng.next_event_time()
                    if nxt is None:  # waiting for KV that P/D holds keep: the earliest times out then
                        nxt = eng.next_hold_expiry()
                    if nxt is None:
                        break  # nothing can run until something changes; a submit or kick restarts us
                    t = await self._idle_until(nxt)
                    continue
                self._busy_until = res.end
                await self._pace(res.end)
                t = res.end
                self._deliver(res)
            self._last_end = t
        finally:
            self._busy_until = None
            if self._task is asyncio.current_task():
                self._task = None

    async def _pace(self, sim_end: float) -> None:
        delay = self.clock.wall_at(sim_end) - time.monotonic()
        if delay >= _MIN_SLEEP_S:
            await asyncio.sleep(delay)
        else:
            await asyncio.sleep(0)  # let handlers write what the previous step produced
        if delay < -_LATE_REBASE_S:
            self.clock.rebase(sim_end)  # late: the simulated clock follows the engine, not the wall
        else:
            self.clock.slide(sim_end)

    async def _idle_until(self, sim_t: float) -> float:
        """Wait (woken early by a submit) until simulated `sim_t`; returns the simulated time to step at."""
        self._busy_until = None
        delay = self.clock.wall_at(sim_t) - time.monotonic()
        self._wake.clear()
        if delay > 0:
            try:  # asyncio.timeout: 3.11's wait_for drops a stop's cancel that meets a submit's wake-up
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            except TimeoutError:
                return max(sim_t, self.clock.now())
        else:
            await asyncio.sleep(0)
            return sim_t
        return self.clock.now()

    def _on_preempted(self, res: StepResult) -> None:
        for rid in res.preempted:
            tk = self._tickets.get(rid)
            if tk is not None:
                tk.last_token = res.start  # its last token came at the end of the previous step

    def _deliver(self, res: StepResult) -> None:
        m, end = self.metrics, res.end
        if res.decoded or res.prefilled:
            # vLLM observes an iteration that has outputs: the prompt tokens its first tokens completed (each
            # prompt once, whole, at its first token) plus the tokens generated; recomputed KV is not counted
            # (a pooling request's prefill generates nothing: `num_pooled`)
            generated = len(res.decoded) + len(res.prefilled) - res.num_pooled
            m.iteration_tokens.observe(res.prompt_computed + generated)
        if res.decoded:
            # Decoding sequences run every step and steps are back to back, so each decode token's
            # inter-token latency is this step's duration: one bulk observation.
            m.itl.observe(res.duration_s, len(res.decoded))
        tickets, streams = self._tickets, self._streams
        if res.prefilled:
            firsts = set(res.first_tokens)
            for rid in res.prefilled:
                tk = tickets.get(rid)
                if tk is None:
                    continue
                if rid in firsts:
                    m.ttft.observe(end - tk.arrival)
                else:  # a recompute after preemption ends with a token: its gap includes the wait
                    m.itl.observe(end - tk.last_token)
                if tk.stream:
                    tk.produced += 1
                    tk.event.set()
        if streams and res.decoded:
            for rid in res.decoded:
                tk = streams.get(rid)
                if tk is not None:
                    tk.produced += 1
                    tk.event.set()
        if m.lora is not None:
            self._track_loras(m.lora, res)  # before the tickets of finished requests go
        for rec in res.finished:
            tk = tickets.pop(rec.request_id, None)
            streams.pop(rec.request_id, None)
            if rec.finish_reason is not FinishReason.ABORT:
                m.observe_finished(rec)
            if tk is not None:
                tk.record = rec
                tk.done = True
                tk.event.set()

    def _track_loras(self, lora: LoraRequestStates, res: StepResult) -> None:
        """The step's outputs as vLLM's output processor reads them, in its order (the running requests'
        outputs first, decodes finishing among them; then the prefills, in schedule order, each started
        at its first token and finished at its last), then the step's `vllm:lora_requests_info`."""
        tickets = self._tickets
        ended = {rec.request_id for rec in res.finished}
        prefilled = set(res.prefilled)
        for rid in ended - prefilled:  # decodes: their adapters were tracked since their first token
            tk = tickets.get(rid)
            if tk is not None and tk.request.lora is not None:
                lora.finished(rid, tk.request.lora)
        firsts = set(res.first_tokens)
        for rid in res.prefilled:
            tk = tickets.get(rid)
            if tk is None or tk.request.lora is None:
                continue
            if rid in firsts:
                lora.started(rid, tk.request.lora)
            if rid in ended:
                lora.finished(rid, tk.request.lora)
        lora.record()
