"""The request path after parsing: route → (admission wait) → proxy one or two hops → relay, with retries.

Per request:

1. `RouteRequest` from the parsed body; `Router.route(req, registry.view(), now, rng, exclude)` through
   the admission queue (waits when every worker is busy; 429/503 when it gives up).
2. A `Lease` holds the decision's reservations and in-flight tickets until the request ends.
3. P/D decision: the prefill hop (non-streaming copy, `max_tokens=1`, `kv_transfer_params.do_remote_decode`);
   its answer's `kv_transfer_params` go into the decode hop once checked (`server.prefill_hop`). If the
   prefill hop fails in any way, the decode worker serves the request alone (decode-only fallback;
   `mosaic_pd_fallbacks_total{reason}`).
4. Decode (or mixed) hop. Until its first byte is relayed, a connect error, timeout, protocol error or
   a 429/502/503/504 is an `UpstreamFailure`: the lease is released as failed_before_first_byte, the
   worker reported (breaker), and the request routed again excluding it, while attempts ≤ `max_retries`
   and the time since arrival ≤ `retry_budget_s`. A retry does not queue: when no other worker can take
   it at once, the request ends with the failure it has. Out of retries: the worker's own error body passes
   through unchanged if it answered, else 502 (or 504 for timeouts) in OpenAI's shape.
5. Streams are relayed byte for byte (`SseRelay`); after the first byte a failure ends the stream with
   an OpenAI error event and `data: [DONE]`. Non-streaming answers are returned whole.

Timeouts: `first_token_timeout_s` bounds dispatch → first byte of a stream (prefill hop included);
`total_timeout_s` bounds a whole non-streaming request (its headers come only when generation ends, so
the wait for them gets that budget; when it runs out the request ends `timed_out`, with no retry, and the
worker's breaker is told only if its token counters stood still meanwhile) and is checked between
stream chunks; `stall_timeout_s` (the client's read
timeout) bounds every gap between a stream's chunks and the read of a body once its headers came.

Client disconnects: while waiting for the first byte, a `DisconnectWatch` cancels the work (the upstream
connection is closed, which aborts the request in vLLM) — pushed by `server.fast_http`'s cycle at once,
else from a watcher on the ASGI `receive` channel started 50 ms after arrival; once streaming,
`RelayResponse`'s watch cancels the relay, which closes the upstream response.

Every accepted request ends in exactly one terminal outcome (`RequestRecord.finish` runs once), and every
lease is released exactly once with its own outcome.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive

from scheduler.length_predictor import LengthPredictor
from scheduler.routing.framework import Decision, Router, RouteRequest
from scheduler.routing.reasons import Outcome, Reject
from scheduler.routing.scorers import estimated_ttft_s
from server.admission import AdmissionQueue
from server.auth import RateLimiter
from server.config import ConfigError, MosaicConfig
from server.deadlines import TaskTimeouts
from server.errors import (
    NOT_JSON,
    STREAM_DONE,
    Cause,
    GatewayError,
    is_client_error_event,
    is_error_event,
    response_not_found,
    shutting_down,
)
from server.failure import (
    DisconnectWatch,
    GatewayOutcome,
    Lease,
    RelayResponse,
    UpstreamFailure,
    classify,
)
from server.footprint import ParsedRequest, route_request, with_context
from server.h1_response import AnswerTooLarge, H1Response, read_at_most
from server.metrics import GatewayMetrics
from server.prefill_hop import (
    MAX_ANSWER_BYTES,
    PREFILL_BUILT_NOTHING,
    REQUEST_FAULTS,
    WARN_EVERY_S,
    WARNED,
    Fallback,
    LogThrottle,
    PrefillRefusal,
    kv_params_fault,
)
from server.proxy import (
    RETRYABLE_STATUSES,
    Upstream,
    decode_body,
    pinned_headers,
    prefill_body,
    response_usage,
    upstream_headers,
    usage_body,
    usage_count,
)
from server.registry import Registry
from server.response_store import ResponseAffinity
from server.responses import PassthroughResponse, StreamSession, relay_headers
from server.responses_api import (
    BACKGROUND_STATUSES,
    SERVED_STATUSES,
    ResponsesStreamSession,
    context_tokens,
    responses_usage,
)
from server.upstream import SlotWait, UpstreamResponse

UNLISTED_ADAPTER = "(unlisted)"  # the `adapter` label of requests naming an adapter no worker lists

log = logging.getLogger("mosaic.dispatch")


# finish()'s metric children: requests, outcomes, rejections (None without a reason), e2e (None unless
# completed), prompt tokens, generation tokens
_OutcomeChildren = tuple[Any, Any, Any, Any, Any, Any]

CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request": recorded, never sent
# Outcomes of a stream (status 200) that ended in the worker's error event before any token: every worker
# failed it, or the worker refused it (4xx). Refunded in full like the same failures answered as an error
# status; any other stream without usage keeps its whole token debit (it may have generated up to it).
_NOTHING_GENERATED = frozenset({Outcome.FAILED_BEFORE_FIRST_BYTE, Outcome.WORKER_REJECTED})
# A time-out this close to the end of a request's total_timeout_s is that budget's (timers fire at or after it)
BUDGET_SLACK_S = 0.01
WATCH_AFTER_S = 0.05  # requests answered faster than this never start a disconnect watcher


@dataclass(slots=True)
class RequestRecord:
    """Bookkeeping of one accepted request; `Dispatcher.finish` closes it exactly once."""

    request_id: str
    model: str
    key: str
    arrival: float
    reserved_tokens: int  # debited from the key's token bucket (at most a full bucket; 0 without a limit)
    pool: str = "none"
    finished: bool = False
    first_byte_at: float | None = None
    task: asyncio.Task[Any] | None = None  # the task serving it (set by `Dispatcher.handle`)
    # the LoRA adapter it names (`model` is its base model), as its metrics label it: decided when the request
    # is accepted (`Dispatcher.adapter_label`), so one still running when its adapter is unloaded is still
    # booked under its name (chargeback), not `(unlisted)`
    adapter: str | None = None


def worker_auth_headers(config: MosaicConfig) -> dict[str, tuple[bytes, bytes]]:
    """Pool → the `Authorization` header its workers expect (`pools[].api_key_env`), read once at start.

    A named variable that is unset or empty is a config error: every request to that pool would get 401."""
    out: dict[str, tuple[bytes, bytes]] = {}
    for pool in config.pools:
        if pool.api_key_env is None:
            continue
        key = os.environ.get(pool.api_key_env, "").strip()
        if not key:
            raise ConfigError(
                f"pools[{pool.name}].api_key_env: environment variable {pool.api_key_env} is unset or empty"
            )
        out[pool.name] = (b"authorization", b"Bearer " + key.encode("latin-1"))
    return out


class Dispatcher:
    def __init__(
        self,
        config: MosaicConfig,
        registry: Registry,
        router: Router,
        admission: AdmissionQueue[Decision],
        upstream: Upstream,
        metrics: GatewayMetrics,
        limiter: RateLimiter,
        clock: Callable[[], float] = time.monotonic,
        predictor: LengthPredictor | None = None,
        max_model_len: Mapping[str, int] | None = None,
    ) -> None:
        self.cfg = config
        self._max_model_len = max_model_len  # model → context (a continuation's default output)
        self.limits = config.limits
        self.registry = registry
        self.router = router
        self.admission = admission
        self.upstream = upstream
        self.metrics = metrics
        self.limiter = limiter
        self.clock = clock
        self.predictor = predictor
        shortest = min(self.limits.first_token_timeout_s / 2, self.limits.total_timeout_s)
        self.timeouts = TaskTimeouts(period=min(1.0, shortest / 8))  # no timer handle per request
        self.rng = random.Random(config.routing.seed)
        self.outcomes: dict[str, int] = {}  # terminal outcomes by name (tests and /admin read it)
        self.open: dict[int, RequestRecord] = {}  # id → a request `handle` took and `finish` has not closed
        # tasks `stop_requests` cancelled for shutdown (weak: a finished one is not kept)
        self._stopped: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        self.draining = False  # shutting down (`Gateway.draining`): a request reaching `handle` gets 503
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._finish_children: dict[tuple[str, str, int, str, str | None], _OutcomeChildren] = {}
        self.worker_auth = worker_auth_headers(config)
        self._tickets = itertools.count(1)  # RouteRequest.ticket: what the KV holds of a request belong to
        self._pd_warnings = LogThrottle(WARN_EVERY_S, clock)  # (prefill worker, reason) → its last warning
        # Responses the gateway served → their worker (`previous_response_id`, GET and cancel go there)
        self.affinity = ResponseAffinity(
            config.responses.affinity_max_entries, config.responses.affinity_ttl_s
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, memoised: prometheus_client's `labels()` validates and takes a lock on
        every call, and the hot path asks for the same few label sets on every request."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    # ------------------------------------------------------------------ entry
    async def handle(
        self, parsed: ParsedRequest, path: str, rec: RequestRecord, receive: Receive
    ) -> Response:
        """Serve one parsed request; returns the response (errors included). Never raises GatewayError.

        Runs in the caller's task. A `DisconnectWatch` cancels it if the client goes away before the
        response starts (started only after `WATCH_AFTER_S`, so fast requests create no extra task)."""
        task = rec.task = asyncio.current_task()
        assert task is not None
        if self.draining:  # its body was still arriving when the shutdown began: sent nowhere, so refuse
            return self._shut_out(rec)
        self.open[id(rec)] = rec
        watch = DisconnectWatch(receive, task)
        watch.arm(WATCH_AFTER_S)
        try:
            return await self._serve(parsed, path, rec)
        except asyncio.CancelledError:
            if watch.disconnected:
                task.uncancel()
                self.finish(rec, CLIENT_CLOSED_STATUS, Outcome.CLIENT_DISCONNECTED)
                return Response(status_code=CLIENT_CLOSED_STATUS)
            if task not in self._stopped:
                # uvicorn's own cancel at the end of its graceful shutdown: not ours to swallow (it answers
                # 500), but the request still ends in one recorded outcome
                self.finish(rec, 500, GatewayOutcome.SHUT_DOWN)
                raise
            task.uncancel()  # ended for shutdown before its response began: 503, as a new request gets
            return self._shut_out(rec)
        except GatewayError as exc:
            self.finish(rec, exc.status, None, reason=exc.reason)
            return exc.to_response(rec.request_id)
        except Exception as exc:
            log.error("request %s failed: %r", rec.request_id, exc, exc_info=exc)
            self.finish(rec, 500, GatewayOutcome.INTERNAL_ERROR)
            return GatewayError(Cause.INTERNAL, "Internal gateway error").to_response(rec.request_id)
        finally:
            watch.done = True  # from here on a disconnect must not cancel this task
            watch.stop()

    def adapter_label(self, adapter: str | None) -> str | None:
        """The metrics label of a request naming `adapter`: a name no worker lists now (a model's
        `lora_resolver` sends any name on) is one label, not one each, as clients choose those names."""
        if adapter is None or adapter in self.registry.adapter_models():
            return adapter
        return UNLISTED_ADAPTER

    def finish(
        self,
        rec: RequestRecord,
        status: int,
        outcome: Outcome | GatewayOutcome | None,
        usage: dict[str, Any] | None = None,
        reason: str | None = None,
    ) -> None:
        """Record the request's single terminal outcome (no-op if already finished)."""
        if rec.finished:
            return
        rec.finished = True
        self.open.pop(id(rec), None)
        name = outcome.value if outcome is not None else f"rejected_{reason or status}"
        key = (rec.model, rec.pool, status, name, reason)
        children = self._finish_children.get(key)
        if children is None:
            children = self._finish_children[key] = self._outcome_children(*key)
        requests, outcomes, rejections, e2e, prompt_tokens, generation_tokens = children
        requests.inc()
        self.outcomes[name] = self.outcomes.get(name, 0) + 1
        outcomes.inc()
        if rejections is not None:
            rejections.inc()
        now = self.clock()
        if e2e is not None:
            e2e.observe(now - rec.arrival)
        used = 0
        adapter = rec.adapter
        if adapter is not None:
            self.metrics.lora_requests.labels(rec.model, adapter, str(status)).inc()
        if usage:  # the worker's numbers: anything but a count ≥ 0 counts as 0 (a counter cannot go down)
            prompt = usage_count(usage.get("prompt_tokens"))
            gen = usage_count(usage.get("completion_tokens"))
            prompt_tokens.inc(prompt)
            generation_tokens.inc(gen)
            if adapter is not None:
                self.metrics.lora_tokens.labels(rec.model, adapter, "prompt").inc(prompt)
                self.metrics.lora_tokens.labels(rec.model, adapter, "generation").inc(gen)
            used = prompt + gen
            if outcome is Outcome.COMPLETED and self.predictor is not None:
                self.predictor.observe(
                    rec.model, prompt, gen
                )  # output lengths for `predicted` KV reservations
        elif status == 200 and outcome not in _NOTHING_GENERATED:
            used = rec.reserved_tokens  # no usage reported: keep the whole debit
        self.limiter.settle(rec.key, rec.reserved_tokens, used, now)

    def _outcome_children(
        self, model: str, pool: str, status: int, name: str, reason: str | None
    ) -> _OutcomeChildren:
        """The metric children `finish` updates for one (model, pool, status, outcome, reason): looked up
        once per combination instead of six memo lookups per request."""
        m, child = self.metrics, self.child
        return (
            child(m.requests, model, pool, str(status)),
            child(m.outcomes, model, name),
            child(m.rejections, reason) if reason is not None else None,
            # completed requests only: a stream cut short (worker error, time-out, hang-up) also had status
            # 200, and its truncated time skewed the latency histogram low
            child(m.e2e, model, pool) if name == Outcome.COMPLETED.value else None,
            child(m.prompt_tokens, model),
            child(m.generation_tokens, model),
        )

    # ------------------------------------------------------------------ shutdown
    def stop_requests(self, queued_only: bool = False) -> int:
        """End open requests for shutdown (`Gateway.begin_shutdown`): each one's task is cancelled and
        answers 503 (before its response began) or ends its stream with an error event and `[DONE]`
        (`RelayResponse`), its outcome recorded. `queued_only`: only those still waiting for admission,
        sent nowhere yet. From the first call on, a request reaching `handle` gets 503. Returns how many
        were stopped."""
        self.draining = True
        stopped = 0
        for rec in list(self.open.values()):
            task = rec.task
            if task is None or task.done() or (queued_only and rec.pool != "none"):
                continue
            if queued_only and task in self._stopped:
                continue
            # the last pass cancels every open request again: a cancel can be lost on its way (a 3.11
            # `asyncio.wait_for` whose inner future completed in the same turn returns instead of raising)
            self._stopped.add(task)
            task.cancel()
            stopped += 1
        return stopped

    def _shut_out(self, rec: RequestRecord) -> Response:
        err = shutting_down()
        self.finish(rec, err.status, None, reason=err.reason)
        return err.to_response(rec.request_id)

    def stopped(self, task: asyncio.Task[Any]) -> bool:
        """`task` was ended by `stop_requests` (its cancellation is the gateway's shutdown, not a client's)."""
        return task in self._stopped

    # ------------------------------------------------------------------ routing + retries
    def _route(self, rreq: RouteRequest, exclude: set[str]) -> Decision | Reject:
        return self.router.route(rreq, self.registry.view(), self.clock(), self.rng, frozenset(exclude))

    async def _serve(self, parsed: ParsedRequest, path: str, rec: RequestRecord) -> Response:
        pinned = None if parsed.previous_response_id is None else self._continuation(parsed)
        rreq = route_request(
            parsed,
            rec.request_id,
            rec.arrival,
            self.cfg.routing.default_output_tokens,
            predictor=self.predictor,
            ticket=next(self._tickets),
            pinned_worker=pinned,
        )
        exclude: set[str] = set()
        last: UpstreamFailure | None = None
        attempt = 0
        while True:
            if last is None:  # first dispatch: may wait in the admission queue
                decision = await self.admission.admit(parsed.model, lambda: self._route(rreq, exclude), rreq)
            else:  # a retry was admitted already: another worker now, or give up with the real failure
                routed = self._route(rreq, exclude)
                if isinstance(routed, Reject):
                    return self._give_up(rec, last, "no other worker can take it")
                decision = routed
                self.metrics.retries.labels(parsed.model, last.kind).inc()  # counted once it is dispatched
                log.info("request %s: retrying after %s", rec.request_id, last)
            rec.pool = decision.decode.pool
            lease = Lease(decision, rreq, self.registry, self.router, self.admission.notify, self.clock)
            try:
                return await self._attempt(decision, parsed, path, rec, lease)
            except UpstreamFailure as failure:
                if failure.budget_spent:  # its own total_timeout_s ran out: no worker to blame, no time left
                    # the gateway hung up on the decode worker serving it: a hang-up to the router, as a stream
                    # the gateway cuts (the worker built the prompt's KV; prefix affinity keeps it); one that
                    # never got there (spent in the queue, waiting for a connection, on the prefill hop) built
                    # nothing on it
                    served = failure.sent and failure.worker_id == decision.decode.id
                    served = served and failure.kind != "pool_timeout"
                    lease.release(Outcome.CLIENT_DISCONNECTED if served else Outcome.FAILED_BEFORE_FIRST_BYTE)
                    return self._timed_out(rec)
                lease.release(Outcome.FAILED_BEFORE_FIRST_BYTE)
                if failure.status == 429:  # busy, not broken: retried elsewhere, but no mark on its breaker
                    self.registry.report_success(failure.worker_id)
                elif failure.kind not in ("pool_timeout", "removed"):
                    self.registry.report_failure(failure.worker_id, failure.kind, failure.hard)
                exclude.add(failure.worker_id)
                last = failure
                attempt += 1
                why = self._no_retry(parsed, rec, attempt)
                if why is not None:
                    return self._give_up(rec, failure, why)
            except BaseException as exc:
                lease.release(
                    Outcome.CLIENT_DISCONNECTED
                    if isinstance(exc, asyncio.CancelledError)
                    else Outcome.WORKER_ERROR
                )
                raise

    def _continuation(self, parsed: ParsedRequest) -> str:
        """The worker a Responses continuation must go to: the one that served `previous_response_id` (vLLM
        stores a response in that server's memory). 404 in OpenAI's shape, as vLLM answers an id it does not
        store, when the gateway never served it, forgot it (`responses.affinity_*`), or its worker left the
        fleet (the stored response went with it). A worker still listed but unable to take the request now
        (draining, breaker open, KV full) gets the router's usual wait and refusal, as any request."""
        rid = parsed.previous_response_id
        assert rid is not None
        entry = self.affinity.lookup(rid, self.clock())
        if entry is not None and self.registry.get(entry.worker_id) is None:
            self.affinity.forget(rid)
            entry = None
        if entry is None:
            raise response_not_found(rid)
        if entry.model != parsed.model:  # its worker serves another model: no worker could continue it
            raise GatewayError(
                Cause.BAD_REQUEST,
                f"Response '{rid}' was generated by model '{entry.model}'; continue it with that model.",
                param="previous_response_id",
            )
        with_context(parsed, entry.context_tokens, self._max_model_len)
        return entry.worker_id

    def _timed_out(self, rec: RequestRecord) -> Response:
        """A whole (non-streaming) answer not there when `total_timeout_s` ran out: 504, outcome `timed_out`,
        as a stream the same limit ends (a long generation is not a broken worker; `_attempt` told the
        breaker already if the worker computed nothing meanwhile, `timeout_no_progress`)."""
        err = GatewayError(
            Cause.UPSTREAM_TIMEOUT,
            f"The request did not complete within the gateway's total timeout of "
            f"{self.limits.total_timeout_s:g} s.",
        )
        self.finish(rec, err.status, GatewayOutcome.TIMED_OUT)
        return err.to_response(rec.request_id)

    def _no_retry(self, parsed: ParsedRequest, rec: RequestRecord, attempt: int) -> str | None:
        """Why a request that failed before its first byte is not retried (None: it is), for its error."""
        limits, now = self.limits, self.clock()
        if attempt > limits.max_retries:
            return f"retries exhausted (limits.max_retries {limits.max_retries})"
        if now - rec.arrival > limits.retry_budget_s:
            # a stream's first-token time-out (60 s by default) always lands here: warned of at start-up
            return f"no retry after limits.retry_budget_s ({limits.retry_budget_s:g} s) from its arrival"
        if not parsed.stream and now >= rec.arrival + limits.total_timeout_s:
            # a whole answer has total_timeout_s from arrival, retries included: with nothing left, a retry
            # would only be sent to time out at once (and blamed on that worker)
            return "no time left within limits.total_timeout_s"
        return None

    def _give_up(self, rec: RequestRecord, failure: UpstreamFailure, why: str) -> Response:
        if failure.status is not None:  # the worker answered: its body passes through unchanged
            self.finish(rec, failure.status, Outcome.FAILED_BEFORE_FIRST_BYTE)
            return PassthroughResponse(
                failure.body, failure.status, rec.request_id, failure.content_type, failure.retry_after
            )
        cause = Cause.UPSTREAM_TIMEOUT if failure.is_timeout else Cause.UPSTREAM_UNAVAILABLE
        err = GatewayError(cause, f"Upstream worker failed before responding ({failure.kind}); {why}.")
        self.finish(rec, err.status, Outcome.FAILED_BEFORE_FIRST_BYTE)
        return err.to_response(rec.request_id)

    # ------------------------------------------------------------------ one attempt
    async def _attempt(
        self, decision: Decision, parsed: ParsedRequest, path: str, rec: RequestRecord, lease: Lease
    ) -> Response:
        headers = upstream_headers(rec.request_id)
        # a stream's first event within first_token_timeout_s of this dispatch; a whole answer within
        # total_timeout_s of arrival, whatever the queue and earlier attempts took (not afresh per attempt)
        if parsed.stream:
            timeout = self.limits.first_token_timeout_s
        else:
            timeout = rec.arrival + self.limits.total_timeout_s - self.clock()
            if timeout <= 0:  # spent waiting in the admission queue: sent nowhere, to time out at once
                raise UpstreamFailure(decision.decode.id, "timeout", budget_spent=True, sent=False)
        decode = decision.decode
        waiting_on = decode
        mark = None if parsed.stream else self._progress_mark(decode.id)
        slot = None  # the hop in flight's: still waiting for a connection when a time-out ended it
        try:
            with self.timeouts.timeout(timeout, rec.task):  # a plain `with`: nothing to await on entry
                params = None
                refused: PrefillRefusal | None = None
                if decision.prefill is not None:
                    waiting_on = decision.prefill  # whose hop a time-out now ends
                    pinned = pinned_headers(headers, decision.reservations, decision.prefill.id)
                    slot = SlotWait()
                    params = await self._prefill(decision, parsed, path, pinned, lease, timeout, slot)
                    if isinstance(params, PrefillRefusal):  # decode-only; judged once the decode hop answers
                        refused, params = params, None
                waiting_on, slot = decode, SlotWait()
                body = self._decode_body(parsed, params)
                lease.track(decode.id, parsed.prompt_tokens, prefilled_remotely=params is not None, slot=slot)
                if not parsed.stream:
                    # No first byte to see before the whole answer: prefill counts as over once its
                    # estimated TTFT has passed, not at the end. The prompt leaves this worker's prefill
                    # backlog (est-ttft, the P/D gate), and the KV reservations settle: the decode side
                    # drops its transient prefill chunk, and a P/D prefill worker's pages (pulled by the
                    # decode worker when it starts the request) are released instead of being held for
                    # the whole generation. An estimate, not a bound: a decode worker without a free slot
                    # pulls the KV later (docs/kv.md, "Limits").
                    eta = estimated_ttft_s(decode, lease.req)
                    if eta < self.limits.total_timeout_s:
                        self.registry.prefill_ends_in(lease, eta)
                # the headers wait gets the request's own budget, not the stall timeout: a non-streaming
                # answer's first byte comes only when generation ends
                auth = self.worker_auth.get(decode.pool)
                pinned = pinned_headers(headers, decision.reservations, decode.id)
                resp = await self.upstream.post(
                    decode.url, path, body, pinned if auth is None else [*pinned, auth], timeout, slot=slot
                )
                if refused is not None and resp.status_code < 400:
                    # the decode worker serves what the prefill pool refused: the pools are set up apart
                    # (flags, chat template, max_model_len), a misconfiguration the breaker cannot see
                    self._fall_back(parsed, lease, refused.worker_id, Fallback.REFUSED, refused.status)
                try:
                    if resp.status_code != 200 or not parsed.stream:
                        if isinstance(resp, H1Response):  # once the head came, the body may not stall
                            resp.bound_gaps(self.limits.stall_timeout_s)
                        content = await resp.aread()
                        await resp.aclose()
                        return self._whole(resp, content, decode.id, parsed, rec, lease)
                    chunks = resp.aiter_raw()
                    first = await anext(chunks, b"")
                    # Nothing is relayed before the first whole event: a worker that dies within it has sent
                    # the client nothing, so another worker may serve the request (a half event relayed
                    # would commit it). Bounded by the first-token timeout, as the first read.
                    while first and not _holds_an_event(first):
                        more = await anext(chunks, b"")
                        if not more:
                            break
                        first += more
                    if not _holds_an_event(first):
                        raise UpstreamFailure(decode.id, "protocol")  # closed before its first whole event
                    if _first_is_error(parsed, first):
                        # failed before its first token, nothing relayed yet: another worker may serve it;
                        # if none does, the client gets this worker's error event, as vLLM sent it
                        event = first.split(b"\n\n", 1)[0] + b"\n\n"
                        if parsed.kind != "responses":  # (a Responses stream has no [DONE])
                            event += STREAM_DONE
                        raise UpstreamFailure(
                            decode.id,
                            "stream_error",
                            status=200,
                            body=event,
                            content_type="text/event-stream",
                        )
                    if isinstance(resp, H1Response):  # (an injected test transport keeps one read timeout)
                        resp.bound_gaps(self.limits.stall_timeout_s)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await resp.aclose()
                    raise
        except (httpx.HTTPError, TimeoutError) as exc:
            kind, hard = classify(exc)
            # A whole answer's waits are bounded by what is left of its total_timeout_s: a time-out once that
            # is spent is the request's own limit (a long generation), not a stalled worker.
            spent = (
                not parsed.stream
                and kind == "timeout"
                and self.clock() >= rec.arrival + self.limits.total_timeout_s - BUDGET_SLACK_S
            )
            # The request's own time-out can fire during the prefill hop (both blocks expire in one sweep of
            # `TaskTimeouts`, every up to 1 s): that is the prefill worker's slowness, not the decode one's —
            # the hop's own bound (half the budget) had passed too, so it is told even when the budget is spent,
            # unless the hop was still waiting for a connection to it (the gateway's own limit, as in `_prefill`).
            if spent and waiting_on is not decode:
                if slot is None or not slot.waiting:
                    self.registry.report_failure(waiting_on.id, "prefill_timeout")
            elif waiting_on is decode and slot is not None and slot.waiting:
                # The request's own time-out ended the decode hop's wait for a connection slot before the
                # pool's `pool_timeout_s` did (a stream's first-token budget partly spent on the prefill hop,
                # or what was left of a whole answer's): the gateway's own `max_upstream_connections`, and the
                # worker never got the request. As an httpx.PoolTimeout: no mark; a stream is retried elsewhere,
                # a whole answer whose budget it was ends `timed_out`.
                kind, hard = "pool_timeout", False
            elif spent and self._made_no_progress(decode.id, mark):
                # a long generation is no fault, a worker that generated nothing since the request was sent is
                # hung (its /health may still answer): its breaker hears of it, as a stream's stall would tell
                self.registry.report_failure(decode.id, "timeout_no_progress")
            raise UpstreamFailure(waiting_on.id, kind, hard, budget_spent=spent) from None
        # not a success yet: a worker failing every stream midway sends first bytes too, and resetting its
        # breaker's whole count here kept it in rotation forever; the first byte excuses only the failures that
        # said it was unreachable, and the stream's end tells the rest (`StreamSession._close`)
        self.registry.report_first_byte(decode.id)
        lease.answered()  # prefill is over at the first token (`StreamSession._first_token`), not here: a
        # Responses stream's `response.created` comes before the engine has run
        return self._stream(resp, chunks, first, parsed, rec, lease)

    def _progress_mark(self, worker_id: str) -> tuple[float, float] | None:
        """(when, tokens): the worker's last scraped `vllm:generation_tokens_total` plus
        `vllm:prompt_tokens_total` (a pooling worker, embeddings, only ever moves the second), None when
        unknown."""
        rec = self.registry.get(worker_id)
        if rec is None or rec.stats is None or rec.stats_at is None:
            return None
        generated, prompts = rec.stats.generation_tokens_total, rec.stats.prompt_tokens_total
        if generated is None and prompts is None:
            return None
        return rec.stats_at, (generated or 0.0) + (prompts or 0.0)

    def _made_no_progress(self, worker_id: str, mark: tuple[float, float] | None) -> bool:
        """The worker's token counters, scraped since `mark` was taken, have not moved: it computed nothing
        for anyone while this request waited. False when there is no such later scrape."""
        now = self._progress_mark(worker_id)
        return mark is not None and now is not None and now[0] > mark[0] and now[1] <= mark[1]

    def _decode_body(self, parsed: ParsedRequest, params: dict[str, Any] | None) -> bytes:
        needs_usage = parsed.stream and not parsed.client_wants_usage
        if params is not None:
            return decode_body(parsed.data(), params, needs_usage)
        if needs_usage:
            return usage_body(parsed.body, parsed.data, parsed.has_stream_options)
        return parsed.body

    async def _prefill(
        self,
        decision: Decision,
        parsed: ParsedRequest,
        path: str,
        headers: list[tuple[bytes, bytes]],
        lease: Lease,
        left_s: float,
        slot: SlotWait,
    ) -> dict[str, Any] | PrefillRefusal | None:
        """The P/D prefill hop; its `kv_transfer_params`, or None (→ decode-only) on any failure, counted
        by reason and told to the prefill worker's breaker as `server.prefill_hop` tabulates. `slot` shows
        the caller whether the hop was still waiting for a connection when it ended. A 400 or 422 (vLLM's
        answer to an invalid request: a bad parameter, a prompt over the context) is a `PrefillRefusal`: the
        request goes decode-only too, and counts as the pool's `refused` fallback (a WARNING) only if the
        decode worker serves it — else the request was at fault, not the pool.

        Bounded by half the first-token budget, or half of `left_s` (what is left of the request's own
        budget) when less, so a slow prefill worker leaves the decode worker time to prefill the request
        itself, and a time-out during this hop is the prefill worker's, never charged to the decode one."""
        worker = decision.prefill
        assert worker is not None
        try:
            ticket = lease.track(worker.id, parsed.prompt_tokens, slot=slot)
        except UpstreamFailure:  # it left the fleet since routing: the decode worker prefills the request
            return self._fall_back(parsed, lease, worker.id, Fallback.REMOVED)
        try:
            budget = min(self.limits.first_token_timeout_s, left_s) / 2
            with self.timeouts.timeout(budget):
                auth = self.worker_auth.get(worker.pool)
                resp = await self.upstream.post(
                    worker.url,
                    path,
                    prefill_body(parsed.data()),
                    headers if auth is None else [*headers, auth],
                    budget,
                    slot=slot,
                )
                try:
                    content = await read_at_most(resp, MAX_ANSWER_BYTES)
                finally:
                    await resp.aclose()
            status = resp.status_code
            params = json.loads(content).get("kv_transfer_params") if status == 200 else None
        except (httpx.HTTPError, TimeoutError, *NOT_JSON, AttributeError, AnswerTooLarge) as exc:
            if slot.waiting:  # its bound ran out in the queue for a connection: the worker never saw it
                kind, hard = "pool_timeout", False
            elif isinstance(exc, httpx.HTTPError | TimeoutError):
                kind, hard = classify(exc)
            else:  # a body that is no JSON object, or too long to be a prefill's answer
                kind, hard = "bad_response", False
            if kind != "pool_timeout":  # the gateway's own connection limit: no mark, as on the decode hop
                self.registry.report_failure(worker.id, f"prefill_{kind}", hard)
            return self._fall_back(parsed, lease, worker.id, Fallback.of_failure(kind))
        finally:
            ticket.done()
        if status in REQUEST_FAULTS:
            self.registry.report_success(worker.id)  # it judged the request: healthy
            return PrefillRefusal(worker.id, status)
        if status != 200:
            if status >= 500:
                self.registry.report_failure(worker.id, f"status_{status}")
            elif status == 429:  # busy, not broken (as on the decode hop)
                self.registry.report_success(worker.id)
            return self._fall_back(parsed, lease, worker.id, Fallback.of_status(status), status)
        fault = kv_params_fault(params)
        if fault is Fallback.BAD_RESPONSE:  # it answered, but not a handover a decode worker can act on
            self.registry.report_failure(worker.id, "prefill_bad_response")
            return self._fall_back(parsed, lease, worker.id, fault)
        self.registry.report_success(worker.id)
        if fault is not None:
            return self._fall_back(parsed, lease, worker.id, fault)
        return params  # a dict: kv_params_fault checked it

    def _fall_back(
        self, parsed: ParsedRequest, lease: Lease, worker_id: str, reason: Fallback, status: int = 200
    ) -> None:
        """Count a decode-only fallback (the hop then returns None); a misconfigured prefill pool (`WARNED`)
        is a bounded WARNING. A hop that built nothing on the prefill worker says so to its routing plugins
        at the end (else prefix affinity kept sending the prompt's next requests to the worker that failed)."""
        self.child(self.metrics.pd_fallbacks, parsed.model, reason.value).inc()
        lease.prefill_outcome = PREFILL_BUILT_NOTHING.get(reason)
        rid = lease.req.request_id
        held = self._pd_warnings.due((worker_id, reason)) if reason in WARNED else None
        if held is None:
            log.info("request %s: prefill hop on %s failed (%s); decode-only", rid, worker_id, reason.value)
            return
        since = f" ({held} more since its last warning)" if held else ""
        if reason is Fallback.REFUSED:
            log.warning(
                "prefill worker %s refused the prefill hop with HTTP %d (request %s)%s: P/D requests it takes "
                "run decode-only. A 401/403 is a wrong api_key_env for its pool, a 404 a wrong model or path",
                worker_id,
                status,
                rid,
                since,
            )
        else:
            log.warning(
                "prefill worker %s answered without kv_transfer_params (request %s)%s: it has no KV connector "
                "(vLLM's --kv-transfer-config with kv_role kv_producer or kv_both), so P/D requests it takes "
                "run decode-only",
                worker_id,
                rid,
                since,
            )

    # ------------------------------------------------------------------ responses
    def _whole(
        self,
        resp: UpstreamResponse,
        content: bytes,
        worker_id: str,
        parsed: ParsedRequest,
        rec: RequestRecord,
        lease: Lease,
    ) -> Response:
        status = resp.status_code
        ctype = resp.headers.get("content-type", "application/json")
        if status in RETRYABLE_STATUSES:
            raise UpstreamFailure(
                worker_id,
                f"status_{status}",
                status=status,
                body=content,
                content_type=ctype,
                retry_after=resp.headers.get("retry-after"),
            )
        if status >= 500:
            self.registry.report_failure(worker_id, f"status_{status}")
            lease.release(Outcome.WORKER_ERROR)
            self.finish(rec, status, Outcome.WORKER_ERROR)
        elif status >= 400:  # the worker refused the request: healthy, but nothing was served
            return self._rejected(content, status, ctype, worker_id, rec, lease)
        elif status == 200 and parsed.kind == "responses":
            return self._whole_response(content, ctype, worker_id, rec, lease)
        elif status == 200 and parsed.kind == "embeddings" and _is_octet_stream(ctype):
            return self._whole_binary(content, ctype, resp.headers.get("metadata"), worker_id, rec, lease)
        elif status == 200 and content.find(b'"finish_reason":"abort"') >= 0:
            # the worker stopped it (vLLM stopping aborts what it runs): passed through, not a completion (its
            # cut length must not train the length predictor), no mark on the breaker (a stop is no fault)
            lease.release(Outcome.WORKER_ERROR)
            self.finish(rec, status, Outcome.WORKER_ERROR, response_usage(content))
        elif status == 200 and not _json_object(content, whole=_delimited_by_close(resp.headers)):
            # not an OpenAI answer (an HTML page from a proxy in front of the worker, a URL pointing at some
            # other server): nothing reached the client yet, so a protocol failure, retried elsewhere
            raise UpstreamFailure(worker_id, "not_json")
        else:
            self.registry.report_success(worker_id)
            lease.release(Outcome.COMPLETED)
            self.finish(rec, status, Outcome.COMPLETED, response_usage(content) if status == 200 else None)
        return PassthroughResponse(content, status, rec.request_id, ctype)

    def _whole_binary(
        self,
        content: bytes,
        ctype: str,
        metadata: str | None,
        worker_id: str,
        rec: RequestRecord,
        lease: Lease,
    ) -> Response:
        """vLLM's binary embeddings (`encoding_format` `bytes` or `bytes_only`): the vectors' bytes, no JSON,
        and for `bytes` a `metadata` header (JSON: each vector's byte range, the usage), passed on with them.
        A completion; metered from the header's usage, else the whole debit is kept (`bytes_only` has none)."""
        usage = None
        try:
            meta = json.loads(metadata) if metadata is not None else None
        except NOT_JSON:
            meta = None
        if isinstance(meta, dict) and isinstance(meta.get("usage"), dict):
            usage = meta["usage"]
        self.registry.report_success(worker_id)
        lease.release(Outcome.COMPLETED)
        self.finish(rec, 200, Outcome.COMPLETED, usage)
        return PassthroughResponse(content, 200, rec.request_id, ctype, metadata=metadata)

    def _rejected(
        self, content: bytes, status: int, ctype: str, worker_id: str, rec: RequestRecord, lease: Lease
    ) -> Response:
        """A worker's 4xx answer to the request, passed through: the worker is healthy, nothing was served."""
        self.registry.report_success(worker_id)
        lease.release(Outcome.WORKER_REJECTED)
        self.finish(rec, status, Outcome.WORKER_REJECTED)
        log.info("request %s: worker %s answered %d", rec.request_id, worker_id, status)
        return PassthroughResponse(content, status, rec.request_id, ctype)

    def _whole_response(
        self, content: bytes, ctype: str, worker_id: str, rec: RequestRecord, lease: Lease
    ) -> Response:
        """A whole Responses answer (status 200): the `response` object. Its id is remembered with the worker
        (stored-response affinity); `completed` and `incomplete` (stopped at max_output_tokens, as chat's
        finish_reason "length") are completions, `queued`/`in_progress` (`background: true`) `backgrounded`,
        `cancelled` and `failed` not (no breaker mark: vLLM answers
        a failed generation with a 5xx, so these are stops, not faults)."""
        try:
            payload = json.loads(content)
        except NOT_JSON:
            payload = None
        if not isinstance(payload, dict):  # as `_json_object`: not an answer, retried elsewhere
            raise UpstreamFailure(worker_id, "not_json")
        usage = responses_usage(payload.get("usage"))
        rid = payload.get("id")
        if isinstance(rid, str):
            self.affinity.remember(rid, worker_id, rec.model, context_tokens(usage), self.clock())
        self.registry.report_success(worker_id)
        status = payload.get("status")
        if status in BACKGROUND_STATUSES:  # `background: true`: the worker runs it on from here, unseen
            lease.release(Outcome.COMPLETED)  # to the router: dispatched and running there (prefix kept)
            self.finish(rec, 200, GatewayOutcome.BACKGROUNDED, usage)
        else:
            outcome = Outcome.COMPLETED if status in SERVED_STATUSES else Outcome.WORKER_ERROR
            lease.release(outcome)
            self.finish(rec, 200, outcome, usage)
        return PassthroughResponse(content, 200, rec.request_id, ctype)

    def _stream(
        self,
        resp: UpstreamResponse,
        chunks: AsyncIterator[bytes],
        first: bytes,
        parsed: ParsedRequest,
        rec: RequestRecord,
        lease: Lease,
    ) -> Response:
        responses = parsed.kind == "responses"
        session = (ResponsesStreamSession if responses else StreamSession)(
            self, resp, chunks, first, parsed, rec, lease
        )
        return RelayResponse(
            session.body(),
            session.close,
            relay_headers(rec.request_id, resp.headers.get("content-type", "text/event-stream")),
            push=session.push if session.can_push() else None,
            stopped=self.stopped,
            stall_s=self.limits.stall_timeout_s,
            shutdown_event=session.shutdown_event,
        )


def _first_is_error(parsed: ParsedRequest, first: bytes) -> bool:
    """A stream's first event is the worker failing it (not refusing it with a 4xx): retried elsewhere, as
    nothing was relayed yet. A Responses stream fails with an `event: error`, chat and completions with
    `data: {"error": ...}`."""
    if parsed.kind != "responses":
        return is_error_event(first) and not is_client_error_event(first)
    if not first.startswith(b"event: error\n"):
        return False
    event = first.split(b"\n\n", 1)[0]
    try:
        payload = json.loads(event[event.find(b"data:") + 5 :])
    except (*NOT_JSON, AttributeError):
        return True
    code = payload.get("code") if isinstance(payload, dict) else None
    code = int(code) if isinstance(code, str) and code.isdigit() else code
    return not (type(code) is int and 400 <= code < 500)


def _is_octet_stream(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/octet-stream"


def _json_object(body: bytes, whole: bool) -> bool:
    """Whether a whole answer is a JSON object, the check it passes before it is relayed as a completion.
    By its shape (opens with `{`, closes with `}`) when its framing proves it complete (a Content-Length or
    chunked body cut short is httpx's error already): an answer's text is never decoded on this path
    (`response_usage` reads only its usage). Parsed when `whole` must be proved: a body delimited by the
    worker closing the connection ends wherever the worker died, maybe just after a `}` of its usage."""
    if whole:
        try:
            return isinstance(json.loads(body), dict)
        except NOT_JSON:
            return False
    body = body.strip()  # the same object when there is nothing to strip, as in vLLM's answers
    return body[:1] == b"{" and body[-1:] == b"}"


def _delimited_by_close(headers: Mapping[str, str]) -> bool:
    """A response body with neither Content-Length nor chunked framing: it ends when the server closes."""
    return "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "").lower()


def _holds_an_event(data: bytes) -> bool:
    """`data` holds a whole SSE event: a blank line ends one (vLLM's LF framing, or CRLF)."""
    return data.find(b"\n\n") >= 0 or data.find(b"\r\n\r\n") >= 0
