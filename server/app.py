"""`create_app(config) -> FastAPI`: the gateway's HTTP surface. Everything is built here; nothing is global.

| path | auth | does |
|---|---|---|
| POST /v1/chat/completions, /v1/completions, /v1/responses | API key | route and proxy (see `server.dispatch`) |
| POST /v1/embeddings, /classify, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank | API key | the same, for models whose pools run vLLM's pooling runner (400 for the others, and theirs 400 on the generation routes) |
| GET /v1/responses/{id}, POST /v1/responses/{id}/cancel | API key | forwarded to the worker that served that response (`server.response_retrieval`) |
| GET /v1/models | API key | the union of the fleet's models (OpenAI list shape) |
| GET /health | none | 200 while the process serves |
| GET /ready | none | 200 when not draining and every pool's discovery has listed once (`readiness.require_all_models`: also every model has a ready worker), else 503; the body has per-model ready workers |
| GET /metrics | none | the gateway's Prometheus metrics (`mosaic_…`) |
| GET /admin/workers | admin key | each worker's state, breaker, parsed stats, in-flight counts, capacity |
| GET /admin/routing | admin key | the routing policy, plugins, weights; admission queue depths |
| GET /admin/autoscaler | admin key | autoscaler config, pools as the policy sees them, recent decisions (reasons, signals) and scale actions (`?last=N`, default 20) |

Before dispatch, in order: request id (the client's `X-Request-Id` when it is a sane token, else a new
one; echoed on every response — the proxy endpoints set it themselves, every other route, 404 and 405
included, gets it from `RequestIdMiddleware` — and sent to workers), draining check (503), API key (401), body size
(`limits.max_body_bytes` → 413, checked on Content-Length and while reading), body validation (400),
model known (404), per-key rate limits (429). The proxy endpoints are served by `GatewayApp`'s fast path
(plain ASGI: no middleware stack, router or dependency injection on the hot path); under `mosaic serve`
they also skip uvicorn's ASGI cycle (`server.fast_http`: one write per answer).

Errors FastAPI raises (unknown path 404, wrong method 405 with its `Allow` header) and any unhandled error
on a route (500, `InternalServerError`) are answered in OpenAI's nested shape, like the gateway's own.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.routing.framework import ReservePlugin
from server.config import CorsConfig, MosaicConfig
from server.discovery import Source
from server.dispatch import CLIENT_CLOSED_STATUS, RequestRecord
from server.errors import Cause, GatewayError, shutting_down
from server.footprint import POOLING_KINDS, Kind, parse_request
from server.gateway import Gateway
from server.lora_admin import LOAD_PATH, UNLOAD_PATH
from server.metrics import CONTENT_TYPE
from server.request_body import read_body
from server.response_retrieval import stored_response_endpoint
from server.tokenize_proxy import TOKENIZER_PATHS, TokenizerProxy
from simulator.protocol import UNSUPPORTED_MEDIA_TYPE, is_json_media_type

log = logging.getLogger("mosaic.app")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_from(header: str | None) -> str:
    """The client's X-Request-Id when it is a safe token (≤128 of [A-Za-z0-9._:-]), else a new uuid4 hex."""
    if header and _REQUEST_ID.match(header):
        return header
    return new_request_id()


_ID_RANDOM = random.Random(os.urandom(32))  # seeded once per process: no syscall per request
os.register_at_fork(after_in_child=lambda: _ID_RANDOM.seed(os.urandom(32)))  # forked workers: own sequences


def new_request_id() -> str:
    """A random UUID version 4 as 32 hex digits, like `uuid.uuid4().hex` but from a per-process generator
    seeded from os.urandom (an id for tracing and for pairing P/D hops, not a secret)."""
    n = _ID_RANDOM.getrandbits(128)
    n = (n & ~(0xF000 << 64)) | (4 << 76)  # version 4 (uuid.UUID's bit layout)
    n = (n & ~(0xC000 << 48)) | (0x8000 << 48)  # RFC 4122 variant
    return f"{n:032x}"


def _request_headers(scope: Scope) -> tuple[str | None, str | None, str | None, str | None]:
    """(x-request-id, authorization, content-length, content-type): the first of each (ASGI header names
    are lowercase)."""
    rid = auth = length = ctype = None
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            rid = rid or value.decode("latin-1")
        elif name == b"authorization":
            auth = auth or value.decode("latin-1")
        elif name == b"content-length":
            length = length or value.decode("latin-1")
        elif name == b"content-type":
            ctype = ctype or value.decode("latin-1")
    return rid, auth, length, ctype


def internal_error(request_id: str | None = None) -> Response:
    """The last-resort answer to an error nobody handled: 500 in OpenAI's shape (`type` as vLLM's own
    `InternalServerError`, `code` the status, as `server.errors` writes every other cause)."""
    return GatewayError(Cause.INTERNAL, "Internal gateway error").to_response(request_id)


_RID_KEY = "mosaic.request_id"  # where `RequestIdMiddleware` leaves the id in the ASGI scope


class RequestIdMiddleware:
    """Pure ASGI: echo (or create) `X-Request-Id` on every response FastAPI serves — info and admin routes,
    404s, 405s. Not on the hot path: `GatewayApp` hands the proxy POSTs to their endpoints before FastAPI's
    middleware stack, and those endpoints set the header themselves. The 500 of an unhandled error is sent
    by Starlette's outermost `ServerErrorMiddleware`, past this one: its handler reads the id from the
    scope (`_RID_KEY`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_from(_request_headers(scope)[0])
        scope[_RID_KEY] = rid
        value = rid.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(
    config: MosaicConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    sources: Mapping[str, Source] | None = None,
    reserve: Sequence[ReservePlugin] = (),
    on_startup_error: Callable[[Exception], None] | None = None,
) -> FastAPI:
    """A FastAPI app serving `config`; its lifespan starts discovery, scraping and simulated workers.
    When that start fails, what did start is stopped; then the error is raised (uvicorn logs it and exits 3),
    or, given `on_startup_error`, handed to it with the app up but draining: the caller stops the server
    (`mosaic serve` prints one line and exits 2)."""
    gw = Gateway(config, transport=transport, sources=sources, reserve=reserve)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            await gw.start()
        except BaseException as exc:
            # Startup failed (e.g. a launched pool's second vLLM replica found no free GPU): stop what did
            # start — vLLM processes of earlier replicas and pools would otherwise outlive this gateway.
            await gw.stop()
            if on_startup_error is None or not isinstance(exc, Exception):
                raise
            # Reported, not raised: uvicorn answers a failed startup with sys.exit(3) from inside its task,
            # which its caller cannot turn into a clean exit. The app comes up draining (every request 503,
            # /ready 503) and the caller, told here, stops it at once.
            gw.draining = True
            on_startup_error(exc)
            yield
            return
        try:
            yield
        finally:
            await gw.stop()

    app = GatewayApp(
        title="Mosaic gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.gateway = gw
    cors = _cors_options(config.cors)
    proxied: tuple[tuple[str, Kind], ...] = (
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "completions"),
        ("/v1/responses", "responses"),
        ("/v1/embeddings", "embeddings"),
        ("/classify", "classify"),  # vLLM's classification route (a classify-task pooling model)
        # vLLM's score and rerank routes, each under every path vLLM serves it (rerank: Jina's and Cohere's v2)
        ("/score", "score"),
        ("/v1/score", "score"),
        ("/rerank", "rerank"),
        ("/v1/rerank", "rerank"),
        ("/v2/rerank", "rerank"),
    )
    for path, kind in proxied:
        serve = _proxy_endpoint(gw, path, kind)
        app.router.add_route(path, _starlette_endpoint(serve), methods=["POST"])  # served by the fast path
        app.fast_routes[path] = _asgi(serve) if cors is None else _cors_when_origin(_asgi(serve), cors)
    _add_info_routes(app, gw)
    _add_error_handlers(app)
    if cors is not None:  # inside the request id's middleware: a preflight answer carries the id too
        app.add_middleware(CORSMiddleware, **cors)
    app.add_middleware(RequestIdMiddleware)
    return app


def _cors_options(cors: CorsConfig) -> dict[str, Any] | None:
    """Starlette's `CORSMiddleware` arguments for the config, None when CORS is off (no origins)."""
    if not cors.allowed_origins:
        return None
    return {
        "allow_origins": cors.allowed_origins,
        "allow_methods": cors.allowed_methods,
        "allow_headers": cors.allowed_headers,
        "allow_credentials": cors.allow_credentials,
    }


def _cors_when_origin(app: ASGIApp, options: dict[str, Any]) -> ASGIApp:
    """A proxy endpoint with CORS for the requests that carry an `Origin` header (browsers'): they get
    `CORSMiddleware`'s headers. The rest (API clients, other services) reach the endpoint with the server's
    own `send`, so their answers stay byte for byte what they were and a stream on the gateway's fast cycle
    is still written from the worker's reads (`StreamSession.push` needs that `send`); the middleware would
    wrap every request's `send` to add `Vary: Origin`. The preflight (OPTIONS) is not a POST: it goes
    through FastAPI's stack, where the same middleware answers it."""
    with_cors = CORSMiddleware(app, **options)

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        for name, _ in scope["headers"]:
            if name == b"origin":
                await with_cors(scope, receive, send)
                return
        await app(scope, receive, send)

    return endpoint


class GatewayApp(FastAPI):
    """FastAPI, except that POSTs to the proxy paths skip the middleware stack and router (hot path).

    The proxy endpoints handle their own errors (OpenAI shape) and need none of FastAPI's machinery;
    everything else — lifespan, info/admin routes, 404s — goes through FastAPI as usual.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast_routes: dict[str, ASGIApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.fast_routes.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


ProxyEndpoint = Callable[[Scope, Receive], Awaitable[Response]]


def _starlette_endpoint(serve: ProxyEndpoint) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await serve(request.scope, request.receive)

    return endpoint


def _asgi(serve: ProxyEndpoint) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await serve(scope, receive)
        except Exception as exc:  # the endpoint answers its own errors; this is the last resort
            log.exception("unhandled error on %s", scope.get("path"), exc_info=exc)
            response = internal_error(request_id_from(_request_headers(scope)[0]))
        await response(scope, receive, send)

    return app


def _proxy_endpoint(gw: Gateway, path: str, kind: Kind) -> ProxyEndpoint:
    limits = gw.config.limits
    clock = gw.clock
    child, received = gw.dispatcher.child, gw.metrics.received  # memoised metric children

    only_model = gw.models[0] if len(gw.models) == 1 else None  # serves a request that names no model

    async def endpoint(scope: Scope, receive: Receive) -> Response:
        arrival = clock()
        rid_header, authorization, declared, content_type = _request_headers(scope)
        rid = request_id_from(rid_header)
        model = "unknown"
        try:
            if gw.draining:
                raise shutting_down()
            key = gw.keys.authenticate(authorization)
            # as vLLM refuses it (the body is forwarded as JSON, so a text/plain one would have been served)
            if not is_json_media_type(content_type):
                raise GatewayError(Cause.BAD_REQUEST, UNSUPPORTED_MEDIA_TYPE)
            body = await read_body(receive, declared, limits.max_body_bytes)
            parsed = parse_request(
                kind, body, gw.max_model_len, only_model, gw.registry.adapter_models(), gw.adapter_resolver
            )
            if parsed.model not in gw.models:
                raise GatewayError(
                    Cause.MODEL_NOT_FOUND, f"The model `{parsed.model}` does not exist.", param="model"
                )
            model = parsed.model
            _check_runner(path, kind, model, gw.pooling_models, parsed.adapter)
            reserved = parsed.prompt_tokens + parsed.max_output_tokens
            charged = gw.limiter.admit(key, reserved, arrival)
        except GatewayError as err:
            gw.metrics.requests.labels(model, "none", str(err.status)).inc()
            gw.metrics.rejections.labels(err.reason).inc()
            return err.to_response(rid)
        except ClientDisconnect:  # gone before its body ended: nobody to answer, and not the gateway's error
            gw.metrics.requests.labels(model, "none", str(CLIENT_CLOSED_STATUS)).inc()
            return Response(status_code=CLIENT_CLOSED_STATUS)
        child(received, model).inc()  # arrivals, before any queueing (the autoscaler's request rate)
        adapter = gw.dispatcher.adapter_label(parsed.adapter)
        rec = RequestRecord(rid, model, key, arrival, charged, adapter=adapter)
        return await gw.dispatcher.handle(parsed, path, rec, receive)

    return endpoint


def _check_runner(
    path: str, kind: Kind, model: str, pooling_models: frozenset[str], adapter: str | None = None
) -> None:
    """400 when the model's workers do not serve this endpoint: a pooling model (`runner: pooling`) answers
    embeddings, classify, score and rerank only, a generate model everything else (its vLLM has no such route and would answer a bare
    404 `Not Found`, which reads as a wrong URL rather than a wrong model). Named as the client named it (a
    LoRA adapter, or any name a `lora_resolver` model takes for one), then its base model."""
    pooling = model in pooling_models
    if (kind in POOLING_KINDS) == pooling:
        return
    what = "a pooling model (runner: pooling)" if pooling else "a generative model (runner: generate)"
    name = f"`{model}`" if adapter is None else f"`{adapter}` (an adapter of `{model}`)"
    raise GatewayError(
        Cause.BAD_REQUEST, f"The model {name} is {what} and does not serve {path}", param="model"
    )


def _add_info_routes(app: FastAPI, gw: Gateway) -> None:
    for path in (LOAD_PATH, UNLOAD_PATH):  # run-time LoRA adapters, for the whole fleet (server.lora_admin)
        app.router.add_route(path, gw.lora_admin.endpoint(path, _RID_KEY), methods=["POST"])
    tokenizer = TokenizerProxy(gw)
    for path in TOKENIZER_PATHS:  # vLLM's tokenizer endpoints, answered by a worker (server.tokenize_proxy)
        app.router.add_route(path, tokenizer.endpoint(path, _RID_KEY), methods=["POST"])
    # stored responses, on the worker that served them (server.response_retrieval)
    app.router.add_route(
        "/v1/responses/{response_id}", stored_response_endpoint(gw, "GET", "", _RID_KEY), methods=["GET"]
    )
    app.router.add_route(
        "/v1/responses/{response_id}/cancel",
        stored_response_endpoint(gw, "POST", "/cancel", _RID_KEY),
        methods=["POST"],
    )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            gw.keys.authenticate(request.headers.get("authorization"))
        except GatewayError as err:
            return err.to_response()
        data = [
            {
                "id": m,
                "object": "model",
                "created": gw.started_at,
                "owned_by": "mosaic",
                "root": m,
                "parent": None,
                "max_model_len": gw.max_model_len.get(m) or None,
            }
            for m in gw.models
        ]
        data += [  # LoRA adapters the workers serve, as vLLM lists them: `parent` is the base model
            {
                "id": name,
                "object": "model",
                "created": gw.started_at,
                "owned_by": "mosaic",
                "root": root,
                "parent": base,
                "max_model_len": None,
            }
            for name, (base, root) in sorted(gw.registry.adapter_cards().items())
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        ok, body = gw.readiness()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/admin/workers")
    async def admin_workers(request: Request) -> Response:
        try:
            gw.keys.authenticate_admin(request.headers.get("authorization"))
        except GatewayError as err:
            return err.to_response()
        return JSONResponse({"workers": gw.registry.describe()})

    @app.get("/admin/routing")
    async def admin_routing(request: Request) -> Response:
        try:
            gw.keys.authenticate_admin(request.headers.get("authorization"))
        except GatewayError as err:
            return err.to_response()
        body: dict[str, Any] = {
            "router": gw.router.describe(),
            "config": gw.config.routing.model_dump(mode="json"),
            "admission": {
                "queue_size": gw.config.limits.queue_size,
                "deadline_s": gw.config.limits.queue_deadline_s,
                "depths": gw.admission.depths(),
            },
            "outcomes": dict(gw.dispatcher.outcomes),
        }
        return JSONResponse(body)

    @app.get("/admin/lora")
    async def admin_lora(request: Request) -> Response:
        try:
            gw.keys.authenticate_admin(request.headers.get("authorization"))
        except GatewayError as err:
            return err.to_response()
        return JSONResponse(gw.lora_admin.describe())

    @app.get("/admin/autoscaler")
    async def admin_autoscaler(request: Request) -> Response:
        try:
            gw.keys.authenticate_admin(request.headers.get("authorization"))
        except GatewayError as err:
            return err.to_response()
        if gw.autoscaler is None:
            return JSONResponse({"enabled": False, "config": gw.config.autoscaler.model_dump(mode="json")})
        # ?last=N: how many decisions, actions and events (20 by default; `autoscaler.history` are kept)
        raw = request.query_params.get("last", "20")
        if not raw.isdigit() or int(raw) < 1:
            return GatewayError(
                Cause.BAD_REQUEST, f"'last' must be a whole number ≥ 1, got {raw!r}", param="last"
            ).to_response()
        return JSONResponse(gw.autoscaler.describe(last=int(raw)))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # Unknown paths and methods: the gateway's own errors, so OpenAI's shape (vLLM answers {"detail"}).
        by_status = {404: Cause.NOT_FOUND, 405: Cause.METHOD_NOT_ALLOWED}
        response = GatewayError(
            by_status.get(exc.status_code, Cause.BAD_REQUEST), str(exc.detail)
        ).to_response()
        if exc.headers:  # 405's `Allow` (RFC 9110 requires it)
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception) -> Response:
        # Starlette logs the exception (re-raised after this answer); the client gets OpenAI's 500 shape.
        return internal_error(request.scope.get(_RID_KEY))

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> Response:
        return exc.to_response()
