"""The XML calls of Qwen3.5 and Qwen3-Coder, one block per call:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are written as text (objects and arrays as JSON), so the parameter schema gives their types.
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

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


class QwenXml(ToolFormat):
    name = "qwen3_xml"
    begin = "<tool_call>"
    end = "</tool_call>"

    def parse(self, block: str, functions: dict[str, dict]) -> list[ToolCall] | None:
        m = _FUNCTION.fullmatch(block)
        if m is None:
            return None
        name, body = m.group(1).strip(), m.group(2)
        props = functions.get(name, {}).get("properties", {})
        args, at = {}, 0
        for p in _PARAMETER.finditer(body):
            if p.start() != at:
                return None
            key = p.group(1).strip()
            args[key] = typed_value(p.group(2), props.get(key, {}))
            at = p.end()
        if body[at:].strip():
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
                opening = lark_string(f"<parameter={key}>" + "\n")
                term = f'{opening} {value} "\\n</parameter>\\n"'
                parts.append(term)
            names.append(f"f{i}")
            head = lark_string(f"<function={name}>" + "\n")
            rules.append(f'f{i}: {head} {" ".join(parts)} "</function>"')
        begin, end = marker(self.begin, special), marker(self.end, special)
        repeat = ' ("\\n" call)*' if parallel else ""
        head = f'start: call{repeat}\ncall: {begin} "\\n" ({" | ".join(names)}) "\\n" {end}\n'
        return head + "\n".join(rules) + "\n"
