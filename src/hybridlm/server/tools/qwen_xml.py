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

from hybridlm.server.tools.base import ToolCall, ToolFormat, lark_string, tagged_arguments, tagged_grammar

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
        name = m.group(1).strip()
        args = tagged_arguments(_PARAMETER, m.group(2), 0, functions.get(name, {}).get("properties", {}))
        return None if args is None else [ToolCall.of(name, args)]

    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        def argument(key: str, value: str) -> str:
            return lark_string(f"<parameter={key}>\n") + f' {value} "\\n</parameter>\\n"'

        return tagged_grammar(
            self, functions, parallel, special,
            head=lambda name: lark_string(f"<function={name}>\n"),
            argument=argument,
            tail='"</function>"',
            opening='"\\n"',
        )
