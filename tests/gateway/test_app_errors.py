"""The routes FastAPI serves (info, admin, unknown paths and methods) answer like the proxy endpoints do:
`X-Request-Id` echoed (or created), OpenAI's error shape, `Allow` on 405, and a 500 `InternalServerError`
for an error nobody handled — while the proxy POSTs still skip FastAPI's middleware stack (hot path)."""

from __future__ import annotations

import collections.abc
import re
from typing import Any

import httpx
import pytest

import server.app
from tests.gateway.fakes import FakeFleet, FakeWorker, config, pool
from tests.gateway.serverkit import GatewayThread

ADMIN = "sk-admin"
KEY = "sk-user"
CHAT = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def gw() -> collections.abc.Iterator[GatewayThread]:
    fleet = FakeFleet(FakeWorker("a"))
    cfg = config(
        pool("p", "L4", "mixed", fleet.workers["a"]), auth={"api_keys": [KEY], "admin_keys": [ADMIN]}
    )
    with GatewayThread(cfg, transport=fleet.transport) as thread:
        yield thread


def _http(gw: GatewayThread) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=10)


ROUTES = [
    pytest.param("GET", "/health", None, 200, id="health"),
    pytest.param("GET", "/ready", None, 200, id="ready"),
    pytest.param("GET", "/metrics", None, 200, id="metrics"),
    pytest.param("GET", "/v1/models", KEY, 200, id="models"),
    pytest.param("GET", "/v1/models", None, 401, id="models-401"),
    pytest.param("GET", "/admin/workers", ADMIN, 200, id="admin-workers"),
    pytest.param("GET", "/admin/routing", ADMIN, 200, id="admin-routing"),
    pytest.param("GET", "/admin/autoscaler", KEY, 401, id="admin-401"),
    pytest.param("GET", "/no/such/path", None, 404, id="404"),
    pytest.param("GET", "/v1/chat/completions", KEY, 405, id="405"),
    pytest.param("POST", "/v1/chat/completions", KEY, 200, id="proxy"),
]


@pytest.mark.parametrize(("method", "path", "key", "status"), ROUTES)
def test_every_route_echoes_the_request_id(
    gw: GatewayThread, method: str, path: str, key: str | None, status: int
) -> None:
    headers = {"X-Request-Id": "trace-42.a:b"} | ({"Authorization": f"Bearer {key}"} if key else {})
    with _http(gw) as http:
        sent = http.request(method, path, headers=headers, json=CHAT if method == "POST" else None)
        assert sent.status_code == status, sent.text
        assert sent.headers.get_list("x-request-id") == ["trace-42.a:b"]  # once, the client's
        made = http.request(
            method,
            path,
            headers={k: v for k, v in headers.items() if k != "X-Request-Id"},
            json=CHAT if method == "POST" else None,
        )
        assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])  # none sent: a new one


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/completions", "POST"),
        ("DELETE", "/v1/chat/completions", "POST"),
        ("POST", "/health", "GET"),
    ],
)
def test_405_says_which_methods_are_allowed(gw: GatewayThread, method: str, path: str, allow: str) -> None:
    with _http(gw) as http:
        answer = http.request(method, path)
    assert answer.status_code == 405
    assert answer.headers["allow"] == allow
    assert answer.json()["error"] == {
        "message": "Method Not Allowed",
        "type": "MethodNotAllowedError",
        "param": None,
        "code": 405,
    }


def test_an_unhandled_error_on_an_info_route_is_an_openai_500(
    gw: GatewayThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> bytes:
        raise RuntimeError("registry exploded")

    monkeypatch.setattr(gw.gateway.metrics, "render", broken)
    with _http(gw) as http:
        answer = http.get("/metrics", headers={"X-Request-Id": "boom-1"})
    assert answer.status_code == 500
    assert answer.headers["content-type"] == "application/json"  # before: text/plain "Internal Server Error"
    assert answer.headers["x-request-id"] == "boom-1"
    assert answer.json() == {
        "error": {
            "message": "Internal gateway error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }


def test_an_unhandled_error_on_the_proxy_path_is_a_500_not_a_502(
    gw: GatewayThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any) -> Any:
        raise RuntimeError("dispatcher exploded")

    monkeypatch.setattr(gw.gateway.dispatcher, "handle", broken)
    with _http(gw) as http:
        answer = http.post(
            "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "boom-2"},
        )
    assert answer.status_code == 500
    assert answer.headers["x-request-id"] == "boom-2"
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("InternalServerError", 500)  # before: BadGatewayError, 502


def test_the_proxy_path_skips_the_request_id_middleware(
    gw: GatewayThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path pays nothing for the middleware: the proxy POSTs never enter it."""
    entered: list[str] = []
    original = server.app.RequestIdMiddleware.__call__

    async def counting(self: Any, scope: Any, receive: Any, send: Any) -> None:
        entered.append(scope["path"])
        await original(self, scope, receive, send)

    monkeypatch.setattr(server.app.RequestIdMiddleware, "__call__", counting)
    with _http(gw) as http:
        proxied = http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"})
        assert proxied.status_code == 200 and proxied.headers["x-request-id"]
        assert entered == []
        assert http.get("/health").status_code == 200
    assert entered == ["/health"]


def test_router_rejects_answer_each_status_with_the_gateways_own_error_type() -> None:
    """One error `type` vocabulary: a router reject (REJECT_TABLE) and a gateway error (ERROR_TABLE) of the
    same status carry the same type (an unknown model was NotFoundError from the gateway's model check and
    invalid_request_error from the router, both 404 model_not_found)."""
    from scheduler.routing.reasons import REJECT_TABLE, FilterReason, Reject
    from server.errors import ERROR_TABLE, Cause

    gateway_type = dict(ERROR_TABLE.values())
    assert len(gateway_type) == len(set(ERROR_TABLE.values()))  # one type per status among the gateway's own
    for reason, rule in REJECT_TABLE.items():
        assert rule.error_type == gateway_type[rule.status], reason
        assert Reject.from_counts({reason: 1}).error_body()["error"]["type"] == gateway_type[rule.status]
    assert REJECT_TABLE[FilterReason.WRONG_MODEL].error_type == ERROR_TABLE[Cause.MODEL_NOT_FOUND][1]
