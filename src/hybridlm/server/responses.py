"""OpenAI's Responses API: `POST /v1/responses` (stateless, or stateful through `previous_response_id`
and the response store), `GET` and `DELETE /v1/responses/{id}`.

A request's input items are translated into the OpenAI-shaped chat messages the chat template renders
(`function_call` → assistant `tool_calls`, `function_call_output` → `role: tool`, `reasoning` →
`reasoning_content`), and the answer's parts (`hybridlm.server.chat`) back into output items. Output
items sent back as input translate to the very messages the answer was read from, so a re-sent
history renders to the tokens the model wrote and the next turn prefills only its new items. The raw
reasoning text travels in the reasoning item (`content`, and `encrypted_content`, which clients that
drop `content` on re-sending keep). Tool types hybridlm cannot run (`web_search`, `custom`,
`local_shell`, ...) are ignored.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hybridlm.engine import Engine, InvalidParameter, SamplingParams, Usage
from hybridlm.engine.request import CANCELLED, ERROR, LENGTH
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.server.chat import ChatPlan, Part, effort_kwargs, plan_and_encode, tool_result_text
from hybridlm.server.context import ServerContext
from hybridlm.server.protocol import APIError, documented, request_body
from hybridlm.server.response_store import ResponseStore

log = logging.getLogger(__name__)

PATH = "/v1/responses"
# Reasoning text in `encrypted_content` starts with this (other providers' opaque blobs do not).
SEALED = "hybridlm-reasoning:"
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


# What schema-driven clients and fuzzers are told an input item is (the handler reads more kinds).
_ITEM = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "type": {"const": "message"},
        "role": {"enum": list(ROLES)},
        "content": {"type": "string"},
    },
}


class ResponsesRequest(BaseModel):
    """The fields hybridlm reads (others are ignored, as clients send extras freely). `metadata`,
    `user`, `prompt_cache_key`, `include`, `truncation` and `service_tier` are accepted and echoed:
    the prefix cache needs no key, it finds the longest cached prefix of every prompt."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]] | None = Field(default=None, json_schema_extra={"items": _ITEM})
    instructions: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = documented(minimum=1)
    temperature: float | None = documented(minimum=0, maximum=100)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = documented(minimum=-1)
    seed: int | None = documented(minimum=-(2**63), maximum=2**64 - 1)
    metadata: dict[str, str] | None = None
    store: bool = True
    stream: bool = False
    user: str | None = None
    prompt_cache_key: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None


# -- input items -> chat messages ------------------------------------------------------------------


def _parts_text(content: Any, param: str, where: str) -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter(param, f"{where}.content must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise InvalidParameter(param, f"{where}.content[{j}]: content parts of type {kind!r} unsupported")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise InvalidParameter(param, f"{where}.content[{j}] needs its text")
        out.append(text)
    return "".join(out)


def _reasoning_text(item: dict[str, Any]) -> str:
    """The raw reasoning an item carries: its `reasoning_text` parts, else what hybridlm sealed in its
    `encrypted_content` ("" when neither: the turn renders without it)."""
    content = item.get("content")
    if isinstance(content, list) and content:
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and sealed.startswith(SEALED):
        try:
            return base64.b64decode(sealed[len(SEALED) :], validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            return ""
    return ""


def _assistant(out: list[dict[str, Any]], after: tuple[str, ...]) -> dict[str, Any]:
    """The assistant turn an output item joins: the last message when it is an assistant turn holding
    nothing of `after` (what comes later within one turn: reasoning, then text, then calls), else a
    new one."""
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and not any(last.get(k) for k in after):
        return last
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    out.append(turn)
    return turn


def input_messages(items: str | list[dict[str, Any]] | None, param: str = "input") -> list[dict[str, Any]]:
    """Input items as chat messages (InvalidParameter naming `param` for a bad item)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise InvalidParameter(
                    param, f'{where}.role must be "user", "assistant", "system" or "developer"'
                )
            text = _parts_text(item.get("content"), param, where)
            if role == "assistant":
                turn = _assistant(out, ("content", "tool_calls"))
                turn["content"] = text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, arguments, call_id)):
                raise InvalidParameter(param, f"{where}: a function_call needs name, arguments and call_id")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            _assistant(out, ()).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or output is None:
                raise InvalidParameter(param, f"{where}: a function_call_output needs call_id and output")
            if isinstance(output, list) and all(
                isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in output
            ):
                output = _parts_text(output, param, where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": tool_result_text(output)})
        elif kind == "reasoning":
            thought = _reasoning_text(item)
            if thought:
                _assistant(out, ("reasoning_content", "content", "tool_calls"))["reasoning_content"] = thought
        else:
            raise InvalidParameter(param, f"{where}: input items of type {kind!r} unsupported")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The function tools in chat completions' shape; the hosted and custom ones hybridlm cannot run
    are left out."""
    out = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise InvalidParameter("tools", f"tools[{i}] must be an object")
        if tool.get("type") != "function":
            continue
        function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    """tool_choice in chat completions' shape (a hosted tool's: "auto", as those tools are left out)."""
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind == "allowed_tools":
        return choice.get("mode", "auto")
    return "auto"


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat completions' `response_format`."""
    fmt = text.get("format") if text else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}


def one_system_prompt(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading system turns (instructions, then developer and system items: Codex sends two
    developer messages) as one system prompt, their texts a blank line apart: many chat templates
    refuse a system turn anywhere but first."""
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if lead < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:lead])
    return [{"role": "system", "content": joined}, *messages[lead:]]


@dataclass
class Prepared:
    plan: ChatPlan
    ids: list[int]
    history: list[dict[str, Any]]  # the conversation without instructions (what the store keeps)


def prepare(tokenizer: Tokenizer, body: ResponsesRequest, earlier: list[dict[str, Any]]) -> Prepared:
    """Render the request after the stored conversation `earlier`. APIError 400 naming the field.
    Blocking: handlers run it off the event loop."""
    renames = {"messages": "input", "response_format": "text"}
    try:
        history = earlier + input_messages(body.input)
        if isinstance(body.instructions, str):
            system = [{"role": "system", "content": body.instructions}]
        else:
            system = input_messages(body.instructions, "instructions")
        if not system and not history:
            raise InvalidParameter("input", "input: there is nothing to answer (no input, no instructions)")
        effort = body.reasoning.get("effort") if body.reasoning else None
        plan, ids = plan_and_encode(
            tokenizer,
            one_system_prompt(system + history),
            chat_tools(body.tools),
            chat_tool_choice(body.tool_choice),
            body.parallel_tool_calls,
            response_format(body.text),
            effort_kwargs(effort, "reasoning.effort"),
        )
    except InvalidParameter as e:
        param = renames.get(e.param, e.param)
        message = str(e)
        if e.param in renames and message.startswith(e.param):
            message = param + message[len(e.param) :]
        raise APIError(400, message, param=param) from None
    return Prepared(plan, ids, history)


# -- output items and stream events ----------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def seal(text: str) -> str:
    return SEALED + base64.b64encode(text.encode()).decode()


class Output:
    """Builds the output items from an answer's parts, and the stream events that announce them
    (the non-streaming path builds the same items and drops the events)."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []
        self.reasoning = ""  # all reasoning text (counted as reasoning tokens)
        self._open: dict[str, Any] | None = None
        self._text = ""

    def _index(self) -> int:
        return len(self.items) - 1

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[dict[str, Any]]:
        self.items.append(item)
        events = [{"type": "response.output_item.added", "output_index": self._index(), "item": dict(item)}]
        if part is not None:
            self._open, self._text = item, ""
            events.append(self._part_event("response.content_part.added", part))
        return events

    def _part_event(self, kind: str, part: dict[str, Any]) -> dict[str, Any]:
        where = {"item_id": self._open["id"], "output_index": self._index(), "content_index": 0}
        return {"type": kind, **where, "part": part}

    def _delta(self, kind: str, text: str, logprobs: bool) -> dict[str, Any]:
        self._text += text
        event = {"type": kind, "item_id": self._open["id"], "output_index": self._index(), "content_index": 0}
        return event | {"delta": text} | ({"logprobs": []} if logprobs else {})

    def add(self, part: Part) -> list[dict[str, Any]]:
        if part.kind == "tool_call":
            events = self.close()
            call = part.call
            item = {
                "id": _id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
            }
            events += self._start(item, None)
            where = {"item_id": item["id"], "output_index": self._index()}
            events.append(
                {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments}
            )
            item |= {"arguments": call.arguments, "status": "completed"}
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": call.name,
                    "arguments": call.arguments,
                }
            )
            events.append(
                {"type": "response.output_item.done", "output_index": self._index(), "item": dict(item)}
            )
            return events
        events = []
        if part.kind == "reasoning":
            self.reasoning += part.text
            if self._open is None or self._open["type"] != "reasoning":
                events += self.close()
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": []}
                events += self._start(item, {"type": "reasoning_text", "text": ""})
            events.append(self._delta("response.reasoning_text.delta", part.text, logprobs=False))
            return events
        if self._open is None or self._open["type"] != "message":
            events += self.close()
            events += self._start_message()
        events.append(self._delta("response.output_text.delta", part.text, logprobs=True))
        return events

    def _start_message(self) -> list[dict[str, Any]]:
        item = {
            "id": _id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        return self._start(item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item (reasoning or message)."""
        item, text = self._open, self._text
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events = [{"type": "response.reasoning_text.done", **where, "text": text}]
            item |= {"content": [part], "encrypted_content": seal(text)}
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events = [{"type": "response.output_text.done", **where, "text": text, "logprobs": []}]
            item |= {"content": [part], "status": status}
        events.append(self._part_event("response.content_part.done", part))
        events.append(
            {"type": "response.output_item.done", "output_index": self._index(), "item": dict(item)}
        )
        self._open = None
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the last item; an answer with no item gets an empty message (its text "")."""
        events = self.close(status)
        if not self.items:
            events += self._start_message() + self.close(status)
        return events


def usage_body(usage: Usage | None, reasoning_tokens: int) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {
        "input_tokens": usage.prompt_tokens,
        # cache_write_tokens: 0, as /v1/messages reports cache_creation_input_tokens (writes are free).
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
        "total_tokens": usage.total_tokens,
    }


def _sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


# -- the routes ------------------------------------------------------------------------------------


def saved_store(engine: Engine) -> Path | None:
    """Where stored responses outlive the process: beside the prefix cache's disk tier
    (`--cache-dir`), one file per model."""
    disk = engine.prefix.disk if engine.prefix is not None else None
    return None if disk is None else disk.directory / f"responses.{disk.fingerprint}.json"


def register(app: FastAPI, ctx: ServerContext) -> ResponseStore:
    """Add `/v1/responses` and `/v1/responses/{id}` to `app`; returns the response store (loaded from
    `--cache-dir` when there is one; `save()` it at shutdown; shared through `--cache-store`)."""
    prefix = ctx.engine.prefix
    store = ResponseStore(path=saved_store(ctx.engine), shared=prefix.store if prefix is not None else None)
    store.load()

    def not_found(response_id: str, param: str) -> APIError:
        return APIError(
            404 if param == "response_id" else 400,
            f"no response with id {response_id!r} is stored (stored responses are kept in memory, "
            "a bounded number, and only with store: true)",
            param=param,
            code="previous_response_not_found" if param == "previous_response_id" else None,
        )

    def params(body: ResponsesRequest) -> SamplingParams:
        given = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "seed": body.seed,
            "max_tokens": body.max_output_tokens,
        }
        try:
            return SamplingParams(**{k: v for k, v in given.items() if v is not None})
        except InvalidParameter as e:
            name = "max_output_tokens" if e.param == "max_tokens" else e.param
            message = str(e)
            if message.startswith(e.param):
                message = name + message[len(e.param) :]
            raise APIError(400, message, param=name) from None

    def skeleton(body: ResponsesRequest) -> dict[str, Any]:
        """The response object before its output (what `response.created` carries)."""
        return {
            "id": _id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": ctx.model_name,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "safety_identifier": None,
            "service_tier": "default",
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_logprobs": 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def ended(response: dict[str, Any], output: Output, finish: str | None, error: str | None, usage) -> str:
        """Fill in the outcome; returns the final event's type."""
        response["output"] = output.items
        reasoning_tokens = len(ctx.tokenizer.encode(output.reasoning)) if output.reasoning else 0
        response["usage"] = usage_body(usage, reasoning_tokens)
        if finish == ERROR:
            response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": error or "generation failed"}
            return "response.failed"
        if finish == CANCELLED:
            response["status"] = "failed"
            message = "the request was cancelled (server shutting down)"
            response["error"] = {"code": "server_error", "message": message}
            return "response.failed"
        if finish == LENGTH:
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
            return "response.incomplete"
        response["status"] = "completed"
        return "response.completed"

    def keep(body: ResponsesRequest, response: dict[str, Any], prepared: Prepared) -> None:
        if body.store and response["status"] != "failed":
            store.put(response, prepared.history + input_messages(response["output"]))

    async def events(stream, body, prepared: Prepared, response: dict[str, Any]) -> AsyncIterator[bytes]:
        sequence = 0

        def emit(event: dict[str, Any]) -> bytes:
            nonlocal sequence
            sequence += 1
            return _sse({**event, "sequence_number": sequence - 1})

        parser, output = prepared.plan.stream(), Output()
        try:
            yield emit({"type": "response.created", "response": dict(response)})
            yield emit({"type": "response.in_progress", "response": dict(response)})
            async for event in stream:
                parts = parser.feed(event.text) if event.text else []
                if event.finished:
                    parts += parser.close()
                for part in parts:
                    for out in output.add(part):
                        yield emit(out)
                if event.finished:
                    if event.finish_reason in (ERROR, CANCELLED):  # no answer: only what was begun ends
                        closing = output.close("incomplete")
                    else:
                        closing = output.finish(
                            "incomplete" if event.finish_reason == LENGTH else "completed"
                        )
                    for out in closing:
                        yield emit(out)
                    kind = ended(response, output, event.finish_reason, event.error, event.usage)
                    keep(body, response, prepared)
                    yield emit({"type": kind, "response": response})
                    return
        finally:
            stream.cancel()

    @app.post(PATH, openapi_extra=request_body(ResponsesRequest))
    async def create(request: Request):
        body = await ctx.parse(request, ResponsesRequest)
        if body.model is not None and body.model != ctx.model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {ctx.model_name!r}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat", param="input")
        sampling = params(body)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            earlier = previous.history
        prepared = await ctx.offload(prepare, ctx.tokenizer, body, earlier)
        try:
            stream = await ctx.submit(prepared.ids, prepared.plan.params(sampling), "input")
        except APIError as e:
            if e.param == "response_format":  # the grammar of text.format, named as chat completions name it
                e.param, e.message = "text", e.message.replace("response_format", "text", 1)
            if e.status == 429:  # the code OpenAI's Responses clients know (the queue is full)
                e.code = "rate_limit_exceeded"
            raise
        response = skeleton(body)
        if body.stream:
            return StreamingResponse(
                events(stream, body, prepared, response),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result, gone = await ctx.collect(stream, request)
        if result.finish_reason == CANCELLED and gone:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        if result.finish_reason == ERROR:
            raise APIError(500, result.error or "generation failed", type="server_error")
        if result.finish_reason == CANCELLED:
            raise APIError(503, "the request was cancelled (server shutting down)", type="server_error")
        parser, output = prepared.plan.stream(), Output()
        for part in parser.feed(result.text) + parser.close():
            output.add(part)
        output.finish("incomplete" if result.finish_reason == LENGTH else "completed")
        ended(response, output, result.finish_reason, result.error, result.usage)
        keep(body, response, prepared)
        return JSONResponse(response)

    @app.get(PATH + "/{response_id}")
    async def retrieve(response_id: str):
        entry = store.get(response_id)
        if entry is None:
            raise not_found(response_id, "response_id")
        return entry.response

    @app.delete(PATH + "/{response_id}")
    async def delete(response_id: str):
        if not store.delete(response_id):
            raise not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return store
