"""What the OpenAI app hands the other APIs' routers (Anthropic, ollama), so that every API submits
through the same engine path, with the same checks and the same error mapping."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from hybridlm.engine import AsyncStream, Completion, Engine, SamplingParams
from hybridlm.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServerContext:
    """engine / tokenizer / model_name: what is served. parse(request, model): the JSON body as a
    pydantic model (APIError 400 naming the field). submit(prompt_ids, params, prompt_param): an
    `AsyncStream`, awaited (validated off the loop; APIError 400 / 429 / 503). collect(stream,
    request): the whole `Completion` and whether the client went away (which cancels it).
    offload(fn, *args): `fn(*args)` off the event loop (rendering and tokenization grow with the
    request)."""

    engine: Engine
    tokenizer: Tokenizer | None
    model_name: str
    parse: Callable[[Request, Any], Awaitable[Any]]
    submit: Callable[[list[int], SamplingParams, str], Awaitable[AsyncStream]]
    collect: Callable[[AsyncStream, Request], Awaitable[tuple[Completion, bool]]]
    offload: Callable[..., Awaitable[Any]]
