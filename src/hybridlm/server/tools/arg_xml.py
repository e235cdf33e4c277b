"""The key / value calls of GLM-4.5 and later (GLM-4.7, GLM-5.3) and Ling 3.0, one block per call:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 and later write no newlines between the parts; whitespace between them is not part of any
value.) Values are written as text (other types as JSON), so the parameter schema gives their types,
as in the Qwen XML calls.
"""

from __future__ import annotations

import re

from hybridlm.server.tools.base import (
    ToolCall,
    ToolFormat,
    is_text,
    json_rule,
    lark_string,
    marker,
    text_rule,
    typed_value,
)

_NAME = re.compile(r"\s*([^<>\s][^<>\n]*?)\s*(?=<arg_key>|$)", re.DOTALL)
_ARGUMENT = re.compile(r"\s*<arg_key>([^<]*)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


class ArgXml(ToolFormat):
    name = "glm45"
    begin = "<tool_call>"
    end = "</tool_call>"

    def parse(self, block: str, functions: dict[str, dict]) -> list[ToolCall] | None:
        m = _NAME.match(block)
        if m is None:
            return None
        name, at = m.group(1), m.end()
        props = functions.get(name, {}).get("properties", {})
        args = {}
        for a in _ARGUMENT.finditer(block, at):
            if a.start() != at:
                return None
            key = a.group(1).strip()
            args[key] = typed_value(a.group(2), props.get(key, {}))
            at = a.end()
        if block[at:].strip():
            return None
        return [ToolCall.of(name, args)]

    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        rules, names = [], []
        for i, (name, params) in enumerate(functions.items()):
            parts = []  # every declared parameter, in schema order (optional ones too: still valid)
            for j, (key, schema) in enumerate(params.get("properties", {}).items()):
                value = f"v{i}_{j}"
                # Text values end at the next "<" (the closing tag); other types are JSON.
                rules.append(f"{value}: " + (text_rule(schema) if is_text(schema) else json_rule(schema)))
                key_text = lark_string(f"<arg_key>{key}</arg_key>")
                parts.append(f'"\\n" {key_text} "\\n<arg_value>" {value} "</arg_value>"')
            names.append(f"f{i}")
            rules.append(f"f{i}: {lark_string(name)} {' '.join(parts)}")
        begin, end = marker(self.begin, special), marker(self.end, special)
        repeat = ' ("\\n" call)*' if parallel else ""
        head = f'start: call{repeat}\ncall: {begin} ({" | ".join(names)}) "\\n" {end}\n'
        return head + "\n".join(rules) + "\n"
