"""Property-based fault injection at the gateway's HTTP seam (docs/gateway.md, "Failure handling";
../shared/DESIGN.md, the request lifecycle).

Hypothesis draws a fleet (1-3 mixed workers, optionally a prefill + decode pair), a fault per worker
(`tests.gateway.fakes.FakeWorker` modes plus `ChaosWorker`'s: streams cut without `[DONE]`, `abort`
finishes, a whole answer reset halfway, a stream that goes silent until its read times out, streams read
in pieces that split events, awkward token text and stop strings), the gateway's time limits, retry count,
routing policy and an optional graceful shutdown mid-batch, and a batch of 1-8 concurrent requests (chat or
completions, streaming or not, include_usage, n, long prompts that take the P/D path, clients that hang up
before the first byte or mid-stream). The app is driven in-process by a small ASGI client (`call`) rather
than `httpx.ASGITransport`, which buffers the whole response and cannot hang up mid-stream.

For every example:

1. every request gets an answer: a whole answer is 200 with an OpenAI completion, or 4xx/5xx with an OpenAI
   error body (with `x-request-id`, a right `content-length`, and a passed-through 429/5xx's Retry-After);
   a stream ends with `data: [DONE]` exactly once and nothing after it, its error events have OpenAI's
   error shape, and it carries a usage event exactly when the client asked (clients that hung up are
   exempt: nobody reads their answer);
2. each request ends in exactly one terminal outcome (the `mosaic_request_outcomes_total` and
   `mosaic_requests_total` samples sum to the requests sent, and the dispatcher's `finish` recorded one per
   request id), `completed` only for an answer that completed (200 without `finish_reason: abort`, or a
   stream with `[DONE]` and no error event) and, for a client still there, every answer that completed is
   `completed`;
3. afterwards (and again after the lifespan's shutdown) no in-flight ticket, prefill token or KV
   reservation is left, the KV ledger saw no double release, and no request is still open;
4. nothing hangs (each batch is bounded by `asyncio.wait_for`);
5. no request is dispatched more than `1 + max_retries` times, `mosaic_retries_total` counts exactly the
   re-dispatches, and none follows an answer that is never retried (4xx, 500, a 4xx error event);
6. no failure is told to the breaker of a worker that serves well or only refuses (4xx, 429).

It found two bugs, fixed, each pinned by a plain test in `test_fault_endings.py`: a stream that opens with
an error event read in pieces was judged on its first read (a fragment passed through, a 4xx refusal
retried and blamed, a 5xx failure relayed), and a model stopped on the stop string `[DONE]` ended its
stream early (the relay took `"stop_reason":"[DONE]"}]}` for the end).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from server.app import create_app
from server.gateway import Gateway
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool

MODEL = "llama-3-8b"
LONG_PROMPT = "word " * 400  # ≈ 500 estimated tokens: over the 256-token P/D threshold
BATCH_BOUND_S = 8.0  # invariant 4: a batch that takes longer than this hangs


# ---------------------------------------------------------------------------------------------- fakes
class ChaosWorker(FakeWorker):
    """`FakeWorker` plus:

    - modes `no_done` (a stream whose body ends after `die_after` tokens without `[DONE]`: a worker that
      died behind a close-delimited body), `abort` (vLLM stopping: `finish_reason: "abort"` on a stream's
      last token or on a whole answer), `die_whole` (a whole answer's body cut halfway by a reset) and
      `stall_mid_stream` (silent after `die_after` tokens until the
      read times out, as a real httpx transport's read timeout would end it);
    - `cut`: how a stream's bytes reach the gateway: 0 as the fake yields them (one event per read), k > 0
      in reads of k bytes (TCP splits events anywhere);
    - `text`: what the last token of a stream says, when set (a model may generate any text);
    - `stop_reason`: the stop string that ended a stream, when set: its last token event says
      `"finish_reason": "stop", "stop_reason": <it>` as its last member, where vLLM puts it.
    """

    cut: int = 0
    text: str | None = None
    stop_reason: str | None = None
    read_timeout_s: float = 60.0  # the request's read timeout (what a real httpx transport allows a read)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.read_timeout_s = request.extensions.get("timeout", {}).get("read") or 60.0
        if self.mode in ("abort", "die_whole") and request.url.path.startswith("/v1/"):
            body = json.loads(request.content)
            if not body.get("stream") and not (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                response = await super().handle(request)
                if self.mode == "die_whole":  # the connection drops halfway through a whole answer's body
                    content = response.content

                    async def half() -> AsyncIterator[bytes]:
                        yield content[: len(content) // 2]
                        raise httpx.ReadError("connection reset by peer")

                    return httpx.Response(200, headers={"content-type": "application/json"}, content=half())
                payload = json.loads(response.content)
                payload["choices"][0]["finish_reason"] = "abort"
                return httpx.Response(200, content=json.dumps(payload, separators=(",", ":")).encode())
        return await super().handle(request)

    async def _stream(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        held = b""
        async for piece in self._events(chat, n, usage):
            last = f'"w{n - 1} "'.encode()
            if self.stop_reason is not None and piece.find(last) >= 0 and piece.endswith(b"}]}\n\n"):
                stop = json.dumps(self.stop_reason).encode()
                piece = piece.replace(b'"finish_reason": "length"', b'"finish_reason": "stop"')
                piece = piece[:-5] + b', "stop_reason": ' + stop + b"}]}\n\n"
            if self.text is not None:
                piece = piece.replace(last, json.dumps(self.text).encode())
            if not self.cut:
                yield piece
                continue
            held += piece
            while len(held) >= self.cut:
                yield held[: self.cut]
                held = held[self.cut :]
        if held:
            yield held

    async def _events(self, chat: bool, n: int, usage: bool) -> AsyncIterator[bytes]:
        if self.mode == "stall_mid_stream":
            tokens = 0
            async for piece in super()._stream(chat, n, usage):
                if b'"finish_reason": null' in piece and b'"role"' not in piece:  # a token event
                    if tokens == self.die_after:
                        await asyncio.sleep(self.read_timeout_s)
                        raise httpx.ReadTimeout("read timed out")
                    tokens += 1
                yield piece
            return
        if self.mode not in ("no_done", "abort"):
            async for piece in super()._stream(chat, n, usage):
                yield piece
            return
        obj = "chat.completion.chunk" if chat else "text_completion"
        last = n - 1 if self.mode == "abort" else min(self.die_after, n) - 1
        for i in range(last + 1):
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            finish = "abort" if self.mode == "abort" and i == last else None
            choice = {"index": 0, "finish_reason": finish}
            choice |= {"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "}
            event = {"id": "x", "object": obj, "model": self.model, "choices": [choice]}
            yield b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        if self.mode == "abort":
            yield b"data: [DONE]\n\n"
        # no_done: the body just ends


# ------------------------------------------------------------------------------------------ strategies
@dataclass(frozen=True)
class WorkerSpec:
    mode: str
    status: int = 503
    error_code: int = 500
    tokens: int = 4
    die_after: int = 2
    chunk_delay_s: float = 0.0
    tail_delay_s: float = 0.0
    whole_delay_s: float = 0.0
    role_lead_s: float | None = None
    cut: int = 0
    text: str | None = None
    stop_reason: str | None = None
    retry_after: str | None = None

    def build(self, name: str) -> ChaosWorker:
        # built healthy ("ok"): the fault is switched on after the gateway's startup health checks
        worker = ChaosWorker(
            name,
            mode="ok",
            status=self.status,
            error_code=self.error_code,
            tokens=self.tokens,
            die_after=self.die_after,
            chunk_delay_s=self.chunk_delay_s,
            tail_delay_s=self.tail_delay_s,
            whole_delay_s=self.whole_delay_s,
            role_lead_s=self.role_lead_s,
        )
        worker.cut = self.cut
        worker.text = self.text
        worker.stop_reason = self.stop_reason
        worker.retry_after = self.retry_after
        return worker

    def final(self) -> bool:
        """Its answer ends the request wherever it came from: a refusal (4xx but 429), a 500, or a stream
        refused with a 4xx error event (docs: "4xx and 500 are never retried")."""
        if self.mode == "status":
            return self.status in (400, 404, 500)
        opens_with_error = self.mode == "error_event" or (
            self.mode == "error_mid_stream" and self.die_after == 0
        )
        return opens_with_error and self.error_code < 500

    def blameless(self) -> bool:
        """Its breaker must never hear of a failure: it serves every request well (an answer past the total
        timeout is the request's limit, not its fault), or it only refuses requests (4xx, 429: busy)."""
        if self.mode == "ok":
            return True
        if self.mode == "status":
            return self.status < 500
        return self.mode == "error_event" and self.error_code < 500


MODES = [
    "ok",
    "refuse",
    "status",
    "stall",
    "die_mid_stream",
    "no_kv_params",
    "error_event",
    "error_mid_stream",
    "no_done",
    "abort",
    "stall_mid_stream",
    "die_whole",
]
small_delay = st.sampled_from([0.0, 0.0, 0.005, 0.02])

worker_specs = st.builds(
    WorkerSpec,
    mode=st.sampled_from(MODES),
    status=st.sampled_from([400, 404, 429, 500, 502, 503, 504]),
    error_code=st.sampled_from([400, 500]),
    tokens=st.integers(1, 5),
    die_after=st.integers(0, 3),
    chunk_delay_s=small_delay,
    tail_delay_s=small_delay,
    whole_delay_s=st.sampled_from([0.0, 0.0, 0.02, 0.5]),
    role_lead_s=st.sampled_from([None, 0.0, 0.01]),
    cut=st.sampled_from([0, 0, 0, 7, 40]),
    text=st.sampled_from([None, None, None, 'data: {"error": 1}\n\n', '"usage"', "[DONE]"]),
    stop_reason=st.sampled_from([None, None, None, "\n\n", "[DONE]"]),
    retry_after=st.sampled_from([None, "2"]),
)


@dataclass(frozen=True)
class RequestSpec:
    chat: bool
    stream: bool
    include_usage: bool | None  # None: no stream_options
    n: int
    long: bool  # over the P/D threshold
    max_tokens: int | None
    # None | ("before", seconds after arrival) | ("chunks", body pieces received before hanging up)
    disconnect: tuple[str, float] | None

    def body(self, i: int) -> bytes:
        prompt = (LONG_PROMPT if self.long else "hello") + f" q{i}"
        data: dict[str, Any] = {"model": MODEL}
        if self.chat:
            data["messages"] = [{"role": "user", "content": prompt}]
        else:
            data["prompt"] = prompt
        if self.max_tokens is not None:
            data["max_tokens"] = self.max_tokens
        if self.stream:
            data["stream"] = True
            if self.include_usage is not None:
                data["stream_options"] = {"include_usage": self.include_usage}
        if self.n != 1:
            data["n"] = self.n
        return json.dumps(data).encode()


@st.composite
def request_specs(draw: st.DrawFn) -> RequestSpec:
    stream = draw(st.sampled_from([True, True, False]))  # streams have the most ways to end
    disconnect = draw(
        st.one_of(
            st.none(),
            st.none(),
            st.tuples(st.just("before"), st.sampled_from([0.01, 0.06, 0.12])),
            st.tuples(st.just("chunks"), st.integers(1, 3).map(float)) if stream else st.none(),
        )
    )
    return RequestSpec(
        chat=draw(st.booleans()),
        stream=stream,
        include_usage=draw(st.sampled_from([None, False, True])) if stream else None,
        n=draw(st.sampled_from([1, 1, 2])),
        long=draw(st.booleans()),
        max_tokens=draw(st.sampled_from([None, 1, 2, 3, 5])),
        disconnect=disconnect,
    )


@dataclass(frozen=True)
class Scenario:
    mixed: tuple[WorkerSpec, ...]
    pd: tuple[WorkerSpec, WorkerSpec] | None
    requests: tuple[RequestSpec, ...]
    max_retries: int
    first_token_timeout_s: float
    total_timeout_s: float
    policy: str | None
    # None, or (seconds after the batch starts, grace): `Gateway.begin_shutdown(grace)` (SIGTERM)
    shutdown: tuple[float, float] | None = None


scenarios = st.builds(
    Scenario,
    mixed=st.lists(worker_specs, min_size=1, max_size=3).map(tuple),
    pd=st.one_of(st.none(), st.tuples(worker_specs, worker_specs)),
    requests=st.lists(request_specs(), min_size=1, max_size=8).map(tuple),
    max_retries=st.integers(0, 2),
    first_token_timeout_s=st.sampled_from([0.15, 0.3]),
    total_timeout_s=st.sampled_from([0.15, 0.4]),
    policy=st.sampled_from([None, "round-robin"]),
    shutdown=st.one_of(
        st.none(),
        st.none(),
        st.none(),
        st.tuples(st.sampled_from([0.0, 0.01, 0.05, 0.1]), st.sampled_from([0.0, 0.05, 0.2])),
    ),
)


# ---------------------------------------------------------------------------------------- ASGI client
@dataclass
class Answer:
    rid: str
    spec: RequestSpec
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    pieces: list[bytes] = field(default_factory=list)
    complete: bool = False  # the response's last body message was sent
    disconnected: bool = False  # the client hung up before the response was complete
    sends_after_end: int = 0
    raised: BaseException | None = None

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)

    @property
    def is_stream(self) -> bool:
        return self.status == 200 and self.headers.get("content-type", "").startswith("text/event-stream")


async def call(app: Any, path: str, body: bytes, answer: Answer) -> Answer:
    """One request through the app's ASGI interface, as a server would drive it; the client may hang up
    `before` its answer begins (seconds after arrival) or after some stream pieces (`chunks`)."""
    hangup = asyncio.Event()
    body_sent = False
    loop = asyncio.get_running_loop()
    how = answer.spec.disconnect

    def hang_up() -> None:
        if not answer.complete:
            answer.disconnected = True
        hangup.set()

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await hangup.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if answer.complete:
            answer.sends_after_end += 1
            return
        if message["type"] == "http.response.start":
            assert answer.status is None, "two response starts"
            answer.status = message["status"]
            answer.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
            return
        assert message["type"] == "http.response.body"
        if message.get("body"):
            answer.pieces.append(message["body"])
        if not message.get("more_body", False):
            answer.complete = True
            hangup.set()  # as a server does once the response is done
        elif how is not None and how[0] == "chunks" and len(answer.pieces) >= how[1]:
            hang_up()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("gw", 80),
        "client": ("127.0.0.1", 123),
        "headers": [
            (b"host", b"gw"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", answer.rid.encode()),
        ],
    }
    timer = loop.call_later(how[1], hang_up) if how is not None and how[0] == "before" else None
    try:
        await app(scope, receive, send)
    except Exception as exc:  # the app must answer its own errors
        answer.raised = exc
    finally:
        if timer is not None:
            timer.cancel()
        hangup.set()
    return answer


# ------------------------------------------------------------------------------------------- gateway
@dataclass
class Spy:
    finishes: list[tuple[str, int, str]] = field(default_factory=list)  # (request id, status, outcome)
    attempts: Counter[str] = field(default_factory=Counter)  # dispatches per request id
    dispatched: dict[str, list[str]] = field(
        default_factory=dict
    )  # request id → its decode workers, in order
    # (worker id, kind, request id or None) told to a breaker, from the request's task when it was one
    blamed: list[tuple[str, str, str | None]] = field(default_factory=list)
    tasks: dict[asyncio.Task[Any], str] = field(default_factory=dict)  # a request's task → its id


@asynccontextmanager
async def chaos_gateway(cfg: Any, fleet: FakeFleet) -> AsyncIterator[tuple[Any, Gateway, Spy]]:
    """The app with its lifespan, the dispatcher's `finish` and `_attempt` spied on; on exit the checks of
    `tests.gateway.test_faults.gateway` (in-flight tickets and KV reservations back to zero, no double
    release) — after the batch, and again after shutdown."""
    app = create_app(cfg, transport=fleet.transport)
    gw: Gateway = app.state.gateway
    spy = Spy()
    install_spies(gw, spy)
    async with app.router.lifespan_context(app):
        yield app, gw, spy
        assert_released(gw, "after the batch")
    assert_released(gw, "after shutdown")


def install_spies(gw: Gateway, spy: Spy) -> None:
    """Record into `spy` the dispatcher's outcomes (`finish`), its attempts (`_attempt`) and what the
    registry's breakers are told (`report_failure`, with the request whose task told it), each call passed on."""
    d = gw.dispatcher
    finish, attempt, report_failure = d.finish, d._attempt, gw.registry.report_failure

    def spy_finish(rec: Any, status: int, outcome: Any, usage: Any = None, reason: str | None = None) -> None:
        if not rec.finished:
            name = outcome.value if outcome is not None else f"rejected_{reason or status}"
            spy.finishes.append((rec.request_id, status, name))
        finish(rec, status, outcome, usage, reason)

    async def spy_attempt(decision: Any, parsed: Any, path: str, rec: Any, lease: Any) -> Any:
        spy.attempts[rec.request_id] += 1
        spy.tasks[rec.task] = rec.request_id
        spy.dispatched.setdefault(rec.request_id, []).append(decision.decode.id)
        return await attempt(decision, parsed, path, rec, lease)

    def spy_report_failure(worker_id: str, kind: str, hard: bool = False) -> None:
        task = asyncio.current_task()
        spy.blamed.append((worker_id, kind, spy.tasks.get(task) if task is not None else None))
        report_failure(worker_id, kind, hard)

    gw.registry.report_failure = spy_report_failure  # type: ignore[method-assign]
    d.finish = spy_finish  # type: ignore[method-assign]
    d._attempt = spy_attempt  # type: ignore[method-assign]


def assert_released(gw: Gateway, when: str) -> None:
    held = {
        r.id: (r.inflight_requests, r.inflight_prefill_tokens)
        for r in gw.registry.records()
        if r.inflight_requests or r.inflight_prefill_tokens
    }
    assert not held, f"in-flight tickets left {when}: {held}"
    assert gw.ledger is not None
    kv = {w: row for w, row in gw.ledger.snapshot().items() if row["reserved_units"] or row["active"]}
    assert not kv, f"KV reservations left {when}: {kv}"
    assert gw.ledger.stats.double_releases == 0, f"KV double releases {when}"
    assert not gw.dispatcher.open, f"requests still open {when}: {list(gw.dispatcher.open.values())}"


def metric_total(gw: Gateway, name: str) -> float:
    return sum(s.value for m in gw.metrics.registry.collect() for s in m.samples if s.name == name)


def build(scenario: Scenario) -> tuple[Any, FakeFleet, list[tuple[ChaosWorker, WorkerSpec]]]:
    mixed = [spec.build(f"m{i}") for i, spec in enumerate(scenario.mixed)]
    faults = list(zip(mixed, scenario.mixed, strict=True))
    pools = [pool("p", "L4", "mixed", *mixed)]
    workers = list(mixed)
    if scenario.pd is not None:
        pre, dec = scenario.pd[0].build("pre"), scenario.pd[1].build("dec")
        faults += [(pre, scenario.pd[0]), (dec, scenario.pd[1])]
        pools += [pool("prefill", "H100", "prefill", pre), pool("decode", "A100", "decode", dec)]
        workers += [pre, dec]
    limits = {
        "max_retries": scenario.max_retries,
        "first_token_timeout_s": scenario.first_token_timeout_s,
        "total_timeout_s": scenario.total_timeout_s,
        "stall_timeout_s": 0.3,
        "connect_timeout_s": 0.2,
        "queue_deadline_s": 0.2,
    }
    extra: dict[str, Any] = {"limits": limits}
    if scenario.policy is not None:
        extra["routing"] = {"policy": scenario.policy}
    return config(*pools, **extra), FakeFleet(*workers), faults


# ----------------------------------------------------------------------------------------- invariants
ERROR_KEYS = {"message", "type", "param", "code"}


def is_openai_error(payload: Any) -> bool:
    return (
        isinstance(payload, dict)
        and set(payload) == {"error"}
        and isinstance(payload["error"], dict)
        and set(payload["error"]) >= ERROR_KEYS
        and isinstance(payload["error"]["message"], str)
    )


def stream_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


def check_stream(a: Answer) -> bool:
    """Invariant 1 for a stream; returns whether it completed cleanly ([DONE], no error event, no abort)."""
    raw = a.body
    assert raw.endswith(b"data: [DONE]\n\n"), f"{a.rid}: stream does not end with [DONE]: {raw[-200:]!r}"
    events = stream_events(raw)
    dones = [e for e in events if e.strip() in (b"data: [DONE]", b"data:[DONE]")]
    assert len(dones) == 1, f"{a.rid}: {len(dones)} [DONE] events: {raw!r}"
    clean = True
    finished = False  # some event carried a finish_reason: without one the stream was cut (vLLM's SIGTERM)
    usage_events = 0
    for e in events[:-1]:
        assert e.startswith(b"data:"), f"{a.rid}: not an SSE data event: {e!r}"
        try:
            payload = json.loads(e[5:])
        except ValueError:
            raise AssertionError(f"{a.rid}: an event that is not JSON: {e!r} in {raw!r}") from None
        if "error" in payload:
            assert is_openai_error(payload), f"{a.rid}: error event not in OpenAI's shape: {e!r}"
            clean = False
        elif any(c.get("finish_reason") == "abort" for c in payload.get("choices") or []):
            clean = False
        finished = finished or any(c.get("finish_reason") for c in payload.get("choices") or [])
        usage_events += "usage" in payload
    # the usage event the gateway asks for is stripped unless the client asked for it (the fakes send one)
    if not a.spec.include_usage:
        assert usage_events == 0, f"{a.rid}: a usage event the client did not ask for: {raw!r}"
    elif clean:
        assert usage_events == 1, f"{a.rid}: {usage_events} usage events, asked for one: {raw!r}"
    return clean and finished


def check_whole(a: Answer) -> bool:
    """Invariant 1 for a whole answer; returns whether it completed (200 without an abort)."""
    try:
        payload = json.loads(a.body)
    except ValueError:
        raise AssertionError(f"{a.rid}: {a.status} answer is not JSON: {a.body[:300]!r}") from None
    if a.status == 200:
        assert isinstance(payload.get("choices"), list) and payload["choices"], f"{a.rid}: {payload}"
        assert payload.get("object") in ("chat.completion", "text_completion"), f"{a.rid}: {payload}"
        return all(c.get("finish_reason") != "abort" for c in payload["choices"])
    assert a.status is not None and 400 <= a.status < 600, f"{a.rid}: status {a.status}"
    assert is_openai_error(payload), f"{a.rid}: {a.status} body not OpenAI's error shape: {payload}"
    return False


def placed(
    faults: list[tuple[ChaosWorker, WorkerSpec]], scenario: Scenario
) -> list[tuple[ChaosWorker, WorkerSpec, str]]:
    pools = ["p"] * len(scenario.mixed) + (["prefill", "decode"] if scenario.pd else [])
    return [(w, spec, p) for (w, spec), p in zip(faults, pools, strict=True)]


async def run_scenario(scenario: Scenario) -> None:
    cfg, fleet, faults = build(scenario)
    async with chaos_gateway(cfg, fleet) as (app, gw, spy):
        for worker, spec in faults:  # the faults start after the startup health checks
            worker.mode = spec.mode
        answers = [Answer(f"req-{i}", spec) for i, spec in enumerate(scenario.requests)]
        calls = [
            call(app, "/v1/chat/completions" if a.spec.chat else "/v1/completions", a.spec.body(i), a)
            for i, a in enumerate(answers)
        ]
        if scenario.shutdown is not None:
            delay, grace = scenario.shutdown
            asyncio.get_running_loop().call_later(delay, gw.begin_shutdown, grace)
        try:
            await asyncio.wait_for(asyncio.gather(*calls), BATCH_BOUND_S)  # invariant 4
        except TimeoutError:
            pending = [a.rid for a in answers if not a.complete and not a.disconnected]
            raise AssertionError(f"batch hung past {BATCH_BOUND_S} s; unanswered: {pending}") from None

        by_rid: dict[str, list[tuple[int, str]]] = {}
        for rid, status, outcome in spy.finishes:
            by_rid.setdefault(rid, []).append((status, outcome))
        for a in answers:
            assert a.raised is None, f"{a.rid}: the app raised {a.raised!r}"
            assert a.sends_after_end == 0, f"{a.rid}: {a.sends_after_end} sends after the response ended"
            # invariant 2: exactly one terminal outcome per request
            ends = by_rid.get(a.rid, [])
            assert len(ends) == 1, f"{a.rid}: terminal outcomes {ends}"
            status, outcome = ends[0]
            if a.disconnected:
                # nobody reads this answer (unless the gateway finished it before it noticed): a completion
                # must still have been whole
                if outcome == "completed":
                    assert a.complete, f"{a.rid}: a hung-up, unfinished answer counted completed"
                    assert check_stream(a) if a.is_stream else check_whole(a), (
                        f"{a.rid}: completed? {a.body!r}"
                    )
                continue
            # invariant 1: the answer is well formed
            assert a.complete and a.status is not None, f"{a.rid}: no complete response"
            assert a.status != 499, f"{a.rid}: 499 for a client still there"
            assert a.headers.get("x-request-id") == a.rid, f"{a.rid}: x-request-id {a.headers}"
            if not a.is_stream:
                # a worker's busy/unavailable answer passed through keeps its Retry-After (a 4xx refusal or a
                # 500 is passed through as a refusal or failure, where Retry-After has no meaning)
                for w, spec in faults:
                    if (
                        a.status in (429, 502, 503, 504)
                        and a.body.find(f'"worker {w.name} says '.encode()) >= 0
                    ):
                        assert a.headers.get("retry-after") == spec.retry_after, f"{a.rid}: {a.headers}"
                length = a.headers.get("content-length")
                assert length == str(len(a.body)), f"{a.rid}: content-length {length}, body {len(a.body)}"
            clean = check_stream(a) if a.is_stream else check_whole(a)
            # invariant 2: completed exactly for the answers that completed
            if outcome == "completed":
                assert clean, (
                    f"{a.rid}: counted completed, but the answer did not complete: {a.body[-300:]!r}"
                )
            else:
                assert not clean, f"{a.rid}: the answer completed, but its outcome is {outcome}"
            if not a.is_stream:
                assert status == a.status, f"{a.rid}: answered {a.status}, recorded {status}"
        if currently_in_test_context():
            for _, _, outcome in spy.finishes:
                event(f"outcome {outcome}")
            if any(n > 1 for n in spy.attempts.values()):
                event("retried")
        assert len(spy.finishes) == len(answers), f"outcomes for unknown requests: {spy.finishes}"
        total = metric_total(gw, "mosaic_request_outcomes_total")
        assert total == len(answers), f"{total} outcomes counted for {len(answers)} requests"
        total = metric_total(gw, "mosaic_requests_total")
        assert total == len(answers), f"{total} requests counted, {len(answers)} sent"
        # invariant 5: retries bounded per request, and counted once per re-dispatch
        for rid, n in spy.attempts.items():
            assert n <= 1 + scenario.max_retries, (
                f"{rid}: dispatched {n} times (max_retries {scenario.max_retries})"
            )
        # a worker that serves well, or only refuses requests, is never charged (a 429 is busy, not broken)
        ids = {f"{p}/{w.name}:8000": spec for w, spec, p in placed(faults, scenario)}
        streams = {a.rid for a in answers if a.spec.stream}
        wrongly = [
            (w, kind, rid)
            for w, kind, rid in spy.blamed
            # a stream's first event past first_token_timeout_s is charged, as documented, even to a healthy
            # worker whose answer the loaded event loop delayed
            if ids[w].blameless() and not (kind == "timeout" and rid in streams)
        ]
        assert not wrongly, f"breaker told of failures of a blameless worker: {wrongly}"
        # no retry after an answer that is not retried (4xx, 500); only whole answers or streams that can get
        # that answer count (a stream request to a `status` worker gets the status too)
        for rid, workers in spy.dispatched.items():
            for w in workers[:-1]:
                assert not ids[w].final(), f"{rid}: retried after {w} ({ids[w]}) answered: {workers}"
        redispatches = sum(n - 1 for n in spy.attempts.values())
        retries = metric_total(gw, "mosaic_retries_total")
        assert retries == redispatches, f"mosaic_retries_total {retries}, re-dispatches {redispatches}"


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios)
def test_every_request_ends_once_and_well_formed_under_faults(scenario: Scenario) -> None:
    asyncio.run(run_scenario(scenario))
