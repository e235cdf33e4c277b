"""Each API's error shape, picked by the request's path: Anthropic's
`{"type": "error", "error": {"type", "message"}}` under /v1/messages, ollama's `{"error": "..."}`
under /api/, OpenAI's `{"error": {"message", "type", "param", "code"}}` everywhere else."""

from __future__ import annotations

from typing import Any

from hybridlm.server.protocol import APIError

ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _message(e: APIError) -> str:
    """The message naming its field (OpenAI carries the field apart, in `param`)."""
    return f"{e.param}: {e.message}" if e.param and not e.message.startswith(e.param) else e.message


def body(path: str, e: APIError) -> dict[str, Any]:
    """`e` in the shape of the API that `path` belongs to."""
    if path.startswith(ANTHROPIC_PREFIX):
        kind = _ANTHROPIC_TYPES.get(e.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": _message(e)}}
    if path.startswith(OLLAMA_PREFIX):
        return {"error": _message(e)}
    return e.body()
