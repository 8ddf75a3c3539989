"""`create_app(config) -> FastAPI`: the gateway's HTTP surface. Everything is built here; nothing is global.

| path | auth | does |
|---|---|---|
| POST /v1/chat/completions, /v1/completions | API key | route and proxy (see `server.dispatch`) |
| GET /v1/models | API key | the union of the fleet's models (OpenAI list shape) |
| GET /health | none | 200 while the process serves |
| GET /ready | none | 200 when every configured model has a ready worker and the gateway is not draining, else 503 |
| GET /metrics | none | the gateway's Prometheus metrics (`mosaic_…`) |
| GET /admin/workers | admin key | each worker's state, breaker, parsed stats, in-flight counts, capacity |
| GET /admin/routing | admin key | the routing policy, plugins, weights; admission queue depths |
| GET /admin/autoscaler | admin key | autoscaler config, pools as the policy sees them, recent decisions (reasons, signals) and scale actions |

Before dispatch, in order: request id (the client's `X-Request-Id` when it is a sane token, else a new
one; echoed on every response and sent to workers), draining check (503), API key (401), body size
(`limits.max_body_bytes` → 413, checked on Content-Length and while reading), body validation (400),
model known (404), per-key rate limits (429). The proxy endpoints are served by `GatewayApp`'s fast path
(plain ASGI: no middleware stack, router or dependency injection on the hot path).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from scheduler.routing.framework import ReservePlugin
from server.config import MosaicConfig
from server.discovery import Source
from server.dispatch import RequestRecord
from server.errors import Cause, GatewayError
from server.footprint import Kind, parse_request
from server.gateway import Gateway
from server.metrics import CONTENT_TYPE

log = logging.getLogger("mosaic.app")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_from(header: str | None) -> str:
    """The client's X-Request-Id when it is a safe token (≤128 of [A-Za-z0-9._:-]), else a new uuid4 hex."""
    if header and _REQUEST_ID.match(header):
        return header
    return uuid.uuid4().hex


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than `limit` bytes (413) before or while reading it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(Cause.BODY_TOO_LARGE, f"Request body of {declared} bytes exceeds the {limit}-byte limit.")
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(Cause.BODY_TOO_LARGE, f"Request body exceeds the {limit}-byte limit.")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def create_app(
    config: MosaicConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    sources: Mapping[str, Source] | None = None,
    reserve: Sequence[ReservePlugin] = (),
) -> FastAPI:
    """A FastAPI app serving `config`; its lifespan starts discovery, scraping and simulated workers."""
    gw = Gateway(config, transport=transport, sources=sources, reserve=reserve)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = GatewayApp(title="Mosaic gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gw
    for path, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "completions")):
        endpoint = _proxy_endpoint(gw, path, kind)
        app.router.add_route(path, endpoint, methods=["POST"])  # listed for completeness; served by the fast path
        app.fast_routes[path] = _asgi(endpoint)
    _add_info_routes(app, gw)
    _add_error_handlers(app)
    return app


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


def _asgi(endpoint: Callable[[Request], Awaitable[Response]]) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await endpoint(Request(scope, receive))
        except Exception as exc:  # the endpoint answers its own errors; this is the last resort
            log.exception("unhandled error on %s", scope.get("path"), exc_info=exc)
            response = GatewayError(Cause.UPSTREAM_UNAVAILABLE, "Internal gateway error").to_response()
            response.status_code = 500
        await response(scope, receive, send)

    return app


def _proxy_endpoint(gw: Gateway, path: str, kind: Kind) -> Callable[[Request], Awaitable[Response]]:
    limits = gw.config.limits
    clock = gw.clock

    async def endpoint(request: Request) -> Response:
        arrival = clock()
        rid = request_id_from(request.headers.get("x-request-id"))
        model = "unknown"
        try:
            if gw.draining:
                raise GatewayError(Cause.SHUTTING_DOWN, "The gateway is shutting down; retry on another replica.", retry_after_s=1)
            key = gw.keys.authenticate(request.headers.get("authorization"))
            body = await read_body(request, limits.max_body_bytes)
            parsed = parse_request(kind, body, gw.max_model_len)
            if parsed.model not in gw.models:
                raise GatewayError(
                    Cause.MODEL_NOT_FOUND, f"The model `{parsed.model}` does not exist.", param="model"
                )
            model = parsed.model
            reserved = parsed.prompt_tokens + parsed.max_output_tokens
            gw.limiter.admit(key, reserved, arrival)
        except GatewayError as err:
            gw.metrics.requests.labels(model, "none", str(err.status)).inc()
            gw.metrics.rejections.labels(err.cause.value).inc()
            return err.to_response(rid)
        rec = RequestRecord(rid, model, key, arrival, reserved if gw.limiter.enabled else 0)
        return await gw.dispatcher.handle(parsed, path, rec, request.receive)

    return endpoint


def _add_info_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            gw.keys.authenticate(request.headers.get("authorization"))
        except GatewayError as err:
            return err.to_response()
        data = [
            {"id": m, "object": "model", "created": gw.started_at, "owned_by": "mosaic", "root": m,
             "max_model_len": gw.max_model_len.get(m) or None}
            for m in gw.models
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        ok, per_model = gw.readiness()
        body = {"ready": ok, "draining": gw.draining, "ready_workers": per_model}
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
            "admission": {"queue_size": gw.config.limits.queue_size,
                          "deadline_s": gw.config.limits.queue_deadline_s, "depths": gw.admission.depths()},
            "outcomes": dict(gw.dispatcher.outcomes),
        }
        return JSONResponse(body)

    @app.get("/admin/autoscaler")
    async def admin_autoscaler(request: Request) -> Response:
        try:
            gw.keys.authenticate_admin(request.headers.get("authorization"))
        except GatewayError as err:
            return err.to_response()
        if gw.autoscaler is None:
            return JSONResponse({"enabled": False, "config": gw.config.autoscaler.model_dump(mode="json")})
        return JSONResponse(gw.autoscaler.describe())


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        # Unknown paths and methods: the gateway's own errors, so OpenAI's shape (vLLM answers {"detail"}).
        cause = Cause.NOT_FOUND if exc.status_code == 404 else Cause.BAD_REQUEST
        err = GatewayError(cause, str(exc.detail))
        resp = err.to_response()
        resp.status_code = exc.status_code
        return resp

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> Response:
        return exc.to_response()
