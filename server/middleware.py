"""Pure ASGI middleware: the request-body cap (413) and the API key (401)."""

from __future__ import annotations

import hmac
import json

from server.errors import error_body

# Deny by default: with a key set, every path needs it except these (a route added later is guarded).
# The chat page's static files are public too (no secret in them; the page asks for the key).
PUBLIC_PATHS = frozenset({"/health", "/version", "/openapi.json", "/", "/static/chat.js", "/static/chat.css"})


async def _send_error(send, status: int, message: str, headers: tuple = ()) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 when Content-Length or the bytes actually received exceed `max_bytes`.

    The body is read here (up to the cap) and replayed to the app; later
    `receive()` calls (disconnect polling) go straight to the server.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = f"request body exceeds the {self.max_bytes}-byte limit"
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, too_big)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _send_error(send, 413, too_big)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches, on every path but PUBLIC_PATHS (/v1/*, /tokenize,
    /detokenize, /metrics, unknown routes)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            message = "missing API key" if not given else "invalid API key"
            return await _send_error(send, 401, message, ((b"www-authenticate", b"Bearer"),))
        await self.app(scope, receive, send)
