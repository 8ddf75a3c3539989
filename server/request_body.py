"""Reading a request's body from the ASGI channel within the gateway's size limit (413 otherwise), and the
JSON object the gateway's own endpoints take."""

from __future__ import annotations

import codecs
import json
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Receive

from server.errors import NOT_JSON, Cause, GatewayError


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The request body from the ASGI channel, refusing more than `limit` bytes (413) before (declared
    Content-Length) or while reading it. A client gone before the body ended → Starlette's `ClientDisconnect`."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(
            Cause.BODY_TOO_LARGE, f"Request body of {declared} bytes exceeds the {limit}-byte limit."
        )
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise GatewayError(Cause.BODY_TOO_LARGE, f"Request body exceeds the {limit}-byte limit.")
            parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A body that must be one JSON object (a UTF-8 byte-order mark accepted, as vLLM's json.loads accepts
    it); GatewayError (400) otherwise."""
    text = body[3:] if body.startswith(codecs.BOM_UTF8) else body
    try:
        data: Any = json.loads(text)
    except (*NOT_JSON, UnicodeDecodeError) as exc:  # (nested past the parser's recursion limit too)
        if isinstance(exc, json.JSONDecodeError):  # the proxy paths' message names the position too
            why = f": {exc}"
        elif isinstance(exc, UnicodeDecodeError):
            why = ": it is not UTF-8"
        elif isinstance(exc, RecursionError):
            why = ": it is nested too deeply"
        else:
            why = ""
        raise GatewayError(Cause.BAD_REQUEST, f"The request body is not valid JSON{why}.") from None
    if not isinstance(data, dict):
        raise GatewayError(Cause.BAD_REQUEST, "The request body must be a JSON object.")
    return data
