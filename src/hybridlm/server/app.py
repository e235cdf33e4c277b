"""The OpenAI-compatible HTTP server: `create_app(engine, model_name)` and `serve(...)` under uvicorn.

The event loop never runs the model: handlers tokenize, submit to the engine's queue and relay its
events (handed over with `loop.call_soon_threadsafe`), so a slow or broken request cannot stall
another. Every error leaves in OpenAI's shape; a client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator

import jinja2
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridlm import __version__
from hybridlm.engine import (
    AsyncStream,
    Completion,
    Engine,
    EngineClosed,
    InvalidParameter,
    PromptTooLong,
    QueueFull,
    SamplingParams,
)
from hybridlm.engine.request import CANCELLED, ERROR
from hybridlm.server import metrics
from hybridlm.server.middleware import CountResponses
from hybridlm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Responder,
    render_chat,
)

log = logging.getLogger(__name__)


def _json_line(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def create_app(engine: Engine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The ASGI app serving `engine` as model `model_name`; with `api_key`, every endpoint except
    `/health` needs `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="hybridlm", version=__version__, docs_url=None, redoc_url=None)
    stats = metrics.Metrics(engine, model_name)
    route_paths: set[str] = set()  # filled once every route is defined
    app.add_middleware(CountResponses, count=stats.count, paths=route_paths)
    tokenizer = engine.tokenizer
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return await api_error(request, APIError(e.status_code, str(e.detail), type=kind, headers=e.headers))

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key (send Authorization: Bearer <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def parse(request: Request, model: type[BaseModel]):
        """The JSON body as `model` (whatever the Content-Type says, as curl users often omit it)."""
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        try:
            return model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = str(first["loc"][0]) if first["loc"] else None  # the top-level field, as OpenAI names it
            raise APIError(400, f"{param or 'body'}: {first['msg']}", param=param) from None

    def check_common(body, prompt_param: str) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        if body.n not in (None, 1):
            raise APIError(400, "only n = 1 is supported", param="n")
        if tokenizer is None and prompt_param == "messages":
            raise APIError(400, "this model has no tokenizer, so it cannot chat", param="messages")

    def invalid(e: InvalidParameter, param: str, code: str | None = None) -> APIError:
        """The engine names its own parameter; the request may have called it otherwise."""
        message = str(e)
        if message.startswith(e.param):
            message = param + message[len(e.param) :]
        return APIError(400, message, param=param, code=code)

    def sampling_params(body, max_tokens, logprobs, renames: dict[str, str]) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except InvalidParameter as e:
            raise invalid(e, renames.get(e.param, e.param)) from None

    def submit(prompt_ids: list[int], params: SamplingParams, prompt_param: str) -> AsyncStream:
        try:
            return AsyncStream(engine, prompt_ids, params)
        except PromptTooLong as e:
            raise invalid(e, prompt_param, "context_length_exceeded") from None
        except InvalidParameter as e:
            raise invalid(e, prompt_param if e.param == "prompt" else e.param) from None
        except QueueFull as e:
            raise APIError(
                429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}
            ) from None
        except EngineClosed as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None

    async def collect(stream: AsyncStream, request: Request) -> Completion:
        """All events of a non-streaming request; a client disconnect cancels it."""

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            stream.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            result = Completion()
            async for event in stream:
                result.add(event)
            return result
        finally:
            watcher.cancel()
            stream.cancel()  # no-op when finished; stops the engine if this handler was cancelled

    async def sse(
        stream: AsyncStream, responder: Responder, want_logprobs: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """OpenAI's chunk stream, ending with `data: [DONE]`. Closing it (client gone) cancels the request."""
        try:
            if responder.kind == "chat":
                first = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _json_line(responder.chunk([first], with_usage=include_usage))
            text_offset = 0
            async for event in stream:
                if event.finish_reason == ERROR:
                    yield _json_line(
                        APIError(500, event.error or "generation failed", type="server_error").body()
                    )
                    break
                if event.text or event.finished or (want_logprobs and event.logprobs):
                    choice = responder.delta_choice(event, want_logprobs, text_offset)
                    yield _json_line(responder.chunk([choice], with_usage=include_usage))
                    text_offset += len(event.text)
                if event.finished and include_usage:
                    yield _json_line(responder.chunk([], usage=event.usage, with_usage=True))
            yield b"data: [DONE]\n\n"
        finally:
            stream.cancel()

    async def respond(
        responder: Responder,
        body,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_param: str,
        request: Request,
    ):
        stream = submit(prompt_ids, params, prompt_param)
        want_logprobs = params.logprobs is not None
        if body.stream:
            return StreamingResponse(
                sse(stream, responder, want_logprobs, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result = await collect(stream, request)
        if result.finish_reason == ERROR:
            raise APIError(500, result.error or "generation failed", type="server_error")
        if result.finish_reason == CANCELLED:
            raise APIError(503, "the request was cancelled (server shutting down)", type="server_error")
        return JSONResponse(responder.response(result, want_logprobs))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request):
        body = await parse(request, ChatCompletionRequest)
        check_common(body, "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        renames = {"logprobs": "top_logprobs"}
        max_tokens = body.max_tokens
        if body.max_completion_tokens is not None:
            max_tokens, renames["max_tokens"] = body.max_completion_tokens, "max_completion_tokens"
        params = sampling_params(
            body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None, renames
        )
        try:
            prompt = render_chat(tokenizer, body)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = tokenizer.encode(prompt)
        return await respond(Responder("chat", model_name, tokenizer), body, ids, params, "messages", request)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        check_common(body, "prompt")
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        params = sampling_params(body, body.max_tokens, body.logprobs, {})
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(
                    400, "send one prompt per request (batched prompts are not supported)", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tokenizer is None:
                raise APIError(
                    400, "this model has no tokenizer; send the prompt as token ids", param="prompt"
                )
            prompt = tokenizer.encode(prompt, add_special_tokens=True)
        return await respond(
            Responder("completion", model_name, tokenizer), body, prompt, params, "prompt", request
        )

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "hybridlm",
            "max_model_len": engine.context_length,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def prometheus():
        return Response(stats.render(), media_type=metrics.CONTENT_TYPE)

    route_paths.update(route.path for route in app.routes)
    return app


def serve(
    engine: Engine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    graceful_timeout: float = 30.0,
) -> None:
    """Serve until SIGTERM / SIGINT: then stop accepting, let running responses finish (at most
    `graceful_timeout` seconds, then cancel them), close the engine and return."""
    level = logging.getLogger("hybridlm").getEffectiveLevel()
    config = uvicorn.Config(
        create_app(engine, model_name, api_key),
        host=host,
        port=port,
        log_level=level,
        access_log=level <= logging.INFO,
        timeout_graceful_shutdown=graceful_timeout,
    )
    server = uvicorn.Server(config)
    # uvicorn handles the signals while it serves and, once shut down, re-raises the one it caught to
    # the handler that was installed before; this one takes it, so the engine closes and we return.
    stopping = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stopping} if in_main else {}
    try:
        server.run()
    finally:
        engine.close()
        if engine.prefix is not None:
            # Keep what the cache holds for the next start over the same --cache-dir.
            engine.prefix.persist()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
