"""The OpenAI-compatible wire format: request bodies, errors, and response / chunk builders.

Request bodies are pydantic models that check types only; value ranges are checked once, by
`SamplingParams`, so every bad value gets the same message whichever endpoint carried it. Unknown
fields are ignored, as OpenAI clients send vendor extras freely. Responses are plain dicts: they are
built per token while streaming, where pydantic would only add cost.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridlm.engine import Completion, Event, InvalidParameter, SamplingParams, TokenLogprob, Usage
from hybridlm.engine.params import MAX_LOGPROBS
from hybridlm.engine.request import SpeculativeUsage
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.server.chat import ChatPlan, ChatStream, effort_kwargs, plan_chat, read_answer
from hybridlm.server.tools import ToolCall


class APIError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def documented(**schema) -> Any:
    """A field whose OpenAPI schema states the range `SamplingParams` enforces (the check itself stays
    there, so every endpoint words its errors alike): schema-driven clients and fuzzers then send
    values the server takes."""
    return Field(default=None, json_schema_extra=schema)


_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"enum": ["system", "user", "assistant", "tool"]}, "content": {"type": "string"}},
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


MAX_CHOICES = 128  # OpenAI's bound on n (the engine also caps it at its --max-running)


class _GenerationRequest(BaseModel):
    """Fields both endpoints share (OpenAI's, plus vLLM's extras top_k, min_p, repetition_penalty,
    stop_token_ids, ignore_eos, skip_special_tokens, and hybridlm's `speculative`: false opts the
    request out of speculative decoding). `n` choices are sampled from one prefill, choice i with
    seed + i."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int | None = documented(minimum=1, maximum=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = documented(minimum=1)
    temperature: float | None = documented(minimum=0, maximum=100)
    top_p: float | None = documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = documented(minimum=-1)
    min_p: float | None = documented(minimum=0, maximum=1)
    presence_penalty: float | None = documented(minimum=-2, maximum=2)
    frequency_penalty: float | None = documented(minimum=-2, maximum=2)
    repetition_penalty: float | None = documented(exclusiveMinimum=0, maximum=100)
    seed: int | None = documented(minimum=-(2**63), maximum=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = documented(items={"type": "integer", "minimum": 0})
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises `InvalidParameter` naming the field (as `SamplingParams` names it)."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "logprobs": logprobs,
            "n": self.n,
        }
        return SamplingParams(
            **{k: v for k, v in given.items() if v is not None},
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            speculative=self.speculative,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`. `tools` and `chat_template_kwargs` (e.g. `enable_thinking`) are
    handed to the chat template; tool calls and reasoning in the output are parsed in the format the
    template writes (`hybridlm.server.chat`); `tool_choice` required / named and `response_format`
    are enforced by constrained decoding. `reasoning_effort` sets the template's thinking switch
    (`chat.effort_kwargs`); `chat_template_kwargs` given with it win."""

    messages: list[dict[str, Any]] = Field(json_schema_extra={"items": _MESSAGE, "minItems": 1})
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    max_completion_tokens: int | None = documented(minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = documented(minimum=0, maximum=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`: `prompt` is text or token ids (a one-element list of either is accepted)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = documented(minimum=0, maximum=MAX_LOGPROBS)
    echo: bool = False


# Deeper JSON is refused: nothing OpenAI's shapes hold nests this far, and recursive code downstream
# (validation, templates) must never meet a depth near Python's recursion limit.
MAX_DEPTH = 100


def _check_values(data: Any) -> None:
    """Raise APIError for what JSON can carry but no handler can use: nesting deeper than MAX_DEPTH, and
    strings with a lone UTF-16 surrogate (`"\\ud800"`: not text, the tokenizer cannot take it). Iterative,
    so depth costs no stack."""
    todo = [(data, 0, None)]
    while todo:
        value, depth, field = todo.pop()
        if depth > MAX_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels", param=field)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                where = field or "body"
                raise APIError(400, f"{where}: a string holds a lone UTF-16 surrogate", param=field) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                name = key if depth == 0 else field
                todo += [(key, depth + 1, name), (item, depth + 1, name)]
        elif isinstance(value, list):
            todo += [(item, depth + 1, field) for item in value]


def decode_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """A request body as `model`, or APIError(400) naming the top-level field at fault (as OpenAI does).
    Blocking (its cost grows with the body): handlers run it off the event loop."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels") from None
    _check_values(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None  # the top-level field, as OpenAI names it
        raise APIError(400, f"{param or 'body'}: {first['msg']}", param=param) from None


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra` describing its JSON body as `model` (handlers parse bodies themselves,
    with `decode_body`, to keep OpenAI's error shape)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_schema(app, model_name: str, more: tuple[type[BaseModel], ...] = ()) -> dict:
    """The app's OpenAPI schema with the request models of `request_body` in its components (`model`:
    the one served; `more`: the other APIs' request models)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ChatCompletionRequest, CompletionRequest, *more):
            described = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(described.pop("$defs", {}))
            described["properties"]["model"] = {"anyOf": [{"const": model_name}, {"type": "null"}]}
            components[model.__name__] = described
        app.openapi_schema = schema
    return app.openapi_schema


def chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest) -> tuple[ChatPlan, list[int]]:
    """The request's `ChatPlan` and its prompt's token ids (APIError(400) naming the field: the
    messages the template rejects, bad tools, tool_choice or response_format). Blocking: handlers
    run it off the event loop."""
    try:
        plan = plan_openai_chat(tokenizer, body)
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param) from None
    return plan, tokenizer.encode(plan.prompt)


def render_chat(tokenizer: Tokenizer, body: ChatCompletionRequest) -> str:
    """The prompt text the chat template makes of the request (what transformers'
    `apply_chat_template(messages, tools=..., add_generation_prompt=..., **chat_template_kwargs)` makes)."""
    return plan_openai_chat(tokenizer, body).prompt


def plan_openai_chat(tokenizer: Tokenizer, body: ChatCompletionRequest) -> ChatPlan:
    """The request's `ChatPlan` (raises `InvalidParameter` naming the field, template errors)."""
    return plan_chat(
        tokenizer,
        body.messages,
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        body.response_format,
        effort_kwargs(body.reasoning_effort) | (body.chat_template_kwargs or {}),
        body.add_generation_prompt,
    )


def tool_call_body(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """OpenAI's `tool_calls[]` entry (streamed entries carry their `index`)."""
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


def chat_finish_reason(reason: str | None, calls: int) -> str | None:
    """A request that ended normally after tool calls finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if reason == "stop" and calls else reason


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def total_usage(usages: list[Usage]) -> Usage:
    """One request's usage from its choices' (as OpenAI counts n > 1): the prompt (and what the
    prefix cache did for it) once, the completion tokens (and speculative counts) of every choice."""
    first = usages[0]
    spec = [u.speculative for u in usages if u.speculative is not None]
    speculative = None
    if spec:
        speculative = SpeculativeUsage(
            sum(s.drafted_tokens for s in spec),
            sum(s.accepted_tokens for s in spec),
            sum(s.verify_passes for s in spec),
        )
    completion = sum(u.completion_tokens for u in usages)
    return replace(first, completion_tokens=completion, speculative=speculative)


def usage_body(usage: Usage) -> dict[str, Any]:
    body = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "cache": {
            "cached_tokens": usage.cached_tokens,
            "replayed_tokens": usage.replayed_tokens,
            "prefilled_tokens": usage.prefilled_tokens,
            "restore_ms": round(usage.restore_ms, 3),
        },
    }
    if usage.speculative is not None:
        spec = usage.speculative
        body["speculative"] = {
            "drafted_tokens": spec.drafted_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "verify_passes": spec.verify_passes,
        }
    return body


class Responder:
    """Builds one request's response objects (ids, timestamps and token texts shared by its chunks)."""

    def __init__(
        self,
        kind: Literal["chat", "completion"],
        model: str,
        tokenizer: Tokenizer | None,
        plan: ChatPlan | None = None,
    ):
        self.kind = kind
        self.plan = plan  # chat: how the output is read (reasoning, tool calls)
        self.streams: dict[int, ChatStream] = {}  # chat with a plan: each choice's output parser
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def logprobs(
        self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob], offset: int = 0
    ) -> dict | None:
        """Chat: `{"content": [{token, logprob, bytes, top_logprobs}]}`; completions: the legacy
        `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets start at `offset` characters)."""
        if self.kind == "chat":
            content = []
            for e in entries:
                text = self._token_text(e.token_id)
                top = [
                    {"token": (t := self._token_text(i)), "logprob": lp, "bytes": list(t.encode())}
                    for i, lp in e.top
                ]
                content.append(
                    {"token": text, "logprob": e.logprob, "bytes": list(text.encode()), "top_logprobs": top}
                )
            return {"content": content}
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token_text(i): lp for i, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def response(self, results: list[Completion], want_logprobs: bool) -> dict[str, Any]:
        """The non-streaming body: one choice per completion (by index), usage summed over them."""
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(i, r, want_logprobs) for i, r in enumerate(results)],
            "usage": usage_body(total_usage([r.usage for r in results])),
        }

    def _choice(self, index: int, result: Completion, want_logprobs: bool) -> dict[str, Any]:
        logprobs = self.logprobs(result.logprobs) if want_logprobs else None
        reason = result.finish_reason
        if self.kind == "chat" and self.plan is not None:
            answer = read_answer(self.plan, result.text)
            # null only beside tool calls (as OpenAI and vLLM answer): an empty reply is ""
            content = answer.content if answer.content or answer.calls else ""
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if self.plan.reasoning is not None:
                message["reasoning_content"] = answer.reasoning
            if answer.calls:
                message["tool_calls"] = [tool_call_body(c) for c in answer.calls]
            choice = {"index": index, "message": message}
            reason = chat_finish_reason(reason, len(answer.calls))
        elif self.kind == "chat":
            choice = {"index": index, "message": {"role": "assistant", "content": result.text}}
        else:
            choice = {"index": index, "text": result.text}
        return choice | {"logprobs": logprobs, "finish_reason": reason, "stop_reason": result.stop_reason}

    def chunk(
        self, choices: list[dict[str, Any]], usage: Usage | None = None, with_usage: bool = False
    ) -> dict:
        """One streamed chunk; `with_usage` adds the `usage` key (null until the final usage chunk)."""
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if with_usage:
            body["usage"] = usage_body(usage) if usage is not None else None
        return body

    def delta_choice(self, event: Event, want_logprobs: bool, text_offset: int) -> dict[str, Any] | None:
        """The event's streamed choice (its `index`); None when it has nothing to say (text a parser
        holds back)."""
        logprobs = self.logprobs(event.logprobs, text_offset) if want_logprobs else None
        reason = event.finish_reason
        index = event.index
        if self.plan is not None:
            if index not in self.streams:
                self.streams[index] = self.plan.stream()
            stream = self.streams[index]
            delta = self._parsed_delta(stream, event)
            if not delta and not event.finished and not logprobs:
                return None
            reason = chat_finish_reason(reason, len(stream.calls))
            choice: dict[str, Any] = {"index": index, "delta": delta}
        elif self.kind == "chat":
            choice = {"index": index, "delta": {"content": event.text} if event.text else {}}
        else:
            choice = {"index": index, "text": event.text}
        choice |= {"logprobs": logprobs, "finish_reason": reason}
        if event.finished:
            choice["stop_reason"] = event.stop_reason
        return choice

    @staticmethod
    def _parsed_delta(stream: ChatStream, event: Event) -> dict[str, Any]:
        """OpenAI's delta for the parts the event's text completes in its choice's parser `stream`
        (all the rest when it is the last)."""
        parts = stream.feed(event.text) if event.text else []
        if event.finished:
            parts += stream.close()
        delta: dict[str, Any] = {}
        first_call = len(stream.calls) - sum(p.kind == "tool_call" for p in parts)
        for part in parts:
            if part.kind == "tool_call":
                entry = tool_call_body(part.call, first_call + len(delta.get("tool_calls", ())))
                delta.setdefault("tool_calls", []).append(entry)
            else:
                key = "reasoning_content" if part.kind == "reasoning" else "content"
                delta[key] = delta.get(key, "") + part.text
        return delta
