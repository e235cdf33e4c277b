"""One chat request as every API serves it: `plan_chat` renders the prompt and decides how the output
is read (tool-call format, reasoning markers) and constrained (a grammar for forced tool calls and
structured outputs); `ChatStream` turns the streamed text into reasoning, content and tool calls.

The OpenAI, Anthropic and ollama endpoints translate their requests into `plan_chat`'s arguments and
`ChatStream`'s parts into their own shapes, so they share one engine path and one rendering: the same
conversation renders to the same prompt whichever API carried it, and reuses the same prefix cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2

from hybridlm.engine import InvalidParameter, SamplingParams
from hybridlm.engine.grammar import Grammar
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.server import reasoning, tools
from hybridlm.server.tools import ToolCall, ToolCallStream, ToolFormat
from hybridlm.server.tools.base import json_rule, lark_string

# Longest reasoning a grammar lets a model write before a forced answer (the template opened it).
FORCED_REASONING_CHARS = 2000


@dataclass
class ChatPlan:
    """How one chat request is rendered, constrained and read back.

    prompt: the rendered prompt text. tool_format: the format tool calls are parsed in (None: not
    parsed). functions: name -> parameter schema of the offered tools. parallel: several calls may
    be returned. reasoning / thinking: the template's thinking markers and whether the prompt left a
    block open. grammar: the constraint on the output (None: free). keep_special: decode special
    tokens into the text (a marker the parsers need is one).
    """

    prompt: str
    tool_format: ToolFormat | None = None
    functions: dict[str, dict] = field(default_factory=dict)
    parallel: bool = True
    reasoning: reasoning.ReasoningFormat | None = None
    thinking: bool = False
    grammar: Grammar | None = None
    keep_special: bool = False

    def params(self, params: SamplingParams) -> SamplingParams:
        """`params` with this plan's grammar and decoding of special tokens."""
        changes: dict[str, Any] = {}
        if self.grammar is not None:
            changes["grammar"] = self.grammar
        if self.keep_special:
            changes["skip_special_tokens"] = False
        return replace(params, **changes) if changes else params

    def stream(self) -> ChatStream:
        return ChatStream(self)


def check_tools(tool_list: Any, param: str = "tools") -> dict[str, dict]:
    """OpenAI-shaped `tools` -> name -> parameter schema; InvalidParameter naming the bad entry."""
    if tool_list is None:
        return {}
    if not isinstance(tool_list, list):
        raise InvalidParameter(param, f"{param} must be a list of tools")
    out = {}
    for i, tool in enumerate(tool_list):
        where = f"{param}[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise InvalidParameter(param, f'{where} must be {{"type": "function", "function": {{...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not name or not name.replace("_", "a").replace("-", "a").isalnum():
            raise InvalidParameter(param, f"{where}.function.name must be letters, digits, _ or -")
        schema = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise InvalidParameter(param, f"{where}.function.parameters must be a JSON schema of an object")
        if not isinstance(schema.get("properties", {}), dict):
            raise InvalidParameter(param, f"{where}.function.parameters.properties must be an object")
        if name in out:
            raise InvalidParameter(param, f"{where}: the function name {name!r} is used twice")
        out[name] = schema
    return out


def _forced_names(tool_choice: Any, functions: dict[str, dict]) -> tuple[str, list[str] | None]:
    """("none" | "auto" | "required" | "named", the functions a call must pick from)."""
    if tool_choice is None:
        return ("auto", None) if functions else ("none", None)
    if tool_choice in ("none", "auto"):
        return tool_choice, None
    if tool_choice == "required":
        if not functions:
            raise InvalidParameter("tool_choice", 'tool_choice "required" needs tools')
        return "required", list(functions)
    name = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidParameter(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    if name not in functions:
        raise InvalidParameter("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return "named", [name]


def response_grammar(response_format: Any, param: str = "response_format") -> str | None:
    """The Lark body generating what `response_format` asks for (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json_rule({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise InvalidParameter(param, f"{param}.json_schema.schema must be a JSON schema")
        return json_rule(schema)
    raise InvalidParameter(param, f'{param}.type must be "text", "json_object" or "json_schema"')


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def effort_kwargs(effort: Any, param: str = "reasoning_effort") -> dict[str, Any]:
    """A reasoning effort as chat template arguments: `enable_thinking` (the switch of Qwen3-style
    templates: off for "none" and "minimal") and `reasoning_effort` (templates taking a level, as
    gpt-oss's does). None: the template's defaults."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise InvalidParameter(param, f"{param} must be one of {', '.join(EFFORTS)}")
    return {"enable_thinking": effort not in ("none", "minimal"), "reasoning_effort": effort}


def marker_ids(tokenizer: Tokenizer, markers: tuple[str, ...]) -> dict[str, int]:
    """The markers the tokenizer has as one token: a grammar names that token (the model writes
    the marker as it, and grammar libraries never match an added token by its text)."""
    out = {}
    for m in markers:
        ids = tokenizer.encode(m)
        if len(ids) == 1:
            out[m] = ids[0]
    return out


def plan_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tool_list: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    response_format: Any = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> ChatPlan:
    """Render and plan one chat request. Raises InvalidParameter naming the field (tools,
    tool_choice, response_format; messages when the template rejects them). Blocking (rendering
    grows with the conversation): handlers run it off the event loop."""
    functions = check_tools(tool_list)
    choice, forced = _forced_names(tool_choice, functions)
    body = response_grammar(response_format)
    if forced is not None and body is not None:
        message = "response_format cannot be combined with a forced tool call"
        raise InvalidParameter("response_format", message)
    try:
        prompt = tokenizer.apply_chat_template(
            with_argument_objects(messages),
            tools=tool_list or None,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except (jinja2.TemplateError, ValueError, TypeError, RecursionError) as e:
        raise InvalidParameter("messages", f"messages: the chat template rejected them: {e}") from None
    template = tokenizer.chat_template
    template = template.get("tool_use", template.get("default")) if isinstance(template, dict) else template
    plan = ChatPlan(prompt, parallel=parallel_tool_calls is not False)
    plan.reasoning = reasoning.detect(template)
    plan.thinking = plan.reasoning is not None and plan.reasoning.open_in(prompt)
    markers: tuple[str, ...] = ()
    if functions and choice != "none":
        plan.tool_format = tools.detect(template)
        if plan.tool_format is None and forced is not None:
            raise InvalidParameter(
                "tool_choice", "this model's chat template writes tool calls in no format hybridlm knows"
            )
        plan.functions = functions
        markers = plan.tool_format.markers() if plan.tool_format is not None else ()
    if plan.reasoning is not None:
        markers += (plan.reasoning.begin, plan.reasoning.end)
    special = marker_ids(tokenizer, markers)
    # A marker that is a special token leaves decoded text unless special tokens are kept.
    plan.keep_special = any(tokenizer.decode([i], skip_special_tokens=True) == "" for i in special.values())
    if forced is not None:
        rules = plan.tool_format.grammar(
            {n: functions[n] for n in forced}, plan.parallel and choice == "required", special
        )
        plan.grammar = Grammar("lark", _after_reasoning(plan, rules, special), "tools")
    elif body is not None:
        plan.grammar = Grammar("lark", _after_reasoning(plan, f"start: {body}\n", special), "response_format")
    return plan


def with_argument_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their JSON-text `arguments` as objects, as vLLM hands them to
    templates: Qwen3.5's and Gemma 4's iterate over the arguments, and the others write an object
    with `tojson`, which spells it as json.dumps does (and as parsed calls spell it back: the
    rendered history stays byte-stable). Text that is not a JSON object stays text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and calls:
            message = {**message, "tool_calls": [_call_with_object(c) for c in calls]}
        out.append(message)
    return out


def _call_with_object(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def _after_reasoning(plan: ChatPlan, rules: str, special: dict[str, int]) -> str:
    """`rules` (whose start rule is `start`) preceded, when the prompt left a reasoning block open,
    by bounded reasoning text and the block's end."""
    if not plan.thinking:
        return rules
    end = plan.reasoning.end
    close = f"<[{special[end]}]>" if end in special else lark_string(end)
    first = rules.replace("start:", "answer:", 1)
    return f'start: /[^<]{{0,{FORCED_REASONING_CHARS}}}/ {close} "\\n\\n" answer\n{first}'


def plan_and_encode(tokenizer: Tokenizer, *args: Any, **kwargs: Any) -> tuple[ChatPlan, list[int]]:
    """`plan_chat(tokenizer, ...)` and its prompt's token ids (blocking, like `plan_chat`)."""
    plan = plan_chat(tokenizer, *args, **kwargs)
    return plan, tokenizer.encode(plan.prompt)


@dataclass(frozen=True)
class Part:
    """One piece of a chat answer: kind "reasoning" | "content" (text) or "tool_call" (call)."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


class ChatStream:
    """Model text, fed in any pieces, as `Part`s: reasoning first (when the template has markers),
    then content and tool calls in order. Non-streaming answers feed the whole text once."""

    def __init__(self, plan: ChatPlan):
        self.plan = plan
        self.calls: list[ToolCall] = []
        self._reasoning = (
            reasoning.ReasoningStream(plan.reasoning, plan.thinking) if plan.reasoning is not None else None
        )
        self._tools = ToolCallStream(plan.tool_format, plan.functions) if plan.tool_format else None

    def feed(self, text: str) -> list[Part]:
        if self._reasoning is None:
            return self._content(text, final=False)
        return self._split(self._reasoning.feed(text), final=False)

    def close(self) -> list[Part]:
        if self._reasoning is None:
            return self._content("", final=True)
        return self._split(self._reasoning.close(), final=True)

    def _split(self, pieces: list[tuple[str, str]], final: bool) -> list[Part]:
        out = []
        for kind, text in pieces:
            if kind == reasoning.REASONING:
                out.append(Part("reasoning", text))
            else:
                out += self._content(text, final=False)
        if final:
            out += self._content("", final=True)
        return out

    def _content(self, text: str, final: bool) -> list[Part]:
        if self._tools is None:
            return [Part("content", text)] if text else []
        pieces = self._tools.feed(text) if text else []
        if final:
            pieces += self._tools.close()
        out = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append(Part("content", piece))
            elif self.plan.parallel or not self.calls:  # parallel_tool_calls false: the first call only
                self.calls.append(piece)
                out.append(Part("tool_call", call=piece))
        return out


@dataclass
class ChatAnswer:
    """A whole answer: reasoning, content (None when empty) and tool calls."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]


def read_answer(plan: ChatPlan, text: str) -> ChatAnswer:
    """Parse a whole answer (the non-streaming path: the same parser fed once)."""
    stream = plan.stream()
    parts = stream.feed(text) + stream.close()
    thought = "".join(p.text for p in parts if p.kind == "reasoning")
    content = "".join(p.text for p in parts if p.kind == "content")
    return ChatAnswer(thought or None, content or None, stream.calls)


def tool_result_text(content: Any) -> str:
    """A tool result's content as the text a template renders (JSON for structured values)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    return json.dumps(content, ensure_ascii=False)
