"""What every tool-call format shares: the parsed `ToolCall`, the `ToolFormat` contract, and
`ToolCallStream`, which splits streamed model text into content and complete tool calls.

A format's calls sit between a `begin` and an `end` marker (Llama 3's JSON calls, which have no end
marker, take the whole message instead). Text outside the markers is content; a block that does not
parse, or is still open when the output ends, is content too (never an error): a random or confused
model must not turn a response into a 500. Whitespace that only separates calls from each other or
from the end of the message is dropped, as OpenAI returns it.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# What `%json{...}` in a forced-call grammar generates: json.dumps' separators, no free whitespace
# (see hybridlm.engine.grammar.JSON_STYLE).
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON object text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @staticmethod
    def of(name: str, arguments: dict[str, Any]) -> ToolCall:
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def tool_functions(tools: list[dict] | None) -> dict[str, dict]:
    """name -> the function's JSON schema of parameters, for OpenAI-shaped `tools`."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {"type": "object"}
    return out


def json_rule(schema: dict | bool) -> str:
    """A Lark `%json{...}` term generating `schema` in json.dumps' style."""
    if schema is True or schema == {}:
        schema = {}
    body = dict(schema) if isinstance(schema, dict) else {"not": {}}
    body["x-guidance"] = _X_GUIDANCE
    return "%json " + json.dumps(body, ensure_ascii=False)


def text_rule(schema: dict) -> str:
    """A Lark term for a string parameter written as raw text up to the next "<" (the closing tag of
    XML-like formats), honouring the schema's enum, minLength and maxLength."""
    if isinstance(schema.get("enum"), list) and all(
        isinstance(v, str) and "<" not in v for v in schema["enum"]
    ):
        return "(" + " | ".join(lark_string(v) for v in schema["enum"]) + ")"
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if isinstance(high, int):
        return f"/[^<]{{{int(low)},{high}}}/"
    return f"/[^<]{{{int(low)},}}/" if isinstance(low, int) and low > 0 else "/[^<]*/"


def is_text(schema) -> bool:
    """A parameter whose schema says it is a string."""
    return isinstance(schema, dict) and schema.get("type") == "string"


def typed_value(text: str, schema: dict) -> object:
    """A parameter's value written as text (the XML-like formats: strings raw, other types as JSON) as
    the type its schema names (untyped: JSON if it parses, else text)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def tagged_arguments(pattern: re.Pattern, text: str, at: int, props: dict) -> dict | None:
    """The arguments of the formats that write each one between tags: the (key, value text) pairs
    `pattern` matches (groups 1 and 2) back to back in `text` from `at` to its end, values typed by
    the parameters' schemas `props` (`typed_value`); None where anything else stands between or after
    them."""
    args = {}
    for m in pattern.finditer(text, at):
        if m.start() != at:
            return None
        key = m.group(1).strip()
        args[key] = typed_value(m.group(2), props.get(key, {}))
        at = m.end()
    return None if text[at:].strip() else args


def tagged_grammar(
    fmt: ToolFormat,
    functions: dict[str, dict],
    parallel: bool,
    special: dict[str, int],
    head: Callable[[str], str],
    argument: Callable[[str, str], str],
    tail: str = "",
    opening: str = "",
    closing: str = '"\\n"',
    separator: str = '"\\n"',
) -> str:
    """`ToolFormat.grammar` of the formats that write each argument between tags: a call is `fmt.begin`,
    `opening`, `head(name)`, `argument(key, value)` for every declared parameter in schema order
    (optional ones too: still valid), `tail`, `closing` (a newline) and `fmt.end` (all Lark terms);
    parallel calls follow one another after `separator` (a newline). A value is text up to the next
    "<" (string parameters) or JSON."""
    rules, names = [], []
    for i, (name, params) in enumerate(functions.items()):
        parts = []
        for j, (key, schema) in enumerate(params.get("properties", {}).items()):
            value = f"v{i}_{j}"
            rules.append(f"{value}: " + (text_rule(schema) if is_text(schema) else json_rule(schema)))
            parts.append(argument(key, value))
        names.append(f"f{i}")
        rules.append(" ".join(t for t in (f"f{i}:", head(name), *parts, tail) if t))
    begin, end = marker(fmt.begin, special), marker(fmt.end, special)
    repeat = f" ({separator} call)*" if parallel else ""
    call = " ".join(t for t in (begin, opening, f'({" | ".join(names)})', closing, end) if t)
    return f"start: call{repeat}\ncall: {call}\n" + "\n".join(rules) + "\n"


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class ToolFormat(ABC):
    """One published tool-call syntax.

    begin / end: the markers around a call block. whole_message: instead, a message that starts
    with one of `openers` is one block of calls up to its end (Llama 3's JSON calls).
    """

    name: str
    begin: str = ""
    end: str = ""
    whole_message = False
    openers: tuple[str, ...] = ()

    @abstractmethod
    def parse(self, block: str, functions: dict[str, dict]) -> list[ToolCall] | None:
        """The calls in one block's text between the markers; None when it does not parse.
        `functions`: name -> parameter schema (formats whose values are untyped text read the types)."""

    @abstractmethod
    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        """A Lark grammar (llguidance dialect) generating one call of one of `functions` (several
        when `parallel`), markers included. `special`: marker text -> id of the special token the
        tokenizer has for it (a special token never matches text, so the grammar names its id)."""

    def markers(self) -> tuple[str, ...]:
        """Every marker text the format's grammar may use (looked up as special tokens)."""
        return (self.begin, self.end)


def marker(text: str, special: dict[str, int]) -> str:
    """A marker in a grammar: the special token (`<[id]>`) when the tokenizer has one, else its text."""
    return f"<[{special[text]}]>" if text in special else lark_string(text)


class ToolCallStream:
    """Splits model text, fed in any pieces, into content strings and `ToolCall`s, in order.
    Whatever the piece boundaries, the concatenated content and the calls are the same."""

    def __init__(self, fmt: ToolFormat, functions: dict[str, dict]):
        self.fmt = fmt
        self.functions = functions
        self.calls = 0
        self._buffer = ""
        self._inside = False
        self._pending_space = ""  # trailing whitespace of content, emitted once more content follows
        self._after_call = False  # drop whitespace right after a call
        self._started = False  # whole-message formats: whether the message's start was seen

    def feed(self, text: str) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        self._buffer += text
        if self.fmt.whole_message:
            if not self._started:
                head = self._buffer.lstrip()
                opens = [o for o in self.fmt.openers if o.startswith(head[: len(o)])]
                if not head or any(len(head) < len(o) for o in opens):
                    return out  # cannot tell yet
                self._started, self._inside = True, bool(opens)
            if not self._inside:
                self._content(self._buffer, out)
                self._buffer = ""
            return out  # a call block runs to the end of the message
        while True:
            if not self._inside:
                at = self._buffer.find(self.fmt.begin)
                if at < 0:
                    keep = partial_suffix(self._buffer, self.fmt.begin)
                    self._content(self._buffer[: len(self._buffer) - keep], out)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                self._content(self._buffer[:at], out)
                self._buffer = self._buffer[at:]
                self._inside = True
            end = self._buffer.find(self.fmt.end, len(self.fmt.begin))
            if end < 0:
                return out
            stop = end + len(self.fmt.end)
            self._block(self._buffer[:stop], self._buffer[len(self.fmt.begin) : end], out)
            self._buffer = self._buffer[stop:]
            self._inside = False

    def close(self) -> list[str | ToolCall]:
        """The rest at the end of the output (an unterminated block is content)."""
        out: list[str | ToolCall] = []
        text, self._buffer = self._buffer, ""
        if self.fmt.whole_message and (self._inside or not self._started) and text.strip():
            self._block(text, text.strip(), out)
        else:
            self._content(text, out)
        if not self.calls and self._pending_space:
            out.append(self._pending_space)
        self._pending_space = ""
        return out

    def _block(self, raw: str, body: str, out: list[str | ToolCall]) -> None:
        calls = self.fmt.parse(body, self.functions)
        if not calls:
            self._content(raw, out)
            return
        self._pending_space = ""
        self._after_call = True
        self.calls += len(calls)
        out.extend(calls)

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            out.append(self._pending_space + body)
            self._pending_space = ""
        self._pending_space += text[len(body) :]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
