"""The OpenAI-compatible HTTP server: `create_app(engine, model_name)` and `serve(...)` under uvicorn.

The event loop never runs the model: handlers tokenize, submit to the engine's queue and relay its
events (handed over with `loop.call_soon_threadsafe`), so a slow or broken request cannot stall
another. Every error leaves in OpenAI's shape; a client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
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
    Usage,
)
from hybridlm.engine.request import CANCELLED, ERROR
from hybridlm.server import anthropic, errors, metrics, ollama, responses, tokenize
from hybridlm.server.bounded import BoundedTokenizer
from hybridlm.server.context import ServerContext
from hybridlm.server.lifecycle import DrainingServer, OpenConnections, timed_protocol
from hybridlm.server.middleware import CountResponses, LimitBody, LimitConnections, RequireKey
from hybridlm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    Responder,
    chat_prompt,
    decode_body,
    openapi_schema,
    request_body,
    total_usage,
)

log = logging.getLogger(__name__)


def _json_line(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def offload(fn, /, *args, **kwargs):
    """`fn(*args, **kwargs)` on a worker thread. Handlers run every step whose cost grows with the
    request (JSON decoding, chat-template rendering, tokenization: seconds for a 16 MiB prompt) through
    it, so the event loop keeps answering /health and relaying streams meanwhile."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@dataclass
class Limits:
    """What one request may cost the server. max_body: bytes of a request body (413 beyond);
    read_timeout: seconds to receive a request head, and each part of its body (then the connection
    is closed / 408); max_connections: open connections served at once (a request arriving on one
    beyond gets 503; None: no bound)."""

    max_body: int = 16 << 20
    read_timeout: float = 30.0
    max_connections: int | None = 256


def create_app(
    engine: Engine, model_name: str, api_key: str | None = None, limits: Limits | None = None
) -> FastAPI:
    """The ASGI app serving `engine` as model `model_name`; with `api_key`, every path except
    `/health` needs `Authorization: Bearer <api_key>`."""
    limits = limits or Limits()
    app = FastAPI(title="hybridlm", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False  # set by `serve` on a stop signal
    app.state.connections = OpenConnections()  # counted by the protocol `serve` runs
    stats = metrics.Metrics(engine, model_name)
    route_paths: set[str] = set()  # filled once every route is defined
    # Added innermost first: counting sees every response, the key is checked before a body is read.
    app.add_middleware(LimitBody, max_bytes=limits.max_body, timeout=limits.read_timeout)
    app.add_middleware(RequireKey, api_key=api_key)
    connections = app.state.connections
    limit = limits.max_connections
    app.add_middleware(LimitConnections, open_connections=lambda: connections.count, limit=limit)
    app.add_middleware(CountResponses, count=stats.count, paths=route_paths)
    # Every route tokenizes through it: a text that cannot fit the context is refused untokenized.
    tokenizer = engine.tokenizer and BoundedTokenizer(engine.tokenizer, engine.context_length)
    started = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(errors.body(request.url.path, e), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return await api_error(request, APIError(e.status_code, str(e.detail), type=kind, headers=e.headers))

    async def parse(request: Request, model: type[BaseModel]):
        """The JSON body as `model` (whatever the Content-Type says, as curl users often omit it)."""
        return await offload(decode_body, await request.body(), model)

    def check_common(body, prompt_param: str) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
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

    async def submit(prompt_ids: list[int], params: SamplingParams, prompt_param: str) -> AsyncStream:
        if app.state.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        # The engine validates every prompt id: off the loop, as tokenizing is. A handler cancelled
        # meanwhile (its client went away) cancels the request once it is queued.
        queued = asyncio.ensure_future(
            offload(AsyncStream, engine, prompt_ids, params, asyncio.get_running_loop())
        )
        try:
            return await asyncio.shield(queued)
        except asyncio.CancelledError:
            queued.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().cancel())
            raise
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

    async def collect(stream: AsyncStream, request: Request) -> tuple[Completion, bool]:
        """All events of a non-streaming request (n = 1), and whether the client went away (which
        cancels it)."""
        results, gone = await collect_choices(stream, request)
        return results[0], gone

    async def collect_choices(stream: AsyncStream, request: Request) -> tuple[list[Completion], bool]:
        """Each choice's events of a non-streaming request, by index, and whether the client went
        away (which cancels it)."""
        gone = False

        async def watch_disconnect() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            stream.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            results = [Completion() for _ in range(stream.request.params.n)]
            async for event in stream:
                results[event.index].add(event)
            return results, gone
        finally:
            watcher.cancel()
            stream.cancel()  # no-op when finished; stops the engine if this handler was cancelled

    async def sse(
        stream: AsyncStream, responder: Responder, want_logprobs: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """OpenAI's chunk stream, ending with `data: [DONE]`: each chunk carries one choice (its
        `index`); the usage chunk (summed over the choices) follows the last choice's end. Closing it
        (client gone) cancels the request, every choice."""
        try:
            n = stream.request.params.n
            if responder.kind == "chat":
                for index in range(n):
                    first = {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield _json_line(responder.chunk([first], with_usage=include_usage))
            text_offsets = [0] * n
            usages: dict[int, Usage] = {}
            async for event in stream:
                if event.finish_reason == ERROR:
                    yield _json_line(
                        APIError(500, event.error or "generation failed", type="server_error").body()
                    )
                    break
                if event.text or event.finished or (want_logprobs and event.logprobs):
                    choice = responder.delta_choice(event, want_logprobs, text_offsets[event.index])
                    if choice is not None:
                        yield _json_line(responder.chunk([choice], with_usage=include_usage))
                    text_offsets[event.index] += len(event.text)
                if event.finished:
                    usages[event.index] = event.usage
                    if include_usage and len(usages) == n:
                        usage = total_usage([usages[i] for i in range(n)])
                        yield _json_line(responder.chunk([], usage=usage, with_usage=True))
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
        stream = await submit(prompt_ids, params, prompt_param)
        want_logprobs = params.logprobs is not None
        if body.stream:
            return StreamingResponse(
                sse(stream, responder, want_logprobs, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        results, gone = await collect_choices(stream, request)
        reasons = {r.finish_reason for r in results}
        if ERROR in reasons:
            error = next(r.error for r in results if r.finish_reason == ERROR)
            raise APIError(500, error or "generation failed", type="server_error")
        if CANCELLED in reasons and gone:
            # Nobody reads this answer; 499 (nginx's "client closed request") counts it as what it is.
            log.info("event=client_disconnected request=%d", stream.request.id)
            return Response(status_code=499)
        if CANCELLED in reasons:
            raise APIError(503, "the request was cancelled (server shutting down)", type="server_error")
        return JSONResponse(responder.response(results, want_logprobs))

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
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
        plan, ids = await offload(chat_prompt, tokenizer, body)
        responder = Responder("chat", model_name, tokenizer, plan)
        return await respond(responder, body, ids, plan.params(params), "messages", request)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
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
            prompt = await offload(tokenizer.encode, prompt, add_special_tokens=True)
        return await respond(
            Responder("completion", model_name, tokenizer), body, prompt, params, "prompt", request
        )

    context = ServerContext(engine, tokenizer, model_name, parse, submit, collect, offload)
    anthropic.register(app, context)
    ollama.register(app, context)
    app.state.responses = responses.register(app, context)
    tokenize.register(app, context)

    @app.get("/v1/models")
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
        problem = "draining" if app.state.draining else engine.health_problem()
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(stats.render(), media_type=metrics.CONTENT_TYPE)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi():
        return app.openapi()

    app.openapi = lambda: openapi_schema(app, model_name, (responses.ResponsesRequest,))
    route_paths.update(route.path for route in app.routes)
    return app


def serve(
    engine: Engine,
    model_name: str,
    sock: socket.socket,
    api_key: str | None = None,
    graceful_timeout: float = 30.0,
    limits: Limits | None = None,
    announce: Callable[[], None] | None = None,
) -> None:
    """Serve on the listening socket `sock` (`lifecycle.listen`) until SIGTERM / SIGINT, then drain
    (`lifecycle.DrainingServer`: at most `graceful_timeout` seconds), close the engine and return.
    `announce()` runs once the server accepts connections."""
    limits = limits or Limits()
    level = logging.getLogger("hybridlm").getEffectiveLevel()
    app = create_app(engine, model_name, api_key, limits)
    config = uvicorn.Config(
        app,
        log_level=level,
        access_log=level <= logging.INFO,
        # Counts connections for `LimitConnections` (uvicorn's limit_concurrency stays off: its 503
        # is plain text that the app never sees).
        http=timed_protocol(limits.read_timeout, app.state.connections),
        # The drain has let every response finish: what remains are idle connections to close.
        timeout_graceful_shutdown=1.0,
    )
    draining = lambda on: setattr(app.state, "draining", on)
    server = DrainingServer(config, engine, graceful_timeout, draining, announce)
    # uvicorn handles the signals while it serves and, once shut down, re-raises the one it caught to
    # the handler that was installed before; this one takes it, so the engine closes and we return.
    stopping = (signal.SIGINT, signal.SIGTERM)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in stopping} if in_main else {}
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        if engine.prefix is not None:
            # Keep what the cache holds for the next start over the same --cache-dir.
            engine.prefix.persist()
            app.state.responses.save()
            if engine.prefix.store is not None:
                engine.prefix.store.close()  # queued writes land (at most a few seconds)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
