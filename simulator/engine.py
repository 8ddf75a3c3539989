"""A vLLM v1 engine model: the scheduler's semantics, timed by the roofline perf model. Pure and synchronous.

Public API (stable; the HTTP worker, the cluster simulator and `mosaic profile --sim` build on it)::

    engine = Engine(perf: PerfModel, config: EngineConfig = EngineConfig(), seed: int = 0,
                    kv: KvAccounting | None = None)
    engine.add_request(req: EngineRequest, now: float, arrival: float | None = None) -> None  # ValueError
    engine.step(now: float) -> StepResult                             # one forward pass starting at `now`
    engine.abort(request_id: str, now: float) -> RequestRecord | None
    engine.release_held(request_id: str) -> int                       # P/D: decode side fetched the KV
    engine.expire_held(now: float) -> int                             # P/D: free holds past their timeout
    engine.next_hold_expiry() -> float | None                         # P/D: when the earliest hold times out
    engine.has_work() -> bool;  engine.next_event_time() -> float | None  (a KV transfer landing)
    engine.inspect(request_id) -> SeqView | None;  engine.requests() -> list[SeqView]
    state: num_running, num_waiting, num_held, kv_usage, num_gpu_blocks, block_size, max_model_len,
           counters (EngineCounters), config, perf, kv, api_overhead_s
    run_offline(engine, arrivals) -> list[RequestRecord]               # closed-loop driver for tests/benches

Time is simulated seconds, passed in. A driver calls `step(now)` with `now` = the previous step's end while
`has_work()`; the step's duration is `StepResult.duration_s`. The HTTP worker sleeps duration / time_scale.

Scheduling, as vLLM v1's `Scheduler.schedule()` does it (chunked prefill always on):
1. RUNNING first, in admission order, each within the per-step token budget `max_num_batched_tokens`:
   every decoding sequence takes 1 token (vLLM requires max_num_batched_tokens ≥ max_num_seqs, so all
   decodes fit); the one sequence still mid-prefill (always the most recently admitted) takes
   min(remaining prompt, budget left). A sequence that needs a new KV block and finds none free preempts
   the most recently admitted running sequence (possibly itself) — preemption by *recompute*: its blocks
   are freed, it goes to the front of WAITING with nothing computed, and later recomputes prompt + the
   tokens it already generated (those are not re-emitted). Each preemption is counted.
2. WAITING next, FCFS, only if nothing was preempted this step: admit while there is budget left, fewer
   than `max_num_seqs` running, and free blocks for the chunk (no preemption for new requests): the chunk
   is min(prompt remaining, budget left).
3. A sequence whose prefill (or recompute) completes in the step emits one token at the step's end; each
   decode emits one token. A sequence finishes at `max_tokens` (or max_model_len) → "length", or at its
   natural length (EOS; ignored with `ignore_eos`, not before `min_tokens`) → "stop".
KV: a sequence with T tokens of KV holds `kv.blocks_for(req, T)` blocks (ceil(T/block_size) for stock
vLLM); blocks are allocated for the tokens scheduled before the step, freed at finish/abort/preemption.

Step time: `PerfModel.step_time_totals(prefill tokens, Σ p·(c + p/2), decodes, Σ decode context, seqs)`.

Cost: a step is O(1) in the number of decoding sequences plus O(events) — finishes, block growth (once
per block_size tokens per sequence), admissions, preemptions — because decoding sequences are advanced
implicitly by a global step counter: a sequence that joined decode at step g0 with c0 tokens computed has
c0 + (g − g0) at step g. Only `StepResult.decoded` (a tuple of the decoding ids) is O(batch), in C.

Pooling (`EngineRequest.pooling`, vLLM's `--runner pooling`): a prefill-only request, scheduled, chunked,
preempted and holding KV like any other; the step that computes the last of its prompt finishes it (reason
stop, 0 output tokens, its first-token time = its end, as vLLM's pooling outputs carry it) and frees its KV.

Prefix caching (`enable_prefix_caching`, token-id prompts): full prompt blocks are hashed and reused at
admission (simulator/prefix_cache.py); hit tokens cost no prefill work.

LoRA (`EngineRequest.lora`, an adapter name): vLLM 0.32's `max_loras` rule (v1/core/sched/scheduler.py,
`scheduled_loras`): the adapters of the running requests scheduled in the step count; a waiting request of
an adapter not among them is skipped, not admitted, while `config.max_loras` adapters are there already.
A skipped request keeps its place (vLLM puts the step's skipped requests back at the front of WAITING, in
their order) and the requests behind it are still considered: base-model requests and those of adapters
already scheduled go ahead. Adapters cost no time: the perf model has no LoRA term.

Not modelled: speculative decoding, priorities, swap-based preemption, CUDA-graph padding, async
scheduling overlap, LoRA's compute and adapter loading.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from enum import IntEnum

from placement.perf_model import PerfModel
from simulator.engine_types import EngineConfig, EngineCounters, SeqView, StepResult
from simulator.kv_blocks import KvAccounting
from simulator.prefix_cache import PrefixCache, block_hashes
from simulator.requests import (
    EngineRequest,
    FinishReason,
    RequestRecord,
    prompt_fingerprint,
    sample_natural_output,
)

__all__ = ["Engine", "EngineConfig", "EngineCounters", "SeqView", "StepResult", "run_offline"]


class _State(IntEnum):
    WAITING = 0
    TRANSFERRING = 1  # P/D decode side: blocks allocated, KV in flight
    PREFILL = 2  # running, prompt (or recompute) not fully computed
    DECODING = 3
    HELD = 4  # P/D prefill side: finished, blocks kept for the decode side
    DONE = 5


_DECODING = _State.DECODING  # module constant: enum attribute lookups are slow in tight loops


class _Seq:
    """Mutable per-request state. While DECODING, `out`/`computed`/`num_tokens` are stale: see `_sync`."""

    __slots__ = (
        "arrival", "blocks", "c0", "cached", "computed", "expiry", "first_scheduled", "first_token", "g0", "g_fin", "grow_at",
        "hashes", "id", "n_hashed", "num_tokens", "out", "out0", "pending", "preemptions", "prompt_len", "ready_at",
        "remote_pending", "req", "shared", "state", "stop_at", "stop_reason",
    )  # fmt: skip

    def __init__(self, req: EngineRequest, arrival: float, stop_at: int, stop_reason: FinishReason) -> None:
        self.req = req
        self.id = req.request_id
        self.prompt_len = req.num_prompt_tokens
        self.arrival = arrival
        self.stop_at = stop_at
        self.stop_reason = stop_reason
        self.num_tokens = self.prompt_len  # prompt + generated
        self.computed = 0  # tokens whose KV is computed
        self.cached = 0  # prompt tokens it did not compute (prefix cache, remote KV), as first scheduled
        self.out = 0
        self.blocks = 0
        self.state = _State.WAITING
        # While DECODING: g_fin = the step emitting its last token, grow_at = the step opening its next block.
        # Filed events are valid only if they still match these (and the state): no per-event tuples.
        self.g0 = self.c0 = self.out0 = self.g_fin = 0
        self.grow_at = -1
        self.pending = 0  # blocks requested in the current step's growth pass
        self.preemptions = 0
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        kvt = req.kv_transfer
        self.remote_pending = bool(kvt and kvt.remote_prefilled)
        self.ready_at = 0.0
        self.expiry = 0.0
        # Prefix caching: the prompt's full-block hashes, how many of them this sequence has registered or
        # reused (a prefix), and the cached blocks it references (included in `blocks`, not private).
        self.hashes: tuple[int, ...] = ()
        self.n_hashed = 0
        self.shared: list[int] = []


class Engine:
    """One vLLM engine (one model replica on `perf.tp` GPUs). See the module docstring for the contract."""

    def __init__(
        self,
        perf: PerfModel,
        config: EngineConfig | None = None,
        seed: int = 0,
        kv: KvAccounting | None = None,
    ) -> None:
        self.perf = perf
        self.config = config = config or EngineConfig()
        self.seed = seed
        if kv is None:
            blocks = config.num_gpu_blocks or perf.kv_capacity_blocks(
                config.gpu_memory_utilization, config.block_size
            )
            if blocks < 1:
                raise ValueError(
                    f"{perf.model.name} does not fit on {perf.tp}× {perf.gpu.name} at "
                    f"gpu_memory_utilization {config.gpu_memory_utilization}: no room for KV blocks"
                )
            kv = KvAccounting(blocks, config.block_size)
        self.kv = kv
        # Stock paging lets the decode growth pass skip the per-sequence calls (one block every block_size).
        self._uniform_kv = (
            type(kv).blocks_for is KvAccounting.blocks_for
            and type(kv).next_growth is KvAccounting.next_growth
        )
        capacity = kv.capacity_tokens()
        if config.max_model_len is None:
            self.max_model_len = min(perf.model.max_context, capacity)
        elif config.max_model_len > perf.model.max_context and not config.allow_long_max_model_len:
            raise ValueError(long_max_model_len_error(config.max_model_len, perf.model.max_context))
        elif config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the KV cache capacity of {capacity} tokens "
                f"({kv.usable} usable blocks of {kv.block_size}: {kv.num_blocks} less vLLM's null block)"
            )
        else:
            self.max_model_len = config.max_model_len
        # Per-request API-server time (tokenise, schedule, detokenise): drivers add it before admission.
        self.api_overhead_s = perf.constants.api_overhead_s
        self.counters = EngineCounters()
        self._pc = PrefixCache(kv) if config.enable_prefix_caching else None
        self._g = 0  # step counter: decoding sequences advance implicitly with it
        self._ctx_base = 0  # Σ (c0 − g0) over decoding sequences → Σ context = ctx_base + n·(g + 1)
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}  # admission order; the last one is "most recently admitted"
        self._decoding: dict[str, _Seq] = {}
        self._decoded: tuple[str, ...] | None = ()  # tuple(self._decoding), None when stale
        self._partial: _Seq | None = None  # the running sequence still mid-prefill (tail of running)
        self._transferring: dict[str, _Seq] = {}
        self._transfer_heap: list[tuple[float, int, _Seq]] = []
        self._held: dict[str, _Seq] = {}
        self._held_heap: list[tuple[float, int, _Seq]] = []
        self._growth: dict[int, list[_Seq]] = {}  # step → sequences opening a block then
        self._finish: dict[int, list[_Seq]] = {}  # step → sequences emitting their last token
        self._tie = 0
        self._landed: list[str] = []  # transfers landed during the current step (StepResult.kv_received)
        self._prompt_computed = 0  # prompt tokens of the requests whose first token the current step emits
        self._pooled = 0  # pooling requests the current step finished (StepResult.num_pooled)
        self._now = 0.0  # start of the step being scheduled
        self._loras: dict[str, int] = {}  # LoRA adapter → running sequences of it (vLLM's scheduled_loras)

    # ---------------------------------------------------------------- state
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """vLLM counts requests waiting for remote KV in its waiting queue too."""
        return len(self._waiting) + len(self._transferring)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def inspect(self, request_id: str) -> SeqView | None:
        """The current state of one request in the engine (waiting, running, transferring or held)."""
        s = self._seqs.get(request_id) or self._held.get(request_id)
        if s is None:
            return None
        k = self._g - s.g0 if s.state is _DECODING else 0
        out = s.out0 + k if s.state is _DECODING else s.out
        computed = s.c0 + k if s.state is _DECODING else s.computed
        return SeqView(
            s.id, s.state.name.lower(), s.prompt_len, computed, out, s.blocks, s.stop_at, s.preemptions
        )

    def requests(self) -> list[SeqView]:
        """Every request the engine holds, in no particular order (O(n): for tests and debugging)."""
        ids = list(self._seqs) + list(self._held)
        return [v for v in map(self.inspect, ids) if v is not None]

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._transferring)

    def next_event_time(self) -> float | None:
        """When a remote KV transfer lands (the only thing that can unblock an idle engine with work)."""
        heap = self._transfer_heap
        while heap and heap[0][2].state is not _State.TRANSFERRING:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def next_hold_expiry(self) -> float | None:
        """When the earliest P/D hold times out and frees its blocks (a request waiting for KV may then be
        admitted); None without holds. Stale heap entries (holds released since) are dropped."""
        heap = self._held_heap
        while heap and heap[0][2].state is not _State.HELD:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # ---------------------------------------------------------------- requests in and out
    def add_request(self, req: EngineRequest, now: float, arrival: float | None = None) -> None:
        """Queue `req`, reaching the engine at `now`; `arrival` (default `now`) is when the client sent it, the
        origin of the record's queue time, TTFT and e2e (drivers pass now − API overhead). ValueError: duplicate id, empty prompt, prompt ≥ max_model_len, bad
        max_tokens / min_tokens. max_tokens beyond max_model_len − prompt is clamped (vLLM's API does so)."""
        rid = req.request_id
        if rid in self._seqs or rid in self._held:
            raise ValueError(f"request id {rid!r} is already in the engine")
        prompt = req.num_prompt_tokens
        if prompt < 1:
            raise ValueError("prompt must have at least one token")
        if req.pooling:
            self._queue(req, self._check_pooling(req, prompt), FinishReason.STOP, now, arrival)
            return
        if prompt >= self.max_model_len:
            raise ValueError(
                f"prompt of {prompt} tokens leaves no room for output (max_model_len {self.max_model_len})"
            )
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if not 0 <= req.min_tokens <= req.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {req.min_tokens}")
        cap = min(req.max_tokens, self.max_model_len - prompt)
        stop_at, reason = cap, FinishReason.LENGTH
        if not req.ignore_eos:
            natural = req.natural_output_tokens
            if natural is None:
                c = self.config
                natural = sample_natural_output(
                    self.seed, prompt_fingerprint(req), c.natural_output_mean, c.natural_output_shape
                )
            natural = max(natural, req.min_tokens, 1)
            if natural < cap:  # EOS before the length limit; at equality vLLM reports "length"
                stop_at, reason = natural, FinishReason.STOP
        self._queue(req, stop_at, reason, now, arrival)

    def _check_pooling(self, req: EngineRequest, prompt: int) -> int:
        """A pooling request's own checks (ValueError); returns its output length, 0. Its prompt may fill the
        context: nothing is generated after it (vLLM's pooling runner takes a prompt of max_model_len)."""
        if prompt > self.max_model_len:
            raise ValueError(f"prompt of {prompt} tokens exceeds max_model_len {self.max_model_len}")
        if req.max_tokens != 0 or req.min_tokens != 0:
            raise ValueError("a pooling request generates no tokens: max_tokens and min_tokens must be 0")
        if req.kv_transfer is not None:
            raise ValueError("a pooling request has no P/D role (vLLM disaggregates generation only)")
        return 0

    def _queue(
        self, req: EngineRequest, stop_at: int, reason: FinishReason, now: float, arrival: float | None
    ) -> None:
        s = _Seq(req, now if arrival is None else arrival, stop_at, reason)
        if self._pc is not None and req.token_ids is not None:
            s.hashes = block_hashes(req.token_ids, self.kv.block_size, req.lora)
        self._seqs[req.request_id] = s
        self._waiting.append(s)

    def abort(self, request_id: str, now: float) -> RequestRecord | None:
        """Drop a request wherever it is (no success counted, as in vLLM). None if unknown or finished."""
        s = self._seqs.get(request_id)
        if s is None:
            self.release_held(request_id)
            return None
        if s.state is _State.WAITING:
            self._waiting.remove(s)
        elif s.state is _State.TRANSFERRING:
            del self._transferring[request_id]
        else:
            self._leave_running(s)
        self._free_blocks(s)
        s.state = _State.DONE
        del self._seqs[request_id]
        return self._record(s, FinishReason.ABORT, now)

    def release_held(self, request_id: str) -> int:
        """Free the blocks a prefill-only request kept for its decode side; returns the blocks freed."""
        s = self._held.pop(request_id, None)
        if s is None:
            return 0
        s.state = _State.DONE
        freed = s.blocks
        self._free_blocks(s)
        return freed

    def expire_held(self, now: float) -> int:
        """Free holds whose timeout passed (vLLM's abort timeout for unfetched KV); returns how many."""
        heap, n = self._held_heap, 0
        while heap and (heap[0][2].state is not _State.HELD or heap[0][0] <= now):
            _, _, s = heapq.heappop(heap)
            if s.state is _State.HELD and self.release_held(s.id):
                n += 1
        return n

    # ---------------------------------------------------------------- the step
    def step(self, now: float) -> StepResult:
        """Schedule and execute one forward pass starting at `now`. Idle (duration 0) when nothing can run."""
        self._now = now
        if self._held_heap:
            self.expire_held(now)
        if self._landed:
            self._landed.clear()
        if self._transfer_heap:
            self._land_transfers(now)
        g = self._g
        preempted: list[str] = []
        if g in self._growth:
            self._grow_decodes(g, preempted)
        decoding = self._decoding
        budget = self.config.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[_Seq, int]] = []
        if self._partial is not None:
            budget = self._schedule_partial(chunks, budget, preempted)
        if self._waiting and not preempted:  # vLLM skips admissions in a step that preempted
            self._admit_waiting(now, chunks, budget)
        n_dec = len(decoding)
        landed = tuple(self._landed) if self._landed else ()
        if n_dec == 0 and not chunks:
            return StepResult(now, 0.0, 0, 0, (), (), (), (), tuple(preempted), landed)
        p_tokens = 0
        pairs = 0.0
        for s, n in chunks:
            p_tokens += n
            pairs += n * (s.computed + n / 2.0)
        ctx_sum = self._ctx_base + n_dec * (g + 1)  # Σ (c + 1): KV each decode attends over
        dur = self.perf.step_time_totals(p_tokens, pairs, n_dec, ctx_sum, n_dec + len(chunks))
        end = now + dur
        c = self.counters
        c.steps += 1
        c.busy_s += dur
        c.generation_tokens += n_dec
        decoded = self._decoded
        if decoded is None:  # rebuilt only when the decoding set changed since the last step
            decoded = self._decoded = tuple(decoding)
        finished: list[RequestRecord] = []
        fin = self._finish.pop(g, None)
        if fin:
            for s in fin:
                if s.g_fin == g and s.state is _DECODING:  # else stale: preempted/aborted since filing
                    self._finish_decode(s, g, end, finished)
        prefilled: list[str] = []
        firsts: list[str] = []
        self._prompt_computed = 0
        self._pooled = 0
        if chunks:
            self._partial = None
            for s, n in chunks:
                s.computed += n
                if s.computed < s.num_tokens:
                    self._partial = s  # budget ran out mid-prompt: only ever the last chunk
                else:
                    self._prefill_done(s, g, end, prefilled, firsts, finished)
        self._g = g + 1
        return StepResult(
            now, dur, p_tokens, n_dec, decoded, tuple(prefilled) if prefilled else (),
            tuple(firsts) if firsts else (), tuple(finished) if finished else (),
            tuple(preempted) if preempted else (), landed, self._prompt_computed, self._pooled,
        )  # fmt: skip

    def _grow_decodes(self, g: int, preempted: list[str]) -> None:
        """Allocate the blocks decodes open this step; preempt from the tail of running until they fit."""
        grow = self._growth.pop(g, None)
        if not grow:
            return
        kv = self.kv
        uniform = self._uniform_kv
        live: list[_Seq] = []
        need = 0
        for s in grow:
            if s.grow_at == g and s.state is _DECODING:
                s.grow_at = -2  # counted: a duplicate entry in this bucket must not count twice
                if uniform:  # a growth step of uniform paging opens exactly one block
                    s.pending = 1
                else:
                    s.pending = kv.blocks_for(s.req, s.c0 + g - s.g0 + 1) - s.blocks
                need += s.pending
                live.append(s)
        while need > kv.free:
            victim = self._running[next(reversed(self._running))]
            need -= victim.pending
            self._preempt(victim, g)
            preempted.append(victim.id)
        if self._pc is not None:
            self._pc.make_room(need)
        kv.allocate(need)
        book = self._growth
        bs = kv.block_size
        for s in live:
            if s.state is _DECODING:
                s.blocks += s.pending
                s.pending = 0
                if uniform:
                    gg = g + bs
                else:
                    c = s.c0 + g - s.g0 + 1  # tokens of KV after this step
                    gg = g + kv.next_growth(s.req, c) - c + 1
                s.grow_at = gg
                if gg <= s.g_fin:
                    bucket = book.get(gg)
                    if bucket is None:
                        book[gg] = [s]
                    else:
                        bucket.append(s)

    def _schedule_partial(self, chunks: list[tuple[_Seq, int]], budget: int, preempted: list[str]) -> int:
        p = self._partial
        if p is None or budget <= 0:
            return budget
        n = min(p.num_tokens - p.computed, budget)
        extra = self.kv.blocks_for(p.req, p.computed + n) - p.blocks
        if extra > self.kv.free:
            # vLLM pops the tail of running to make room, and the mid-prefill sequence *is* the tail.
            self._preempt(p, self._g)
            preempted.append(p.id)
            return budget
        if self._pc is not None:
            self._pc.make_room(extra)
        self.kv.allocate(extra)
        p.blocks += extra
        if p.hashes and self._pc is not None:
            self._register_blocks(self._pc, p, p.computed + n)
        chunks.append((p, n))
        return budget - n

    def _admit_waiting(self, now: float, chunks: list[tuple[_Seq, int]], budget: int) -> None:
        waiting, running, kv = self._waiting, self._running, self.kv
        max_seqs = self.config.max_num_seqs
        loras, max_loras = self._loras, self.config.max_loras
        skipped: list[_Seq] = []  # vLLM's step_skipped_waiting: back at the front, in order, after the pass
        while waiting and budget > 0 and len(running) < max_seqs:
            s = waiting[0]
            lora = s.req.lora
            if lora is not None and len(loras) >= max_loras and lora not in loras:
                skipped.append(waiting.popleft())  # max_loras adapters scheduled: skip, look further
                continue
            if s.remote_pending:
                if not self._start_transfer(s, now):
                    break
                continue  # in flight → the next waiting request may go; landed already → back at the front
            if s.hashes and s.computed == 0 and s.blocks == 0:  # a landed 1-token prompt holds its block
                n = self._admit_cached(s, budget, chunks)
                if n == 0:
                    break
                budget -= n
                continue
            n = min(s.num_tokens - s.computed, budget)
            extra = kv.blocks_for(s.req, s.computed + n) - s.blocks
            if extra > kv.free:
                break  # new requests never preempt
            waiting.popleft()
            if self._pc is not None and s.computed == 0 and s.blocks == 0:
                # vLLM counts every new request's tokens as a prefix-cache query, hashed blocks or not
                self.counters.prefix_cache_queries += s.num_tokens
            if self._pc is not None:
                self._pc.make_room(extra)
            kv.allocate(extra)
            s.blocks += extra
            if (
                s.hashes and self._pc is not None
            ):  # remote KV landed (P/D): its prompt blocks become cacheable
                self._register_blocks(self._pc, s, s.computed + n)
            s.state = _State.PREFILL
            running[s.id] = s
            if lora is not None:
                loras[lora] = loras.get(lora, 0) + 1
            if s.first_scheduled is None:
                s.first_scheduled = now
                s.cached = s.computed
            chunks.append((s, n))
            budget -= n
        if skipped:
            waiting.extendleft(reversed(skipped))

    def _admit_cached(self, s: _Seq, budget: int, chunks: list[tuple[_Seq, int]]) -> int:
        """Admit `s` reusing its cached prompt prefix (prefix caching); returns the chunk's tokens, 0 when it
        does not fit."""
        pc, kv = self._pc, self.kv
        assert pc is not None
        bs = kv.block_size
        k = pc.match(s.hashes, (s.num_tokens - 1) // bs)  # leave ≥ 1 token to compute (for the logits)
        hit = s.hashes[:k]
        n = min(s.num_tokens - k * bs, budget)
        extra = kv.blocks_for(s.req, k * bs + n) - k
        if extra + pc.pool_cost(hit) > kv.free:
            return 0  # new requests never preempt
        self._waiting.popleft()
        c = self.counters
        c.prefix_cache_queries += s.num_tokens
        c.prefix_cache_hits += k * bs
        pc.acquire(hit)
        s.shared = list(hit)
        s.n_hashed = k
        s.computed = k * bs
        pc.make_room(extra)
        kv.allocate(extra)
        s.blocks = k + extra
        self._register_blocks(pc, s, k * bs + n)
        s.state = _State.PREFILL
        self._running[s.id] = s
        lora = s.req.lora
        if lora is not None:
            self._loras[lora] = self._loras.get(lora, 0) + 1
        if s.first_scheduled is None:
            s.first_scheduled = self._now
            s.cached = s.computed
        chunks.append((s, n))
        return n

    def _register_blocks(self, pc: PrefixCache, s: _Seq, tokens: int) -> None:
        """Cache the prompt blocks that are full once `tokens` are computed. Done when the chunk is scheduled,
        as vLLM v1 does, so a request admitted later in the same step already hits them (the forward pass
        writes a layer's KV before that layer's attention reads it)."""
        full = min(tokens // self.kv.block_size, len(s.hashes))
        for i in range(s.n_hashed, full):
            h = s.hashes[i]
            pc.register(h)
            s.shared.append(h)
        if full > s.n_hashed:
            s.n_hashed = full

    def _free_blocks(self, s: _Seq) -> None:
        """Give back a sequence's blocks: private ones to the pool, cached ones by reference."""
        if s.shared:
            assert self._pc is not None
            self.kv.release(s.blocks - len(s.shared))
            # reversed, as vLLM frees a request's blocks: the tail is evicted first and the reusable
            # prefix stays (head first evicted the prefix and kept tail blocks no lookup can reach)
            self._pc.release(s.shared[::-1])
            s.shared = []
        else:
            self.kv.release(s.blocks)
        s.blocks = 0
        s.n_hashed = 0

    # ---------------------------------------------------------------- P/D transfers
    def _start_transfer(self, s: _Seq, now: float) -> bool:
        """Allocate the prompt's blocks and start pulling its KV; False when the blocks do not fit yet."""
        need = self.kv.blocks_for(s.req, s.prompt_len) - s.blocks
        if need > self.kv.free:
            return False
        self._waiting.popleft()
        if self._pc is not None:
            self._pc.make_room(need)
        self.kv.allocate(need)
        s.blocks += need
        assert s.req.kv_transfer is not None
        s.ready_at = now + s.req.kv_transfer.transfer_delay_s
        s.state = _State.TRANSFERRING
        self._transferring[s.id] = s
        self._tie += 1
        heapq.heappush(self._transfer_heap, (s.ready_at, self._tie, s))
        if s.ready_at <= now:
            self._land_transfers(now)
        return True

    def _land_transfers(self, now: float) -> None:
        """KV that arrived by `now`: those requests return to the front of WAITING with prompt − 1 computed
        (vLLM recomputes the last prompt token on the decode side to get logits for the first output)."""
        heap, landed = self._transfer_heap, []
        while heap and (heap[0][2].state is not _State.TRANSFERRING or heap[0][0] <= now):
            _, _, s = heapq.heappop(heap)
            if s.state is _State.TRANSFERRING:
                del self._transferring[s.id]
                s.state = _State.WAITING
                s.remote_pending = False
                s.computed = s.prompt_len - 1
                landed.append(s)
                self._landed.append(s.id)
        self._waiting.extendleft(reversed(landed))

    # ---------------------------------------------------------------- transitions
    @staticmethod
    def _file(book: dict[int, list[_Seq]], g: int, s: _Seq) -> None:
        bucket = book.get(g)
        if bucket is None:
            book[g] = [s]
        else:
            bucket.append(s)

    def _join_decode(self, s: _Seq, g_next: int) -> None:
        s.state = _DECODING
        s.g0, s.c0, s.out0 = g_next, s.computed, s.out
        s.g_fin = g_next + s.stop_at - s.out - 1  # the step that emits token number stop_at
        self._decoding[s.id] = s
        self._decoded = None
        self._ctx_base += s.c0 - g_next
        self._file(self._finish, s.g_fin, s)
        gg = s.grow_at = g_next + self.kv.next_growth(s.req, s.c0) - s.c0
        if gg <= s.g_fin:
            self._file(self._growth, gg, s)

    def _sync(self, s: _Seq, g: int) -> None:
        """Materialise a decoding sequence's counts before step `g` runs, and take it out of DECODING."""
        k = g - s.g0
        s.out = s.out0 + k
        s.computed = s.c0 + k
        s.num_tokens = s.prompt_len + s.out
        del self._decoding[s.id]
        self._decoded = None
        self._ctx_base -= s.c0 - s.g0
        s.grow_at = -1

    def _leave_running(self, s: _Seq) -> None:
        if s.state is _DECODING:
            self._sync(s, self._g)
        elif s is self._partial:
            self._partial = None
        s.pending = 0
        self._stop_running(s)

    def _stop_running(self, s: _Seq) -> None:
        """Take `s` out of RUNNING (finished, preempted or aborted), and its adapter's count with it."""
        del self._running[s.id]
        lora = s.req.lora
        if lora is not None:
            left = self._loras[lora] - 1
            if left:
                self._loras[lora] = left
            else:
                del self._loras[lora]

    def _preempt(self, s: _Seq, g: int) -> None:
        self._leave_running(s)
        self._free_blocks(s)
        self.counters.preemptions += 1
        self.counters.recomputed_tokens += s.computed
        s.computed = 0
        s.preemptions += 1
        s.state = _State.WAITING
        # to the front, as vLLM requeues it, but behind requests whose remote KV already landed: they hold
        # their blocks and need none to go on, and a recompute ahead of them that cannot get blocks while they
        # wait preempted itself every other step, forever
        waiting = self._waiting
        ready = 0
        while ready < len(waiting) and waiting[ready].blocks > 0 and not waiting[ready].remote_pending:
            ready += 1
        waiting.insert(ready, s)

    def _prefill_done(
        self,
        s: _Seq,
        g: int,
        end: float,
        prefilled: list[str],
        firsts: list[str],
        finished: list[RequestRecord],
    ) -> None:
        prefilled.append(s.id)
        if s.req.pooling:  # prefill only: done now, its KV freed, no token generated or counted
            self._pooled += 1
            s.first_token = end
            self.counters.prompt_tokens += s.prompt_len
            self._prompt_computed += s.prompt_len - s.cached
            firsts.append(s.id)
            self._stop_running(s)
            self._end(s, end, finished)
            return
        s.out += 1
        s.num_tokens += 1
        self.counters.generation_tokens += 1
        if s.first_token is None:
            s.first_token = end
            self.counters.prompt_tokens += s.prompt_len
            self._prompt_computed += s.prompt_len - s.cached
            firsts.append(s.id)
        if s.out >= s.stop_at:
            self._stop_running(s)
            self._end(s, end, finished)
        else:
            self._join_decode(s, g + 1)

    def _finish_decode(self, s: _Seq, g: int, end: float, finished: list[RequestRecord]) -> None:
        self._sync(s, g + 1)  # counts after step g
        self._stop_running(s)
        self._end(s, end, finished)

    def _end(self, s: _Seq, end: float, finished: list[RequestRecord]) -> None:
        del self._seqs[s.id]
        self.counters.success[s.stop_reason.value] += 1
        kvt = s.req.kv_transfer
        if kvt is not None and kvt.prefill_only:
            s.state = _State.HELD
            s.expiry = end + kvt.hold_timeout_s
            self._held[s.id] = s
            self._tie += 1
            heapq.heappush(self._held_heap, (s.expiry, self._tie, s))
            finished.append(self._record(s, s.stop_reason, end, held=s.blocks))
            return
        self._free_blocks(s)
        s.state = _State.DONE
        finished.append(self._record(s, s.stop_reason, end))

    def _record(self, s: _Seq, reason: FinishReason, end: float, held: int = 0) -> RequestRecord:
        return RequestRecord(
            s.id,
            s.prompt_len,
            s.out,
            reason,
            s.arrival,
            s.first_scheduled,
            s.first_token,
            end,
            s.preemptions,
            held,
        )


def run_offline(engine: Engine, arrivals: Iterable[tuple[float, EngineRequest]]) -> list[RequestRecord]:
    """Drive `engine` through requests sent at the given client times until all finish; records in finish order.

    Each request reaches the engine `engine.api_overhead_s` after it is sent (tokenisation, API server), and its
    record's `arrival` is the send time, so `ttft` is what a client such as vLLM's benchmark_serving measures.
    Stops early (leaving requests unfinished) only if the engine can make no progress at all.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    overhead = engine.api_overhead_s
    records: list[RequestRecord] = []
    i, n, now = 0, len(pending), 0.0
    step, add, has_work = engine.step, engine.add_request, engine.has_work
    while i < n or has_work():
        while i < n and pending[i][0] + overhead <= now:
            t, req = pending[i]
            add(req, t + overhead, arrival=t)
            i += 1
        res = step(now)
        if res.finished:
            records.extend(res.finished)
        if res.duration_s > 0.0:  # something ran (a step always has a fixed cost)
            now += res.duration_s
            continue
        if res.preempted:  # everything running was preempted: admissions resume next step
            continue
        times = [
            t
            for t in (
                engine.next_event_time(),
                engine.next_hold_expiry(),
                pending[i][0] + overhead if i < n else None,
            )
            if t is not None
        ]
        if not times:
            break
        now = max(now, min(times))
    return records


def long_max_model_len_error(max_model_len: int, context: int) -> str:
    """vLLM 0.32's start-up refusal of a `--max-model-len` past the model's context (its config.json's
    max_position_embeddings), unless env VLLM_ALLOW_LONG_MAX_MODEL_LEN is set."""
    return (
        f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
        f"(max_position_embeddings={context} or model_max_length=None in model's config.json). To allow "
        "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
    )
