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

from hybridlm.server.tools.base import ToolCall, ToolFormat, lark_string, tagged_arguments, tagged_grammar

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
        name = m.group(1)
        args = tagged_arguments(_ARGUMENT, block, m.end(), functions.get(name, {}).get("properties", {}))
        return None if args is None else [ToolCall.of(name, args)]

    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        # A newline before each key, value, the end and the next call (GLM-4.5, Ling 3.0) or none
        # (GLM-4.7 and later): the model writes its own layout
        return tagged_grammar(
            self, functions, parallel, special,
            head=lark_string,
            argument=lambda key, value: (
                f'"\\n"? {lark_string(f"<arg_key>{key}</arg_key>")} "\\n"? "<arg_value>" {value}'
                ' "</arg_value>"'
            ),
            closing='"\\n"?',
            separator='"\\n"?',
        )
