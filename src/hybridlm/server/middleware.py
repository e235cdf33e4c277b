"""Pure ASGI middleware around every route: response counting and the last line of error handling.

Pure ASGI (no `BaseHTTPMiddleware`) so streamed responses pass through chunk by chunk.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Callable

from hybridlm.server import errors
from hybridlm.server.protocol import APIError

log = logging.getLogger("hybridlm.server")


async def send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """A whole JSON response through ASGI `send`."""
    data = json.dumps(body).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*start, *headers]})
    await send({"type": "http.response.body", "body": data})


class CountResponses:
    """Counts every response by endpoint and status (`count(endpoint, status)`), and answers an
    unhandled error itself: a 500 in OpenAI's shape, or — when the response had already started —
    the end of its body. It never re-raises, so the server neither drops the keep-alive connection
    nor logs the error twice. `paths`: the routes counted by name (others count as "other")."""

    def __init__(self, app, count: Callable[[str, int], None], paths: set[str]):
        self.app = app
        self.count = count
        self.paths = paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.paths else "other"
        started = ended = False

        async def counting_send(message):
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
                self.count(endpoint, message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as e:
            log.exception("event=unhandled_error path=%s", scope["path"])
            if not started:
                error = APIError(500, f"internal error: {type(e).__name__}", type="server_error")
                await send_json(counting_send, 500, errors.body(scope["path"], error))
            elif not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class RequireKey:
    """With an API key, every path but `open_paths` needs `Authorization: Bearer <key>` or, as
    Anthropic's clients send it, `x-api-key: <key>` (401 otherwise, before the body is read)."""

    def __init__(self, app, api_key: str | None, open_paths: frozenset[str] = frozenset({"/health"})):
        self.app = app
        self.key = None if api_key is None else api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.key is not None and scope["path"] not in self.open_paths:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if b"x-api-key" in headers:
                scheme, token = b"bearer", headers[b"x-api-key"]
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(
                    401,
                    "missing or invalid API key (send Authorization: Bearer <key>)",
                    code="invalid_api_key",
                )
                body = errors.body(scope["path"], error)
                return await send_json(send, 401, body, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class LimitConnections:
    """With more than `limit` connections open (`open_connections()`), a request is answered 503 at
    once, in its API's error shape, with `Retry-After: 1` and the connection closed. (uvicorn's own
    `limit_concurrency` answers plain text, outside the app, so /metrics would not count it.)"""

    def __init__(self, app, open_connections: Callable[[], int], limit: int | None):
        self.app = app
        self.open_connections = open_connections
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.limit is not None and self.open_connections() > self.limit:
            error = APIError(
                503,
                f"too many connections: this server serves at most {self.limit} at once; retry shortly",
                type="server_error",
                code="too_many_connections",
            )
            headers = [(b"retry-after", b"1"), (b"connection", b"close")]
            return await send_json(send, 503, errors.body(scope["path"], error), headers)
        await self.app(scope, receive, send)


class LimitBody:
    """Request bodies of at most `max_bytes` (413 beyond: at once when Content-Length says so, else as
    soon as the bytes received pass it), each part arriving within `timeout` seconds of the last
    (408 otherwise: a client trickling its body does not hold a handler forever)."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    def too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body exceeds this server's limit of {self.max_bytes} bytes",
            code="body_too_large",
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = errors.body(scope["path"], self.too_large())
            return await send_json(send, 413, body, [(b"connection", b"close")])
        received, complete = 0, False

        async def limited_receive():
            nonlocal received, complete
            if complete:  # e.g. waiting for a disconnect while generating: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                raise APIError(
                    408, f"the request body did not arrive within {self.timeout:g} s", code="timeout"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self.too_large()
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)
