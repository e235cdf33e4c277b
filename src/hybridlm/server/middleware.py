"""Pure ASGI middleware around every route: response counting and the last line of error handling.

Pure ASGI (no `BaseHTTPMiddleware`) so streamed responses pass through chunk by chunk.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

log = logging.getLogger("hybridlm.server")


def error_body(message: str, type: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


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
                body = error_body(f"internal error: {type(e).__name__}", "server_error")
                await send_json(counting_send, 500, body)
            elif not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
