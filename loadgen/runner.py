"""The replay loop: send each scheduled request at its time, stream the answers, keep the records.

One asyncio task per request. While the loop waits for the next send time it builds the bodies of the
requests due within the next `PREBUILD_WINDOW_S` (at most `PREBUILD_BYTES` of them), so a burst's prompts
(real traces send dozens in the same millisecond after seconds of quiet) and a 100k-token prompt are ready
when their time comes; each task is started before the loop goes on, so a send never waits for the next
body. Whatever delay remains (event-loop load, a slow body) is measured as send lag, never hidden. With `concurrency` set, a request
whose time has come waits for a free slot (the wait is reported apart from send lag, like vLLM's
`--max-concurrency`); the loop itself waits, so the requests behind it stay in the prebuilt window rather
than each in a task of its own with its body (a throughput run sends a whole trace at once). The trace is
consumed lazily: memory holds the records and the in-flight requests, never the trace (beyond the
prebuilt window). Connections are kept alive and reused (responses are read to their end so that they
can be), over `CLIENT_SHARDS` httpx clients so that no connection pool grows large.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

import httpx

from loadgen.client import ENDPOINT_PATHS, WHOLE_ENDPOINTS, RequestRecord, send_request
from loadgen.lora import ModelChooser
from loadgen.metrics import replay_duration
from loadgen.prompts import RERANK_DOCUMENTS, PromptBuilder, build_body
from loadgen.schedule import ScheduledRequest

PREBUILD_WINDOW_S = 2.0  # bodies of requests due this far past the next one are built while waiting
PREBUILD_BYTES = 64 << 20  # … up to this much of them in memory
_PREBUILD_MARGIN_S = 0.002  # stop building this close to the next send time
# Failures that say nothing about load: nothing listens, or the key, the path or the model name is wrong
# (the server refuses us whatever we send).
FATAL_ERRORS = frozenset({"connect_error", "http_401", "http_403", "http_404", "http_405"})
# The first this many requests to finish all failed so: the replay stops there instead of playing the rest
# of the schedule (hours, for a real trace) to the same end.
GIVE_UP_AFTER = 8


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str
    endpoint: str = "completions"  # completions | chat | embeddings | rerank
    api_key: str | None = None
    # each request names one of these LoRA adapters instead of `model` (`loadgen.lora`); () = none
    lora_modules: tuple[str, ...] = ()
    lora_assignment: str = "random"  # random | round-robin (vLLM's --lora-assignment)
    rerank_documents: int = RERANK_DOCUMENTS  # documents per request of the rerank endpoint

    @property
    def request_url(self) -> str:
        return self.url.rstrip("/") + ENDPOINT_PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        accept = "application/json" if self.endpoint in WHOLE_ENDPOINTS else "text/event-stream"
        h = {"Content-Type": "application/json", "Accept": accept}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass(frozen=True, slots=True)
class RunOptions:
    concurrency: int | None = None  # max requests in flight; None = unbounded (trace timing rules)
    timeout_s: float | None = 600.0  # per request, from send to the last byte
    seed: int = 0  # prompt token ids
    # > 0: other prompts for the same seed (`PromptBuilder`: a later probe, not a cache hit)
    prompt_salt: int = 0


class Observer(Protocol):
    """Progress callbacks; called on the event loop, must be quick."""

    def sent(self, rec: RequestRecord) -> None: ...

    def done(self, rec: RequestRecord) -> None: ...


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord] = field(default_factory=list)
    started_at: str = ""  # wall-clock ISO time of t = 0
    duration_s: float = 0.0  # the replay's start → end of the last request (`replay_duration`)
    interrupted: bool = False  # `stop` was set: nothing more sent, requests in flight cancelled
    # stopped early: the first GIVE_UP_AFTER requests to finish all failed with FATAL_ERRORS
    gave_up: bool = False


async def _one(
    rec: RequestRecord,
    body: bytes,
    client: httpx.AsyncClient,
    target: Target,
    opts: RunOptions,
    origin: float,
    slots: _Slots | None,
    observer: Observer | None,
    watch: _ReachWatch,
) -> None:
    """Send one request; with `slots`, the slot the loop acquired for it is released when it ends."""
    try:
        await _send(rec, body, client, target, opts, origin, observer)
        watch.done(rec)
    finally:
        if slots is not None:
            slots.release()


async def _send(
    rec: RequestRecord,
    body: bytes,
    client: httpx.AsyncClient,
    target: Target,
    opts: RunOptions,
    origin: float,
    observer: Observer | None,
) -> None:
    if observer is not None:
        observer.sent(rec)
    await send_request(
        client,
        target.request_url,
        body,
        target.headers(),
        rec,
        origin,
        opts.timeout_s,
        whole=target.endpoint in WHOLE_ENDPOINTS,
    )
    if observer is not None:
        observer.done(rec)


class _ReachWatch:
    """Sets `halt` when the first `n` requests to finish all failed in a way no load explains
    (`FATAL_ERRORS`). Any other outcome among them (a success, a 5xx, a 429, a 400, a timeout) disarms it for
    good: a server that served or refused for a reason of load or of the request is there to be measured."""

    __slots__ = ("_failed", "_halt", "_n", "armed", "tripped")

    def __init__(self, n: int, halt: asyncio.Event) -> None:
        self._n, self._halt = n, halt
        self._failed = 0
        self.armed = n > 0
        self.tripped = False

    def done(self, rec: RequestRecord) -> None:
        if not self.armed:
            return
        if rec.error_type not in FATAL_ERRORS:
            self.armed = False
            return
        self._failed += 1
        if self._failed >= self._n:
            self.armed, self.tripped = False, True
            self._halt.set()


class _Slots:
    """The concurrency limit, and when each slot came free. Slots are alike and come free in time order, so
    the k-th request under a limit of n could go no sooner than the (k − n)-th release: that is when its slot
    was free (`RequestRecord.slot_s`), whether or not the loop was still blocked then. (Asking only whether
    the loop blocked booked the wait of every request behind the first one a burst of releases let through
    as the generator's own send lag.)"""

    __slots__ = ("_freed", "_taken", "n", "sem")

    def __init__(self, n: int) -> None:
        self.n, self.sem = n, asyncio.Semaphore(n)
        self._freed: deque[float] = deque()  # release times not yet matched to a later acquisition
        self._taken = 0

    def release(self) -> None:
        self._freed.append(time.perf_counter())
        self.sem.release()

    def took(self) -> float | None:
        """Record an acquisition: when its slot came free (perf_counter), None for one of the first n."""
        self._taken += 1
        return self._freed.popleft() if self._taken > self.n else None


CLIENT_SHARDS = 8  # measured: 300 req/s of small requests, 1 pool 2.6–5.0 ms CPU/request, 8 pools 1.45 ms


def make_client(opts: RunOptions, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """An httpx client whose pool never queues a request the replay meant to send now (no connection cap
    beyond `concurrency`, which the replay's semaphore enforces anyway)."""
    limits = httpx.Limits(max_connections=opts.concurrency, max_keepalive_connections=1000 // CLIENT_SHARDS)
    return httpx.AsyncClient(transport=transport, limits=limits, timeout=httpx.Timeout(opts.timeout_s))


async def replay(
    requests: Iterable[ScheduledRequest],
    target: Target,
    opts: RunOptions = RunOptions(),
    observer: Observer | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    stop: asyncio.Event | None = None,
) -> RunResult:
    """Send every scheduled request at `send_at_s` after the start; return when all have finished, or soon
    after `stop` is set (Ctrl-C): then nothing more is sent, the requests in flight are cancelled and
    recorded as `cancelled`, and the result says `interrupted`. The same early end, with `gave_up`, when
    the first `GIVE_UP_AFTER` requests to finish all failed with `FATAL_ERRORS`."""
    if target.endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINT_PATHS)}, got {target.endpoint!r}")
    prompts = PromptBuilder(opts.seed, opts.prompt_salt)
    slots = _Slots(opts.concurrency) if opts.concurrency else None
    result = RunResult(started_at=datetime.now(UTC).isoformat())
    tasks: set[asyncio.Task[None]] = set()
    models = ModelChooser(target.model, target.lora_modules, target.lora_assignment, opts.seed)
    ahead = _Prebuilt(iter(requests), target, prompts, models)
    halt = asyncio.Event()  # set by `stop` (Ctrl-C) or by the watch: send nothing more, cancel the rest
    watch = _ReachWatch(GIVE_UP_AFTER, halt)
    async with contextlib.AsyncExitStack() as stack:
        if stop is not None:
            relay = asyncio.ensure_future(_relay(stop, halt))
            stack.callback(relay.cancel)
        # Requests go round-robin to a few clients: httpcore scans its whole pool when a request starts or
        # ends, so one pool of n connections costs O(n) per request; shards keep n small at high load.
        shards = [await stack.enter_async_context(make_client(opts, transport)) for _ in range(CLIENT_SHARDS)]
        try:
            if ahead.pull():  # the opening burst is built before the clock starts, not behind its send times
                ahead.fill(ahead.queue[0][0].send_at_s, math.inf)
            origin = time.perf_counter()
            while ahead.queue:
                nxt, model, body = ahead.queue[0]
                due = origin + nxt.send_at_s
                ahead.fill(nxt.send_at_s, due - _PREBUILD_MARGIN_S)
                # Behind schedule, still yield once per request: the tasks already created send now, rather
                # than after every overdue body is built (all of them in memory, the first send seconds late).
                if await _stopped_while_waiting(halt, due - time.perf_counter()):
                    break
                if slots is not None and not await _slot_unless_stopped(slots.sem, halt):
                    break
                freed = slots.took() if slots is not None else None
                ahead.pop()
                rec = RequestRecord(
                    nxt.index,
                    nxt.send_at_s,
                    nxt.input_tokens,
                    0 if target.endpoint in WHOLE_ENDPOINTS else nxt.output_tokens,  # an embedding: none
                    trace_line=nxt.trace_line,
                    model=model,
                )
                rec.slot_s = rec.scheduled_s if freed is None else max(rec.scheduled_s, freed - origin)
                result.records.append(rec)
                client = shards[nxt.index % len(shards)]
                task = asyncio.create_task(
                    _one(rec, body, client, target, opts, origin, slots, observer, watch)
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(0)  # the task sends now, not after the next body is built
                if not ahead.queue:
                    ahead.pull()
            if ahead.error is not None and not halt.is_set():  # a bad trace row, where reached
                raise ahead.error
            await _until_done_or_stopped(tasks, halt)
        finally:  # a trace error mid-replay (or Ctrl-C): no request is left running
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
    if halt.is_set():
        result.interrupted = stop is not None and stop.is_set()
        result.gave_up = watch.tripped
        why = "the replay was interrupted" if result.interrupted else "the target refuses every request"
        now = time.perf_counter() - origin
        for rec in result.records:
            if not rec.success and rec.error_type is None:  # in flight when the run stopped
                rec.error_type, rec.error, rec.end_s = "cancelled", why, now
    result.duration_s = replay_duration(result.records)
    return result


async def _relay(stop: asyncio.Event, halt: asyncio.Event) -> None:
    await stop.wait()
    halt.set()


async def _stopped_while_waiting(stop: asyncio.Event | None, delay: float) -> bool:
    """Wait `delay` seconds (at least one yield); True as soon as `stop` is set."""
    if stop is None or delay <= 0:
        await asyncio.sleep(max(0.0, delay))
    else:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stop.wait()
    return stop is not None and stop.is_set()


async def _slot_unless_stopped(slots: asyncio.Semaphore, stop: asyncio.Event | None) -> bool:
    """Acquire a concurrency slot (True), or give up as soon as `stop` is set (False, nothing held)."""
    if stop is None:
        await slots.acquire()
        return True
    acquire = asyncio.ensure_future(slots.acquire())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not acquire.done():
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
    got = acquire.done() and not acquire.cancelled()
    if got and stop.is_set():
        slots.release()
    return got and not stop.is_set()


async def _until_done_or_stopped(tasks: set[asyncio.Task[None]], stop: asyncio.Event | None) -> None:
    """Every request task finished, or `stop` set (the caller's `finally` cancels the rest)."""
    if stop is None:
        if tasks:
            await asyncio.gather(*tasks)
        return
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while tasks and not stop.is_set():
            done, _ = await asyncio.wait({*tasks, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopped}:
                task.result()  # a request task's unexpected error surfaces, as gather raised it
    finally:
        stopped.cancel()


class _Prebuilt:
    """The requests read from the trace but not yet sent, each with its body, in send order. A trace error
    is kept and raised by the caller once every request before the bad row has been sent (as reading the
    trace one request at a time would)."""

    def __init__(
        self, it: Iterator[ScheduledRequest], target: Target, prompts: PromptBuilder, models: ModelChooser
    ) -> None:
        self._it, self._target, self._prompts, self._models = it, target, prompts, models
        self.queue: deque[tuple[ScheduledRequest, str, bytes]] = deque()  # request, its model, its body
        self.bytes = 0
        self.error: Exception | None = None
        self._done = False

    def pull(self) -> bool:
        """Read and build one more request; False at the trace's end (or its error)."""
        if self._done:
            return False
        try:
            req = next(self._it, None)
        except Exception as exc:  # any reader error ends the trace here; re-raised in order
            self.error, self._done = exc, True
            return False
        if req is None:
            self._done = True
            return False
        model = self._models.model_for(req.index)
        body = build_body(req, self._target.endpoint, model, self._prompts, self._target.rerank_documents)
        self.queue.append((req, model, body))
        self.bytes += len(body)
        return True

    def fill(self, head_s: float, deadline: float) -> None:
        """Build the requests due within `PREBUILD_WINDOW_S` after the head (`head_s`), while the wall clock
        is before `deadline` and the bytes stay under `PREBUILD_BYTES`."""
        while (
            self.queue[-1][0].send_at_s - head_s < PREBUILD_WINDOW_S
            and self.bytes < PREBUILD_BYTES
            and time.perf_counter() < deadline
            and self.pull()
        ):
            pass

    def pop(self) -> None:
        _, _, body = self.queue.popleft()
        self.bytes -= len(body)
