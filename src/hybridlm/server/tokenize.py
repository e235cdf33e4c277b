"""vLLM's `POST /tokenize` and `POST /detokenize`, for clients that count tokens themselves: a prompt
(text, or chat messages rendered as `/v1/chat/completions` renders them) to the ids the engine would
see, and ids back to text."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict

from hybridlm.engine import InvalidParameter
from hybridlm.server.chat import effort_kwargs, plan_and_encode
from hybridlm.server.context import ServerContext
from hybridlm.server.protocol import APIError


class TokenizeRequest(BaseModel):
    """`prompt` (text) or `messages` (a chat, with `tools`, `add_generation_prompt`,
    `chat_template_kwargs` and `reasoning_effort` as chat completions take them)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add `/tokenize` and `/detokenize` to `app`."""

    def check(model: str | None) -> None:
        if model is not None and model != ctx.model_name:
            message = f"the model {model!r} does not exist; this server serves {ctx.model_name!r}"
            raise APIError(404, message, type="not_found_error", param="model", code="model_not_found")
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")

    def encode(body: TokenizeRequest) -> list[int]:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt or messages", param="prompt")
        if body.prompt is not None:
            return ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        try:
            kwargs = effort_kwargs(body.reasoning_effort) | (body.chat_template_kwargs or {})
            args = (body.messages, body.tools, None, None, None, kwargs, body.add_generation_prompt)
            return plan_and_encode(ctx.tokenizer, *args)[1]
        except InvalidParameter as e:
            raise APIError(400, str(e), param=e.param) from None

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await ctx.parse(request, TokenizeRequest)
        check(body.model)
        ids = await ctx.offload(encode, body)
        strs = (
            [ctx.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
            if body.return_token_strs
            else None
        )
        return {
            "count": len(ids),
            "max_model_len": ctx.engine.context_length,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await ctx.parse(request, DetokenizeRequest)
        check(body.model)
        vocab = ctx.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})", param="tokens"
            )
        return {"prompt": await ctx.offload(ctx.tokenizer.decode, body.tokens)}
