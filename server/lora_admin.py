"""Run-time LoRA adapters across the fleet: vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
relayed to every worker of the adapter's base model, and loaded again on the workers that come later.

vLLM (with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) loads an adapter into the one server it is asked. Behind a
gateway that is one worker of many: a pool's Service would hand the call to any one pod, and a worker the
autoscaler adds, or one that restarts, has only its `--lora-modules`. So the gateway answers these two
calls itself, for the whole model.

- **Access**: the admin key (they change what the fleet serves and name paths on the workers' disks);
  draining → 503. Body as vLLM's (`lora_name`, `lora_path`, `load_inplace`, `is_3d_lora_weight`; unload:
  `lora_name`), `Content-Type: application/json`, at most `limits.max_body_bytes`, plus `base_model_name`
  (vLLM's name for an adapter's base in `--lora-modules` JSON): the model whose workers load it, which may
  be left out when the gateway serves one model (or, to unload, when a worker lists the adapter).
- **Load**: sent at once to every worker of the model's pools (prefill ones too: they compute an adapter
  request's KV with the adapter) that passed its last health check, is not terminating and has its
  breaker closed; each worker's `/v1/models` is read again right after, so requests naming the adapter
  are routed to it at once. A worker already listing the adapter from the same path is skipped (vLLM
  would answer 400) unless `load_inplace`; one listing it from another path is a 400 without it.
- **Answer**: vLLM's own 200 text when every worker loaded it; when every worker refused it alike with a
  4xx (a path vLLM cannot find: 404) the first refusal as that worker gave it; otherwise 502 naming each
  worker that failed and why (vLLM 0.32 answers a rank above `--max-lora-rank` 500).
- **Reconcile** (`lora.reconcile`, on by default): an adapter loaded on at least one worker is remembered
  (name, model, path), and after each good `/v1/models` read of a health check, a worker of that model
  that does not list it is asked to load it (one listing it from another path is left as it is: another
  gateway replica may have reloaded it in place there; `GET /admin/lora` shows it); a failure is retried
  after `scrape.models_interval_s`, doubling up to `lora.retry_max_s` (from the start again once the
  worker has been down and up: a restart). Reconciles of one adapter on several workers run at once; a
  load or unload of that name waits for them (and they for it). A worker that listed the adapter and no
  longer does without having been down since (a failed health check) had it unloaded elsewhere — through
  another gateway replica, or by hand — so the gateway forgets it rather than load it back; one that was
  down (a restart) gets it again. Unload forgets it first, then asks every worker of the model that is not
  terminating (healthy or not, so an unhealthy one does not bring it back; listing it or not, since one
  may have loaded it after its last list) and reads their lists again; a worker's 404 counts as unloaded
  when its list no longer has it (a vLLM without run-time updating answers 404 too, and keeps serving its
  `--lora-modules`).
- **Refusals**: only an OpenAI-shaped error body (vLLM's) passes through; a bare 404/405 (no such route:
  the worker's vLLM lacks `VLLM_ALLOW_RUNTIME_LORA_UPDATING`) is a 502 that says so.
- **Limits**: the remembered adapters are this gateway process's (a replica learns the others' from the
  workers' `/v1/models`, but does not load them on new workers; a restart forgets them): adapters that must
  survive belong in the pool's `--lora-modules` (the chart's `pools[].lora.modules`). A worker that
  restarts within one health interval, unseen, and comes back without the adapter reads as an unload
  elsewhere: the adapter is forgotten, not loaded back (the log says so).
- **Metrics**: `mosaic_lora_admin_calls_total{operation, outcome}`, one per worker call (operation `load`,
  `unload`, `reconcile`; outcome `ok`, `failed`; and `forget`, once per adapter forgotten as unloaded
  elsewhere). `GET /admin/lora` shows the remembered adapters, the
  workers serving and missing each, and when a missing one is tried next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from server.config import LoraConfig
from server.errors import NOT_JSON, Cause, GatewayError, shutting_down
from server.metrics import GatewayMetrics
from server.registry import Registry, WorkerRecord
from server.request_body import parse_json_object, read_body
from server.responses import PassthroughResponse
from simulator.protocol import UNSUPPORTED_MEDIA_TYPE, is_json_media_type

log = logging.getLogger("mosaic.lora_admin")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
CLIENT_CLOSED_STATUS = 499  # a client gone before its body ended: nothing was sent to any worker


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter the gateway loads: its name, its base model and where vLLM reads it from."""

    name: str
    model: str
    path: str
    is_3d_lora_weight: bool = False

    def load_body(self, inplace: bool = False) -> dict[str, Any]:
        return {
            "lora_name": self.name,
            "lora_path": self.path,
            "load_inplace": inplace,
            "is_3d_lora_weight": self.is_3d_lora_weight,
        }


@dataclass(frozen=True, slots=True)
class WorkerAnswer:
    """One worker's answer to a load or unload (`status` None: none came — a connect error, a timeout)."""

    worker: str
    status: int | None
    body: bytes
    content_type: str | None
    why: str

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def openai_error(self) -> bool:
        """Its body is an OpenAI-shaped error (`{"error": {...}}`), as vLLM's handlers answer: not a bare
        FastAPI 404 `{"detail": "Not Found"}` of a vLLM without the route, or a proxy's page."""
        try:
            data = json.loads(self.body)
        except (*NOT_JSON, UnicodeDecodeError):
            return False
        return isinstance(data, dict) and isinstance(data.get("error"), dict)


class _NameLock:
    """A name's lock: `exclusive` (a load or unload) or `shared` (reconciles, each on its own worker). A
    waiting `exclusive` holds back new `shared` holders, so reconciles queued behind it cannot starve it."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            async with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._waiting -= 1
                self._cond.notify_all()  # a cancelled waiter lets shared ones in again
            self._exclusive = True
        try:
            yield
        finally:
            async with self._cond:
                self._exclusive = False
                self._cond.notify_all()


@dataclass(slots=True)
class _Retry:
    at: float
    delay_s: float
    since: float | None  # the worker's `healthy_since` then: a worker up anew since starts over


def load_success(name: str) -> str:
    return f"Success: LoRA adapter '{name}' added successfully."  # vLLM 0.32's text, word for word


def unload_success(name: str) -> str:
    return f"Success: LoRA adapter '{name}' removed successfully."


def _field(data: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    value = data.get(name, default)
    if value is None and default is None:
        return None
    if kind is bool:  # as vLLM's pydantic model reads it: true/false, 1/0, "true"/"yes"/"on"/...
        try:
            return _BOOL.validate_python(value)
        except ValidationError:
            raise GatewayError(Cause.BAD_REQUEST, f"'{name}' must be a boolean.", param=name) from None
    if type(value) is not kind:
        raise GatewayError(Cause.BAD_REQUEST, f"'{name}' must be a {kind.__name__}.", param=name)
    return value


_BOOL = TypeAdapter(bool)


def _answer_why(resp: httpx.Response) -> str:
    """A worker's refusal in a few words: its OpenAI-shaped error's message, else the start of its body."""
    try:
        message = resp.json()["error"]["message"]
        if isinstance(message, str):
            return f"{resp.status_code}: {message}"
    except (*NOT_JSON, KeyError, TypeError):
        pass
    return f"{resp.status_code}: {resp.text[:200]}"


class LoraAdmin:
    def __init__(
        self,
        registry: Registry,
        config: LoraConfig,
        models: tuple[str, ...],
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        retry_min_s: float,
        max_body_bytes: int,
        authenticate_admin: Callable[[str | None], None],
        draining: Callable[[], bool],
    ) -> None:
        self.registry = registry
        self.max_body_bytes = max_body_bytes
        self.authenticate_admin = authenticate_admin
        self.draining = draining
        self.config = config
        self.models = models
        self.metrics = metrics
        self.clock = clock
        self.retry_min_s = min(retry_min_s, config.retry_max_s)
        self.desired: dict[str, AdapterSpec] = {}  # adapter name → what to keep loaded (reconcile)
        # one load or unload of a name at a time, as vLLM holds a lock per name; reconciles of a name on
        # different workers share it (a scale-out's new workers load it at once, not one after another),
        # and exclude a load or unload of it
        self._locks: defaultdict[str, _NameLock] = defaultdict(_NameLock)
        self._retry: dict[tuple[str, str], _Retry] = {}  # (worker id, adapter) → next reconcile try
        # (worker id, adapter) → the worker's `healthy_since` when its list last had the remembered adapter:
        # if it no longer has it and has not been down since, it was unloaded elsewhere (another gateway
        # replica, or the worker directly) and the gateway forgets it instead of loading it back
        self._seen: dict[tuple[str, str], float | None] = {}
        self._reconciling: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ HTTP
    def endpoint(self, path: str, request_id_key: str) -> Callable[[Request], Awaitable[Response]]:
        """The route's endpoint; the request id is the one `RequestIdMiddleware` left in the scope."""

        async def serve(request: Request) -> Response:
            return await self.handle(request, path, request.scope[request_id_key])

        return serve

    async def handle(self, request: Request, path: str, request_id: str) -> Response:
        """`POST /v1/load_lora_adapter` or `/v1/unload_lora_adapter` (module docstring)."""
        try:
            if self.draining():
                raise shutting_down()
            self.authenticate_admin(request.headers.get("authorization"))
            if not is_json_media_type(request.headers.get("content-type")):
                raise GatewayError(Cause.BAD_REQUEST, UNSUPPORTED_MEDIA_TYPE)
            body = await read_body(
                request.receive, request.headers.get("content-length"), self.max_body_bytes
            )
            data = parse_json_object(body)
            if path == LOAD_PATH:
                spec, inplace = self.parse_load(data)
                response = await self.load(spec, inplace, request_id)
            else:
                name, model = self.parse_unload(data)
                response = await self.unload(name, model, request_id)
        except GatewayError as err:
            self.metrics.rejections.labels(err.reason).inc()
            return err.to_response(request_id)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return response

    # ------------------------------------------------------------------ bodies
    def _model_for(self, data: Mapping[str, Any], name: str) -> str:
        model = _field(data, "base_model_name", str, None)
        if model:
            if model not in self.models:
                raise GatewayError(
                    Cause.MODEL_NOT_FOUND, f"The model `{model}` does not exist.", param="base_model_name"
                )
            return model
        if len(self.models) == 1:
            return self.models[0]
        known = self.registry.adapter_models().get(name) or (
            self.desired[name].model if name in self.desired else None
        )
        if known is not None:
            return known
        raise GatewayError(
            Cause.BAD_REQUEST,
            "'base_model_name' is required: this gateway serves several models (GET /v1/models lists them)",
            param="base_model_name",
        )

    def parse_load(self, data: Mapping[str, Any]) -> tuple[AdapterSpec, bool]:
        name = _field(data, "lora_name", str, "")
        path = _field(data, "lora_path", str, "")
        inplace = _field(data, "load_inplace", bool, False)
        is_3d = _field(data, "is_3d_lora_weight", bool, False)
        if not name or not path:
            raise GatewayError(Cause.BAD_REQUEST, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.models:
            raise GatewayError(
                Cause.BAD_REQUEST,
                f"The lora adapter '{name}' conflicts with a served base model.",
                param="lora_name",
            )
        model = self._model_for(data, name)
        other = self.registry.adapter_models().get(name)
        if other is not None and other != model:
            raise GatewayError(
                Cause.BAD_REQUEST,
                f"The lora adapter '{name}' is served for model `{other}`: a name is one adapter to a client.",
                param="lora_name",
            )
        return AdapterSpec(name, model, path, is_3d), inplace

    def parse_unload(self, data: Mapping[str, Any]) -> tuple[str, str]:
        name = _field(data, "lora_name", str, "")
        if not name:
            raise GatewayError(
                Cause.BAD_REQUEST, "'lora_name' needs to be provided to unload a LoRA adapter."
            )
        return name, self._model_for(data, name)

    # ------------------------------------------------------------------ operations
    def _up(self, model: str) -> list[WorkerRecord]:
        """Workers of `model` a load goes to now: healthy at the last check, not terminating, breaker closed."""
        now = self.clock()
        return [
            r
            for r in self.registry.records()
            if r.pool.model == model and r.health_ok and not r.terminating and not r.breaker.is_open(now)
        ]

    async def load(self, spec: AdapterSpec, inplace: bool, request_id: str) -> Response:
        name = spec.name
        async with self._locks[name].exclusive():
            targets = self._up(spec.model)
            if not targets:
                raise GatewayError(
                    Cause.NO_WORKER,
                    f"No worker of `{spec.model}` is up to load the adapter on; retry shortly.",
                    retry_after_s=1,
                )
            elsewhere = [r for r in targets if name in r.adapters and r.adapters[name] != spec.path]
            if not inplace and elsewhere:
                raise GatewayError(
                    Cause.BAD_REQUEST,
                    f"The lora adapter '{name}' has already been loaded from {elsewhere[0].adapters[name]!r} "
                    f"(worker {elsewhere[0].id}). If you want to load the adapter in place, set 'load_inplace' "
                    "to True.",
                    param="lora_name",
                )
            send = targets if inplace else [r for r in targets if r.adapters.get(name, None) != spec.path]
            if not send:  # vLLM's answer when it holds the adapter already
                raise GatewayError(
                    Cause.BAD_REQUEST,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                    "place, set 'load_inplace' to True.",
                    param="lora_name",
                )
            answers = await asyncio.gather(*(self._post(r, LOAD_PATH, spec.load_body(inplace)) for r in send))
            await asyncio.gather(*(self.registry.refresh_adapters(r) for r in send))
            # A 400 "already loaded" from a worker now listing it from this path: another replica or this
            # gateway's reconcile got there first, which is what was asked.
            loaded = [
                a
                for a, r in zip(answers, send, strict=True)
                if a.ok or (not inplace and a.status == 400 and r.adapters.get(name) == spec.path)
            ]
            failed = [a for a in answers if a not in loaded]
            self._count("load", len(loaded), len(failed))
            if len(loaded) + len(targets) - len(send) > 0 and self.config.reconcile:
                self.desired[name] = spec
                for r in send:
                    self._retry.pop((r.id, name), None)
                self._note_seen(targets, spec)
        if not failed:
            log.info(
                "LoRA adapter %s (%s) loaded on %d worker(s) of %s", name, spec.path, len(send), spec.model
            )
            return Response(load_success(name).encode(), 200, {"x-request-id": request_id})
        if not loaded:
            refusal = _alike_refusal(failed)
            if refusal is not None:
                return PassthroughResponse(
                    refusal.body,
                    refusal.status or 502,
                    request_id,
                    refusal.content_type or "application/json",
                )
        later = " The gateway loads it on them after their next good health checks." if loaded else ""
        raise GatewayError(
            Cause.UPSTREAM_UNAVAILABLE,
            f"LoRA adapter '{name}' loaded on {len(loaded)} of {len(send)} worker(s) of `{spec.model}`; "
            f"failed on {_failures(failed)}.{later if self.config.reconcile else ''}{_no_route_hint(failed)}",
        )

    async def unload(self, name: str, model: str, request_id: str) -> Response:
        async with self._locks[name].exclusive():
            remembered = self.desired.get(name)
            if remembered is not None and remembered.model == model:
                del self.desired[name]  # first: a reconcile must not load it back
                self._retry = {k: v for k, v in self._retry.items() if k[1] != name}
            else:
                remembered = None
            # every worker of the model, not only those whose last list has it: one may have loaded it since
            # (a load that timed out here and finished there, vLLM's resolver on a first request)
            holders = [r for r in self.registry.records() if r.pool.model == model and not r.terminating]
            if remembered is None and not any(name in r.adapters for r in holders):
                raise GatewayError(
                    Cause.NOT_FOUND, f"The lora adapter '{name}' cannot be found.", param="lora_name"
                )
            answers = await asyncio.gather(
                *(self._post(r, UNLOAD_PATH, {"lora_name": name}) for r in holders)
            )
            await asyncio.gather(*(self.registry.refresh_adapters(r) for r in holders))
            # a worker's 404 (it had unloaded it already) counts as unloaded only when its list, read again,
            # no longer has it: a vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING answers 404 too (no such route)
            # and goes on serving a `--lora-modules` adapter
            failed = [a for a, r in zip(answers, holders, strict=True) if not a.ok and name in r.adapters]
            self._count("unload", len(answers) - len(failed), len(failed))
            for r in holders:
                self._seen.pop((r.id, name), None)
        if not failed:
            log.info("LoRA adapter %s unloaded from the %d worker(s) of %s", name, len(holders), model)
            return Response(unload_success(name).encode(), 200, {"x-request-id": request_id})
        raise GatewayError(
            Cause.UPSTREAM_UNAVAILABLE,
            f"LoRA adapter '{name}' unloaded from {len(holders) - len(failed)} of {len(holders)} worker(s) of "
            f"`{model}`; failed on {_failures(failed)}.{_no_route_hint(failed)}",
        )

    def _note_seen(self, workers: list[WorkerRecord], spec: AdapterSpec) -> None:
        for r in workers:
            if r.adapters.get(spec.name) == spec.path:
                self._seen[(r.id, spec.name)] = r.healthy_since

    def _forget_if_unloaded_elsewhere(self, rec: WorkerRecord, spec: AdapterSpec) -> bool:
        """Whether `rec` had `spec` and dropped it without having been down since: then it was unloaded
        elsewhere, and the gateway forgets it (loading it back would undo that unload)."""
        key = (rec.id, spec.name)
        if key not in self._seen or self._seen[key] != rec.healthy_since:
            return False
        del self.desired[spec.name]
        for k in [k for k in (*self._seen, *self._retry) if k[1] == spec.name]:
            self._seen.pop(k, None)
            self._retry.pop(k, None)
        self._count("forget", 1, 0)
        log.warning(
            "LoRA adapter %s is no longer listed by worker %s, which has not been down since it was: unloaded "
            "elsewhere (another gateway replica, or the worker directly); no longer loaded on workers of %s "
            "that come later",
            spec.name,
            rec.id,
            spec.model,
        )
        return True

    async def reconcile(self, rec: WorkerRecord) -> None:
        """Load on `rec` each remembered adapter of its model it does not list (module docstring)."""
        if not self.config.reconcile or not self.desired:
            return
        live = {r.id for r in self.registry.records()}
        for key in [k for k in (*self._retry, *self._seen) if k[0] not in live]:
            self._retry.pop(key, None)  # a worker gone: its schedule and history with it
            self._seen.pop(key, None)
        for spec in list(self.desired.values()):
            key = (rec.id, spec.name)
            if spec.model != rec.pool.model or key in self._reconciling:
                continue
            if spec.name in rec.adapters:
                self._note_seen([rec], spec)
                continue
            if self._forget_if_unloaded_elsewhere(rec, spec):
                continue
            retry = self._retry.get(key)
            if retry is not None and retry.since != rec.healthy_since:
                retry = None  # up anew since it failed (a restart): start over
            if retry is not None and self.clock() < retry.at:
                continue
            self._reconciling.add(key)
            try:
                async with self._locks[spec.name].shared():
                    # unloaded, loaded anew, or the worker gone or unhealthy while this waited for the lock
                    if (
                        self.desired.get(spec.name) is not spec
                        or self.registry.get(rec.id) is not rec
                        or rec.terminating
                        or not rec.health_ok
                    ):
                        continue
                    answer = await self._post(rec, LOAD_PATH, spec.load_body())
                    await self.registry.refresh_adapters(rec)
                    if rec.adapters.get(spec.name) == spec.path:
                        self._retry.pop(key, None)
                        self._note_seen([rec], spec)
                        self._count("reconcile", 1, 0)
                        log.info("LoRA adapter %s loaded on worker %s (reconcile)", spec.name, rec.id)
                        continue
                    delay = (
                        self.retry_min_s if retry is None else min(retry.delay_s * 2, self.config.retry_max_s)
                    )
                    self._retry[key] = _Retry(self.clock() + delay, delay, rec.healthy_since)
                    self._count("reconcile", 0, 1)
                    log.log(
                        logging.WARNING if retry is None else logging.DEBUG,
                        "LoRA adapter %s could not be loaded on worker %s (%s); next try in %.0f s",
                        spec.name,
                        rec.id,
                        answer.why,
                        delay,
                    )
            finally:
                self._reconciling.discard(key)

    # ------------------------------------------------------------------ helpers
    async def _post(self, rec: WorkerRecord, path: str, body: dict[str, Any]) -> WorkerAnswer:
        auth = self.registry.auth_header(rec.pool.name)
        try:
            with self.registry.engine_call(rec):  # vLLM loads in its engine loop: no step meanwhile
                resp = await self.registry.client.post(
                    rec.url + path,
                    json=body,
                    headers=dict([auth]) if auth else None,
                    timeout=self.config.load_timeout_s,
                )
        except httpx.HTTPError as exc:
            return WorkerAnswer(rec.id, None, b"", None, type(exc).__name__)
        return WorkerAnswer(
            rec.id, resp.status_code, resp.content, resp.headers.get("content-type"), _answer_why(resp)
        )

    def _count(self, operation: str, ok: int, failed: int) -> None:
        if ok:
            self.metrics.lora_admin_calls.labels(operation, "ok").inc(ok)
        if failed:
            self.metrics.lora_admin_calls.labels(operation, "failed").inc(failed)

    def describe(self) -> dict[str, Any]:
        """`GET /admin/lora`: the remembered adapters and where each is served or missing."""
        now = self.clock()
        adapters = []
        for spec in sorted(self.desired.values(), key=lambda s: s.name):
            workers = [r for r in self.registry.records() if r.pool.model == spec.model]
            missing = []
            for r in workers:
                if spec.name in r.adapters:
                    continue
                retry = self._retry.get((r.id, spec.name))
                missing.append(
                    {
                        "worker": r.id,
                        "next_try_in_s": None if retry is None else round(max(0.0, retry.at - now), 1),
                    }
                )
            adapters.append(
                {
                    "name": spec.name,
                    "model": spec.model,
                    "path": spec.path,
                    "is_3d_lora_weight": spec.is_3d_lora_weight,
                    # workers listing it from its path (a card without a `root`: from any); a worker that
                    # lists it not at all is `missing`, never both
                    "serving": sorted(
                        r.id for r in workers if spec.name in r.adapters and not _other_path(r, spec)
                    ),
                    # workers listing the name from another path (down during an in-place reload, their own
                    # --lora-modules, another replica's load): reconcile leaves them as they are
                    "other_path": [
                        {"worker": r.id, "path": r.adapters[spec.name]}
                        for r in sorted(workers, key=lambda r: r.id)
                        if _other_path(r, spec)
                    ],
                    "missing": missing,
                }
            )
        return {"reconcile": self.config.reconcile, "adapters": adapters}


def _alike_refusal(failed: list[WorkerAnswer]) -> WorkerAnswer | None:
    """The first answer when every worker refused alike with a 4xx (the request's fault: another try
    would be refused too), else None."""
    statuses = {a.status for a in failed}
    if (
        len(statuses) == 1
        and (status := failed[0].status) is not None
        and 400 <= status < 500
        and all(a.openai_error for a in failed)  # vLLM's refusal, not a route it lacks
    ):
        return failed[0]
    return None


def _other_path(rec: WorkerRecord, spec: AdapterSpec) -> bool:
    """Whether `rec` lists `spec.name` from a path other than `spec.path` (a card without a `root`: no)."""
    listed = rec.adapters.get(spec.name)
    return spec.name in rec.adapters and listed is not None and listed != spec.path


def _no_route_hint(failed: list[WorkerAnswer]) -> str:
    if any(a.status in (404, 405) and not a.openai_error for a in failed):
        return (
            " A bare 404/405 means the worker has no run-time LoRA routes: start its vLLM with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (the chart's pools[].lora.runtimeUpdating)."
        )
    return ""


def _failures(failed: list[WorkerAnswer]) -> str:
    return "; ".join(f"{a.worker} ({a.why})" for a in failed)
