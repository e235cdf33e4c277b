"""Anthropic's Messages API: `POST /v1/messages` (system, text, `tool_use` / `tool_result` and
thinking blocks; streaming events in Anthropic's order) and `POST /v1/messages/count_tokens`.

Requests are translated into the OpenAI-shaped messages the chat template renders (`tool_use` →
assistant `tool_calls`, `tool_result` → `role: tool`, thinking → `reasoning_content`), so the same
conversation renders to the same prompt through either API and reuses the same prefix cache.
Errors leave as `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from hybridlm.engine import InvalidParameter, SamplingParams
from hybridlm.engine.request import CANCELLED, ERROR, LENGTH
from hybridlm.server import errors
from hybridlm.server.chat import ChatPlan, effort_kwargs, plan_and_encode, read_answer, tool_result_text
from hybridlm.server.context import ServerContext
from hybridlm.server.protocol import APIError, new_id

PREFIX = errors.ANTHROPIC_PREFIX
# Claude Code's first system block: `x-anthropic-billing-header: cc_version=...; cch=<nonce>;`
BILLING_HEADER = "x-anthropic-billing-header:"
USER_ROLES = {"ctx": "user", "msg": "user"}


class MessagesRequest(BaseModel):
    """The fields hybridlm reads (others are ignored, as clients send extras freely)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None


def _text(blocks: Any, where: str) -> str:
    """A string, or text blocks, as one string."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, block in enumerate(blocks if isinstance(blocks, list) else [blocks]):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise InvalidParameter(where, f"{where}[{i}]: only text blocks are supported here")
        parts.append(block["text"])
    return "".join(parts)


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    """The system prompt without Claude Code's billing header block: its `cch=` nonce changes every
    request, and rendered first it would leave no prefix for the cache to reuse."""
    if isinstance(system, list):
        system = [
            b
            for b in system
            if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))
        ]
    return None if system is None else _text(system, "system")


def _tool_result(block: dict[str, Any], where: str) -> str:
    """A tool_result's content as text; a `tool_reference` (what tool search returns) names the tool,
    which is offered with the others (hybridlm renders deferred tools too)."""
    inner = block.get("content", "")
    if not isinstance(inner, list):
        return tool_result_text(inner)
    parts = []
    for part in inner:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "tool_reference":
            parts.append({"type": "text", "text": f"Tool loaded: {part.get('tool_name', '')}"})
        elif kind == "text":
            parts.append(part)
        else:  # images, documents: this text model cannot read them
            raise InvalidParameter("messages", f"{where}: tool_result blocks of type {kind} unsupported")
    return tool_result_text(parts)


def openai_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI-shaped messages (what the chat template renders). `system` entries
    among the messages join the system prompt in order; `ctx` and `msg` entries are user turns (as
    vLLM maps them)."""
    out: list[dict[str, Any]] = []
    system = system_text(body.system)
    extra_system = []
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        role, content = message.get("role"), message.get("content")
        if role == "system":
            extra_system.append(_text(content, f"{where}.content"))
            continue
        role = USER_ROLES.get(role, role)
        if role not in ("user", "assistant"):
            raise InvalidParameter("messages", f'{where}.role must be "user", "assistant" or "system"')
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise InvalidParameter("messages", f"{where}.content must be a string or a list of blocks")
        text, thinking, calls = [], [], []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "thinking" and role == "assistant":
                thinking.append(str(block.get("thinking", "")))
            elif kind == "redacted_thinking" and role == "assistant":
                continue
            elif kind == "tool_use" and role == "assistant":
                args = block.get("input", {})
                if not isinstance(args, dict) or not isinstance(block.get("name"), str):
                    raise InvalidParameter(
                        "messages", f"{where}.content[{j}]: tool_use needs a name and an input"
                    )
                function = {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}
                calls.append({"id": str(block.get("id", "")), "type": "function", "function": function})
            elif kind == "tool_reference" and role == "user":
                text.append(f"Tool loaded: {block.get('tool_name', '')}")
            elif kind == "tool_result" and role == "user":
                result = _tool_result(block, f"{where}.content[{j}]")
                out.append(
                    {"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": result}
                )
            else:
                raise InvalidParameter("messages", f"{where}.content[{j}]: unsupported block type {kind!r}")
        if role == "user" and (text or not blocks):
            out.append({"role": "user", "content": "".join(text)})
        elif role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if thinking:
                turn["reasoning_content"] = "".join(thinking)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    if extra_system:
        system = "\n\n".join([system, *extra_system] if system is not None else extra_system)
    return ([{"role": "system", "content": system}] if system is not None else []) + out


def openai_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type", "custom") != "custom" and "input_schema" not in tool:
            continue  # a server tool (web search, tool search, ...): Anthropic runs those, hybridlm cannot
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise InvalidParameter("tools", f"tools[{i}] must have a name")
        function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def openai_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(OpenAI tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise InvalidParameter("tool_choice", 'tool_choice.type must be "auto", "any", "tool" or "none"')


def plan(ctx: ServerContext, body: MessagesRequest) -> tuple[ChatPlan, list[int]]:
    """The request's chat plan and prompt ids (APIError 400 naming the field). Blocking."""
    try:
        choice, parallel = openai_tool_choice(body.tool_choice)
        effort = (body.output_config or {}).get("effort")
        kwargs = effort_kwargs(effort, "output_config.effort")
        if body.thinking is not None:
            kwargs["enable_thinking"] = body.thinking.get("type") in ("enabled", "adaptive")
        messages, tools = openai_messages(body), openai_tools(body.tools)
        return plan_and_encode(ctx.tokenizer, messages, tools, choice, parallel, None, kwargs)
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param) from None


def _stop_reason(finish: str | None, stop: Any, calls: int) -> tuple[str, str | None]:
    if calls and finish not in (LENGTH,):
        return "tool_use", None
    if finish == LENGTH:
        return "max_tokens", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(usage, prompt_tokens: int) -> dict[str, int]:
    cached = usage.cached_tokens if usage is not None else 0
    return {
        "input_tokens": (usage.prompt_tokens if usage else prompt_tokens) - cached,
        "output_tokens": usage.completion_tokens if usage else 0,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _event(kind: str, body: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **body}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def _events(
    ctx: ServerContext, stream, chat: ChatPlan, message: dict, prompt_tokens: int
) -> AsyncIterator[bytes]:
    """message_start, then per block content_block_start / _delta / _stop, message_delta, message_stop."""
    parser = chat.stream()
    index, open_kind = -1, None

    def switch(kind: str, start: dict) -> list[bytes]:
        nonlocal index, open_kind
        out = [_event("content_block_stop", {"index": index})] if open_kind is not None else []
        index, open_kind = index + 1, kind
        return [*out, _event("content_block_start", {"index": index, "content_block": start})]

    try:
        yield _event("message_start", {"message": {**message, "usage": _usage(None, prompt_tokens)}})
        async for event in stream:
            if event.finish_reason == ERROR:
                failure = errors.body(PREFIX, APIError(500, event.error or "generation failed"))
                yield _event("error", {"error": failure["error"]})
                return
            if event.finish_reason == CANCELLED:
                yield _event(
                    "error",
                    {"error": errors.body(PREFIX, APIError(503, "the request was cancelled"))["error"]},
                )
                return
            parts = parser.feed(event.text) if event.text else []
            if event.finished:
                parts += parser.close()
            for part in parts:
                if part.kind == "tool_call":
                    call = part.call
                    for chunk in switch(
                        "tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                    ):
                        yield chunk
                    yield _event(
                        "content_block_delta",
                        {
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": call.arguments},
                        },
                    )
                    continue
                kind = "thinking" if part.kind == "reasoning" else "text"
                if open_kind != kind:
                    start = (
                        {"type": "thinking", "thinking": "", "signature": ""}
                        if kind == "thinking"
                        else {
                            "type": "text",
                            "text": "",
                        }
                    )
                    for chunk in switch(kind, start):
                        yield chunk
                delta = (
                    {"type": "thinking_delta", "thinking": part.text}
                    if kind == "thinking"
                    else {
                        "type": "text_delta",
                        "text": part.text,
                    }
                )
                yield _event("content_block_delta", {"index": index, "delta": delta})
            if event.finished:
                if open_kind is not None:
                    yield _event("content_block_stop", {"index": index})
                reason, sequence = _stop_reason(event.finish_reason, event.stop_reason, len(parser.calls))
                yield _event(
                    "message_delta",
                    {
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": _usage(event.usage, prompt_tokens),
                    },
                )
                yield _event("message_stop", {})
    finally:
        stream.cancel()


def register(app: FastAPI, ctx: ServerContext) -> None:
    """Add `/v1/messages` and `/v1/messages/count_tokens` to `app`."""

    def check(body: MessagesRequest) -> None:
        if body.model is not None and body.model != ctx.model_name:
            raise APIError(
                404, f"model: {body.model!r} does not exist; this server serves {ctx.model_name!r}"
            )
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat", param="messages")

    @app.post(PREFIX)
    async def messages(request: Request):
        body = await ctx.parse(request, MessagesRequest)
        check(body)
        if body.max_tokens is None:
            raise APIError(400, "max_tokens: field required", param="max_tokens")
        try:
            params = SamplingParams(
                **{
                    k: v
                    for k, v in dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k).items()
                    if v is not None
                },
                max_tokens=body.max_tokens,
                stop=tuple(body.stop_sequences or ()),
            )
        except InvalidParameter as e:
            name = "stop_sequences" if e.param == "stop" else e.param
            raise APIError(400, str(e), param=name) from None
        chat, ids = await ctx.offload(plan, ctx, body)
        stream = await ctx.submit(ids, chat.params(params), "messages")
        message = {
            "id": new_id("msg").replace("-", "_"),
            "type": "message",
            "role": "assistant",
            "model": ctx.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
        }
        if body.stream:
            return StreamingResponse(
                _events(ctx, stream, chat, message, len(ids)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result, gone = await ctx.collect(stream, request)
        if result.finish_reason == ERROR:
            raise APIError(500, result.error or "generation failed", type="api_error")
        if result.finish_reason == CANCELLED and gone:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        if result.finish_reason == CANCELLED:
            raise APIError(503, "the request was cancelled (server shutting down)")
        answer = read_answer(chat, result.text)
        content: list[dict[str, Any]] = []
        if answer.reasoning:
            content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.content:
            content.append({"type": "text", "text": answer.content})
        for call in answer.calls:
            content.append(
                {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}
            )
        reason, sequence = _stop_reason(result.finish_reason, result.stop_reason, len(answer.calls))
        message |= {"content": content, "stop_reason": reason, "stop_sequence": sequence}
        return JSONResponse({**message, "usage": _usage(result.usage, len(ids))})

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens(request: Request):
        body = await ctx.parse(request, MessagesRequest)
        check(body)
        _, ids = await ctx.offload(plan, ctx, body)
        return {"input_tokens": len(ids)}
