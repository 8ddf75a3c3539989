"""`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`, forwarded to the worker that stores the
response (`server.response_store`: the gateway remembers which worker served each response id).

After the gateway's checks (draining 503, API key 401, requests/s limit 429), an id the gateway does not
know — never served here, forgotten past `responses.affinity_*`, or its worker gone from the fleet (the
stored response went with it) — is 404 in vLLM's words (`Response with id '...' not found.`); otherwise the
request goes to that worker with the gateway's request id, the query string kept (`starting_after`,
`stream`), and its answer passes through unchanged (vLLM's 404 for a response it did not store, its 400 for
cancelling a synchronous one). No retry elsewhere: no other worker has it. A worker that cannot be reached
is 502 (504 on a time-out); its breaker hears of it. `GET ...?stream=true` (replaying a stored response as
events) is answered whole, once the worker's stream ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import httpx
from starlette.requests import Request
from starlette.responses import Response

from server.errors import Cause, GatewayError, response_not_found, shutting_down
from server.failure import blame
from server.proxy import upstream_headers
from server.responses import PassthroughResponse

if TYPE_CHECKING:
    from server.gateway import Gateway


def stored_response_endpoint(
    gw: Gateway, method: str, suffix: str, request_id_key: str
) -> Callable[[Request], Awaitable[Response]]:
    """The route's endpoint: `method` `/v1/responses/{response_id}{suffix}` forwarded (module docstring)."""

    async def endpoint(request: Request) -> Response:
        rid = request.scope[request_id_key]
        response_id = request.path_params["response_id"]
        try:
            if gw.draining:
                raise shutting_down()
            key = gw.keys.authenticate(request.headers.get("authorization"))
            gw.limiter.admit(key, 0, gw.clock())
            return await _forward(gw, method, response_id, suffix, request.url.query, rid)
        except GatewayError as err:
            gw.metrics.rejections.labels(err.reason).inc()
            return err.to_response(rid)

    return endpoint


async def _forward(
    gw: Gateway, method: str, response_id: str, suffix: str, query: str, request_id: str
) -> Response:
    entry = gw.dispatcher.affinity.lookup(response_id, gw.clock())
    worker = gw.registry.get(entry.worker_id) if entry is not None else None
    if worker is None:
        raise response_not_found(response_id)
    path = f"/v1/responses/{response_id}{suffix}" + (f"?{query}" if query else "")
    headers = upstream_headers(request_id)
    auth = gw.dispatcher.worker_auth.get(worker.pool.name)
    limits = gw.config.limits
    try:
        resp = await gw.dispatcher.upstream.request(
            method, worker.url, path, headers if auth is None else [*headers, auth], limits.total_timeout_s
        )
        try:
            content = await resp.aread()
        finally:
            await resp.aclose()
    except (httpx.HTTPError, TimeoutError) as exc:
        kind = blame(gw.registry, worker.id, exc)
        cause = Cause.UPSTREAM_TIMEOUT if "timeout" in kind else Cause.UPSTREAM_UNAVAILABLE
        raise GatewayError(cause, f"The worker storing response '{response_id}' failed ({kind}).") from None
    if resp.status_code >= 500:
        gw.registry.report_failure(worker.id, f"status_{resp.status_code}")
    return PassthroughResponse(
        content,
        resp.status_code,
        request_id,
        resp.headers.get("content-type", "application/json"),
        resp.headers.get("retry-after"),
    )
