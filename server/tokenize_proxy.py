"""`POST /tokenize` and `POST /detokenize`: vLLM's tokenizer endpoints, answered by a worker of the model.

A client that counts tokens or applies the chat template before it sends (to trim a conversation to the
context, or to budget `max_tokens`) asks the gateway as it would ask vLLM. The worker's tokenizer and chat
template are the model's, so the gateway does not answer itself: it forwards the body unchanged to one
worker serving the body's model and relays that worker's answer (status and body) unchanged, so a client
gets vLLM's own 200s and 400s.

- **Access**: the API keys of the proxy endpoints (401 without one); the key's requests/s limit is charged
  one request and its tokens/min limit nothing (nothing is generated). Draining → 503.
- **Body**: `Content-Type: application/json`, a JSON object, at most `limits.max_body_bytes` (413); its
  `model` as on the proxy endpoints: absent, null or "" is the gateway's one model (400 when it serves
  several), an unknown one 404 `model_not_found`. The rest is the worker's to check.
- **Worker**: one that is ready with its breaker closed, of any role (a prefill worker tokenizes like any
  other), fewest requests in flight first (ties in fleet order). No KV reservation and no admission queue:
  a tokenizer call takes no KV and no batch slot, and is answered in milliseconds.
- **Failure**: a connect error, a timeout (`limits.connect_timeout_s` to connect, `limits.stall_timeout_s`
  for the answer) or a 429/5xx answer moves the request to the next worker, up to `limits.max_retries`
  more; the breaker is told as on the proxy path. When every try failed, the last worker's own answer
  passes through, else 502 (504 after a timeout); no ready worker at all → 503 `no_worker`.
- **Metrics**: `mosaic_tokenizer_requests_total{path, model, status}` (status as the client got it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from scheduler.fleet import WorkerState, WorkerView
from scheduler.routing.lora import serves
from server.errors import Cause, GatewayError, shutting_down
from server.failure import blame
from server.footprint import AdapterResolver
from server.gateway import Gateway
from server.proxy import RETRYABLE_STATUSES, upstream_headers
from server.request_body import parse_json_object, read_body
from server.responses import PassthroughResponse
from simulator.protocol import UNSUPPORTED_MEDIA_TYPE, is_json_media_type

TOKENIZER_PATHS = ("/tokenize", "/detokenize")
CLIENT_CLOSED_STATUS = 499  # recorded for a client gone before its body ended, never sent


def requested_model(
    body: bytes,
    models: tuple[str, ...],
    adapters: Mapping[str, str] | None = None,
    resolver: AdapterResolver | None = None,
) -> tuple[str, str | None]:
    """(the model a tokenizer request asks for, the LoRA adapter it names or None: `adapters` maps each to
    its base model; with a `resolver`, any other unknown name is an adapter of its model); GatewayError
    (400/404) when the body or its model is bad."""
    data = parse_json_object(body)
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise GatewayError(Cause.BAD_REQUEST, "'model' must be a string.", param="model")
    if not model:
        if len(models) != 1:
            raise GatewayError(
                Cause.BAD_REQUEST,
                "'model' is required: this gateway serves several models (GET /v1/models lists them)",
                param="model",
            )
        return models[0], None
    if model in models:
        return model, None
    if adapters and model in adapters:
        return adapters[model], model
    if resolver is not None and (base := resolver.base_of(model)) is not None:
        return base, model
    raise GatewayError(Cause.MODEL_NOT_FOUND, f"The model `{model}` does not exist.", param="model")


def candidates(workers: tuple[WorkerView, ...], model: str, adapter: str | None = None) -> list[WorkerView]:
    """Ready workers of `model` (serving `adapter` when one is named) with a closed breaker, fewest requests
    in flight first (stable)."""
    ready = [
        w
        for w in workers
        if w.model == model and w.state is WorkerState.READY and not w.breaker_open and serves(w, adapter)
    ]
    return sorted(ready, key=lambda w: w.inflight_requests)


class TokenizerProxy:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.limits = gw.config.limits
        self.worker_auth = gw.dispatcher.worker_auth

    def endpoint(self, path: str, request_id_key: str) -> Callable[[Request], Awaitable[Response]]:
        """The route's endpoint; the request id is the one `RequestIdMiddleware` left in the scope."""

        async def serve(request: Request) -> Response:
            return await self.handle(request, path, request.scope[request_id_key])

        return serve

    async def handle(self, request: Request, path: str, request_id: str) -> Response:
        gw = self.gw
        model = "unknown"
        try:
            if gw.draining:
                raise shutting_down()
            key = gw.keys.authenticate(request.headers.get("authorization"))
            if not is_json_media_type(request.headers.get("content-type")):
                raise GatewayError(Cause.BAD_REQUEST, UNSUPPORTED_MEDIA_TYPE)
            body = await read_body(
                request.receive, request.headers.get("content-length"), self.limits.max_body_bytes
            )
            model, adapter = requested_model(
                body, gw.models, gw.registry.adapter_models(), gw.adapter_resolver
            )
            gw.limiter.admit(key, 0, gw.clock())
            response = await self._forward(path, body, model, request_id, adapter)
        except GatewayError as err:
            gw.metrics.rejections.labels(err.reason).inc()
            response = err.to_response(request_id)
        except ClientDisconnect:
            response = Response(status_code=CLIENT_CLOSED_STATUS)
        gw.metrics.tokenizer_requests.labels(path, model, str(response.status_code)).inc()
        return response

    async def _forward(
        self, path: str, body: bytes, model: str, request_id: str, adapter: str | None = None
    ) -> Response:
        gw = self.gw
        workers = candidates(gw.registry.view().workers, model, adapter)
        if not workers:
            raise GatewayError(
                Cause.NO_WORKER, f"No ready worker serves `{model}` now; retry shortly.", retry_after_s=1
            )
        last: Response | None = None
        timed_out = False
        for worker in workers[: self.limits.max_retries + 1]:
            auth = self.worker_auth.get(worker.pool)
            headers = upstream_headers(request_id)
            try:
                resp = await gw.dispatcher.upstream.post(
                    worker.url, path, body, headers if auth is None else [*headers, auth]
                )
                try:
                    content = await resp.aread()
                finally:
                    await resp.aclose()
            except (httpx.HTTPError, TimeoutError) as exc:
                timed_out = "timeout" in blame(gw.registry, worker.id, exc)
                continue
            status = resp.status_code
            answer = PassthroughResponse(
                content,
                status,
                request_id,
                resp.headers.get("content-type", "application/json"),
                resp.headers.get("retry-after"),
            )
            if status >= 500:
                gw.registry.report_failure(worker.id, f"status_{status}")
            else:
                gw.registry.report_success(worker.id)  # a 4xx is the body's fault, and 429 is busy
            if status not in RETRYABLE_STATUSES and status < 500:
                return answer
            last = answer
        if last is not None:
            return last
        if timed_out:
            raise GatewayError(Cause.UPSTREAM_TIMEOUT, "The worker did not answer in time.")
        raise GatewayError(Cause.UPSTREAM_UNAVAILABLE, "No worker could be reached.")
