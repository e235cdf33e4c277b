"""Gemma 4's calls, one block per call:
`<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>`.

Keys are bare; strings sit between `<|"|>` quote tokens; numbers, true / false / null are bare;
arrays are `[...]` and objects `{key:value,...}`. JSON-quoted strings and keys are read too.
"""

from __future__ import annotations

import json
import re

from hybridlm.server.tools.base import (
    ToolCall,
    ToolFormat,
    is_text,
    json_rule,
    lark_string,
    marker,
    text_rule,
)

QUOTE = '<|"|>'
_HEAD = re.compile(r"\s*call:([A-Za-z_][\w.\-]*)\s*(?=\{)")
_KEY = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*:")
_BARE = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)")


class _Reader:
    """Recursive descent over Gemma 4's value syntax; raises ValueError where it does not fit."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def skip(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def take(self, token: str) -> bool:
        self.skip()
        if self.text.startswith(token, self.at):
            self.at += len(token)
            return True
        return False

    def value(self) -> object:
        self.skip()
        if self.take(QUOTE):
            end = self.text.find(QUOTE, self.at)
            if end < 0:
                raise ValueError("unterminated string")
            s, self.at = self.text[self.at : end], end + len(QUOTE)
            return s
        if self.text.startswith('"', self.at):
            s, self.at = json.JSONDecoder().raw_decode(self.text, self.at)
            return s
        if self.take("["):
            items: list = []
            while not self.take("]"):
                if items and not self.take(","):
                    raise ValueError("expected , in a list")
                items.append(self.value())
            return items
        if self.text.startswith("{", self.at):
            return self.mapping()
        m = _BARE.match(self.text, self.at)
        if m is None:
            raise ValueError(f"unexpected value at {self.at}")
        self.at = m.end()
        return json.loads(m.group(1))

    def mapping(self) -> dict:
        if not self.take("{"):
            raise ValueError("expected {")
        out: dict = {}
        while not self.take("}"):
            if out and not self.take(","):
                raise ValueError("expected , in an object")
            self.skip()
            if self.text.startswith('"', self.at):
                key, self.at = json.JSONDecoder().raw_decode(self.text, self.at)
                if not self.take(":"):
                    raise ValueError("expected :")
            elif (m := _KEY.match(self.text, self.at)) is not None:
                key, self.at = m.group(1), m.end()
            else:
                raise ValueError(f"expected a key at {self.at}")
            out[key] = self.value()
        return out


class Gemma4(ToolFormat):
    name = "gemma4"
    begin = "<|tool_call>"
    end = "<tool_call|>"

    def parse(self, block: str, functions: dict[str, dict]) -> list[ToolCall] | None:
        m = _HEAD.match(block)
        if m is None:
            return None
        reader = _Reader(block)
        reader.at = m.end()
        try:
            args = reader.mapping()
        except (ValueError, json.JSONDecodeError):
            return None
        if block[reader.at :].strip():
            return None
        return [ToolCall.of(m.group(1), args)]

    def markers(self) -> tuple[str, ...]:
        return (self.begin, self.end, QUOTE)

    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        quote = marker(QUOTE, special)
        rules, names = [], []
        for i, (name, params) in enumerate(functions.items()):
            parts = []  # every declared parameter, in schema order (optional ones too: still valid)
            for j, (key, schema) in enumerate(params.get("properties", {}).items()):
                value = f"{quote} {text_rule(schema)} {quote}" if is_text(schema) else json_rule(schema)
                rules.append(f"v{i}_{j}: {value}")
                parts.append(f"{lark_string(key + ':')} v{i}_{j}")
            names.append(f"f{i}")
            args = ' "," '.join(parts) or '""'
            rules.append(f'f{i}: {lark_string("call:" + name + "{")} {args} "}}"')
        begin, end = marker(self.begin, special), marker(self.end, special)
        repeat = " call*" if parallel else ""
        head = f"start: call{repeat}\ncall: {begin} ({' | '.join(names)}) {end}\n"
        return head + "\n".join(rules) + "\n"
