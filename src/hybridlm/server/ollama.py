"""ollama's API: `/api/chat`, `/api/generate` (NDJSON streaming by default, `options` mapped to
sampling parameters, `tools`, `format` as "json" or a JSON schema), `/api/tags`, `/api/show`,
`/api/version`. Chats render through the same chat template and engine path as the other APIs.
Errors leave as `{"error": "..."}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from hybridlm import __version__
from hybridlm.engine import InvalidParameter, SamplingParams
from hybridlm.engine.grammar import Grammar
from hybridlm.engine.request import CANCELLED, ERROR, LENGTH
from hybridlm.server import errors
from hybridlm.server.chat import ChatPlan, plan_and_encode, read_answer, response_grammar, tool_result_text
from hybridlm.server.context import ServerContext
from hybridlm.server.protocol import APIError

PREFIX = errors.OLLAMA_PREFIX

# ollama option -> SamplingParams field
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    think: bool | None = None


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Request):
    prompt: str = ""
    system: str | None = None
    raw: bool = False


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None  # older clients


def sampling_params(options: dict[str, Any] | None) -> SamplingParams:
    given = {}
    for key, value in (options or {}).items():
        if key in _OPTIONS and value is not None:
            given[_OPTIONS[key]] = value
    limit = given.get("max_tokens")
    # ollama's "until done" (-1, -2); any other value, of any type, is SamplingParams' to judge.
    if isinstance(limit, int) and not isinstance(limit, bool) and limit < 0:
        del given["max_tokens"]
    try:
        return SamplingParams(**given)
    except InvalidParameter as e:
        option = next((k for k, v in _OPTIONS.items() if v == e.param), e.param)
        raise APIError(400, f"options.{option}: {e}", param=None) from None


def response_format(fmt: str | dict | None) -> dict[str, Any] | None:
    """ollama's `format` as an OpenAI response_format."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise APIError(400, 'format must be "json" or a JSON schema', param="format")


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ollama messages (arguments as objects, no call ids, `thinking`) as OpenAI-shaped ones."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidParameter("messages", f"messages[{i}] must have a role")
        if message.get("images"):
            raise InvalidParameter("messages", f"messages[{i}]: images are not supported by this model")
        turn: dict[str, Any] = {"role": message["role"], "content": message.get("content", "")}
        if message["role"] == "tool":
            turn["content"] = tool_result_text(turn["content"])
        if isinstance(message.get("thinking"), str):
            turn["reasoning_content"] = message["thinking"]
        calls = []
        for j, call in enumerate(message.get("tool_calls") or []):
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            args = fn.get("arguments", {})
            if not isinstance(fn.get("name"), str):
                raise InvalidParameter("messages", f"messages[{i}].tool_calls[{j}] needs function.name")
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append(
                {
                    "id": f"call_{i}_{j}",
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments},
                }
            )
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _stats(result_usage, timings, finish: str | None) -> dict[str, Any]:
    ns = lambda ms: int((ms or 0.0) * 1e6)
    return {
        "done": True,
        "done_reason": "length" if finish == LENGTH else "stop",
        "total_duration": ns(timings.total_ms if timings else 0),
        "load_duration": 0,
        "prompt_eval_count": result_usage.prompt_tokens if result_usage else 0,
        "prompt_eval_duration": ns(timings.prefill_ms if timings else 0),
        "eval_count": result_usage.completion_tokens if result_usage else 0,
        "eval_duration": ns(timings.decode_ms if timings else 0),
    }


def _message(answer_content: str | None, reasoning: str | None, calls) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer_content or ""}
    if reasoning:
        message["thinking"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls
        ]
    return message


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add ollama's endpoints to `app`."""
    modified = _now()

    def check_model(name: str | None) -> None:
        if name is not None and name not in (ctx.model_name, ctx.model_name + ":latest"):
            raise APIError(404, f"model '{name}' not found", param=None)

    def need_tokenizer() -> None:
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot take text", param=None)

    def plan(messages, tools, fmt, think) -> tuple[ChatPlan, list[int]]:
        """The chat plan and prompt ids (APIError 400 naming the field). Blocking."""
        kwargs = {"enable_thinking": think} if think is not None else {}
        try:
            return plan_and_encode(
                ctx.tokenizer, openai_messages(messages), tools, None, None, response_format(fmt), kwargs
            )
        except InvalidParameter as e:
            raise APIError(400, str(e), param=e.param) from None

    def raw_plan(prompt: str, fmt) -> tuple[ChatPlan, list[int]]:
        """`/api/generate` with `raw`: the prompt as it is (BOS added as the checkpoint wants)."""
        try:
            body = response_grammar(response_format(fmt), "format")
        except InvalidParameter as e:
            raise APIError(400, str(e), param=e.param) from None
        grammar = Grammar("lark", f"start: {body}\n", "format") if body is not None else None
        return ChatPlan(prompt, grammar=grammar), ctx.tokenizer.encode(prompt, add_special_tokens=True)

    async def ndjson(stream, chat: ChatPlan, key: str) -> AsyncIterator[bytes]:
        """One JSON object per line; the last has done: true and the counts."""
        parser = chat.stream()
        try:
            async for event in stream:
                if event.finish_reason in (ERROR, CANCELLED):
                    yield json.dumps({"error": event.error or "generation failed"}).encode() + b"\n"
                    return
                parts = parser.feed(event.text) if event.text else []
                if event.finished:
                    parts += parser.close()
                text = "".join(p.text for p in parts if p.kind == "content")
                thinking = "".join(p.text for p in parts if p.kind == "reasoning")
                calls = [p.call for p in parts if p.kind == "tool_call"]
                line: dict[str, Any] = {"model": ctx.model_name, "created_at": _now()}
                if key == "message":
                    line["message"] = _message(text, thinking, calls)
                else:
                    line["response"] = text
                    if thinking:
                        line["thinking"] = thinking
                if event.finished:
                    line |= _stats(event.usage, event.timings, event.finish_reason)
                elif not (text or thinking or calls):
                    continue
                else:
                    line["done"] = False
                yield json.dumps(line, ensure_ascii=False).encode() + b"\n"
        finally:
            stream.cancel()

    async def answer(request: Request, stream, chat: ChatPlan, key: str, want_stream: bool):
        if want_stream:
            return StreamingResponse(ndjson(stream, chat, key), media_type="application/x-ndjson")
        result, gone = await ctx.collect(stream, request)
        if result.finish_reason == ERROR:
            raise APIError(500, result.error or "generation failed", param=None)
        if result.finish_reason == CANCELLED and gone:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        if result.finish_reason == CANCELLED:
            raise APIError(503, "the request was cancelled (server shutting down)", param=None)
        parsed = read_answer(chat, result.text)
        body: dict[str, Any] = {"model": ctx.model_name, "created_at": _now()}
        if key == "message":
            body["message"] = _message(parsed.content, parsed.reasoning, parsed.calls)
        else:
            body["response"] = parsed.content or ""
            if parsed.reasoning:
                body["thinking"] = parsed.reasoning
        return JSONResponse(body | _stats(result.usage, result.timings, result.finish_reason))

    @app.post("/api/chat")
    async def chat(request: Request):
        body = await ctx.parse(request, ChatRequest)
        check_model(body.model)
        need_tokenizer()
        params = sampling_params(body.options)
        chat_plan, ids = await ctx.offload(plan, body.messages, body.tools, body.format, body.think)
        stream = await ctx.submit(ids, chat_plan.params(params), "messages")
        return await answer(request, stream, chat_plan, "message", body.stream)

    @app.post("/api/generate")
    async def generate(request: Request):
        body = await ctx.parse(request, GenerateRequest)
        check_model(body.model)
        need_tokenizer()
        params = sampling_params(body.options)
        if body.raw:
            chat_plan, ids = await ctx.offload(raw_plan, body.prompt, body.format)
        else:
            messages = [{"role": "system", "content": body.system}] if body.system else []
            messages.append({"role": "user", "content": body.prompt})
            chat_plan, ids = await ctx.offload(plan, messages, None, body.format, body.think)
        stream = await ctx.submit(ids, chat_plan.params(params), "prompt")
        return await answer(request, stream, chat_plan, "response", body.stream)

    def card() -> dict[str, Any]:
        return {
            "name": ctx.model_name + ":latest",
            "model": ctx.model_name + ":latest",
            "modified_at": modified,
            "size": sum(p.numel() * p.element_size() for p in ctx.engine.model.parameters()),
            "digest": "",
            "details": {
                "format": "safetensors",
                "family": str(ctx.engine.model.config.get("model_type", "")),
                "parameter_size": str(sum(p.numel() for p in ctx.engine.model.parameters())),
                "quantization_level": "",
            },
        }

    @app.get("/api/tags")
    async def tags():
        return {"models": [card()]}

    @app.post("/api/show")
    async def show(request: Request):
        body = await ctx.parse(request, ShowRequest)
        check_model(body.model or body.name)
        template = ctx.tokenizer.chat_template if ctx.tokenizer is not None else None
        capabilities = ["completion"] + (["tools"] if template and "tool" in str(template) else [])
        return {
            "modelfile": "",
            "parameters": "",
            "template": template if isinstance(template, str) else "",
            "details": card()["details"],
            "model_info": {"context_length": ctx.engine.context_length},
            "capabilities": capabilities,
            "modified_at": modified,
        }

    @app.get("/api/version")
    async def version():
        return {"version": __version__}
