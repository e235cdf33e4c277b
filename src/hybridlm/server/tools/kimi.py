"""Kimi's calls (Kimi K2, Kimi-Linear): a section of calls between its section tokens, each call
`<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`.

The call's id is its `functions.NAME:INDEX` (what Kimi's template writes back into the history, so
the model reads its own ids again on the next turn); the index counts the calls of the message."""

from __future__ import annotations

import json
import re

from hybridlm.server.tools.base import ToolCall, ToolFormat, json_rule, lark_string, marker

CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"\s*((?:functions\.)?([^\s:<]+):\d+)\s*" + re.escape(ARGUMENTS) + r"(.*?)"
    + re.escape(CALL_END),
    re.DOTALL,
)


class Kimi(ToolFormat):
    name = "kimi"
    begin = "<|tool_calls_section_begin|>"
    end = "<|tool_calls_section_end|>"

    def parse(self, block: str, functions: dict[str, dict]) -> list[ToolCall] | None:
        calls, at = [], 0
        for match in _CALL.finditer(block):
            if block[at : match.start()].strip():  # text between calls: not this format
                return None
            at = match.end()
            try:
                args = json.loads(match.group(3))
            except json.JSONDecodeError:
                return None
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall(match.group(2), json.dumps(args, ensure_ascii=False), id=match.group(1)))
        if block[at:].strip():
            return None
        return calls or None

    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        begin, end = marker(self.begin, special), marker(self.end, special)
        call_begin, arguments, call_end = (marker(m, special) for m in (CALL_BEGIN, ARGUMENTS, CALL_END))
        rules, names = [], []
        for i, (name, params) in enumerate(functions.items()):
            rules.append(f"a{i}: {json_rule(params)}")
            names.append(f"{lark_string('functions.' + name + ':')} index {arguments} a{i}")
        calls = "call+" if parallel else "call"
        return (
            f"start: {begin} {calls} {end}\n"
            f"call: {call_begin} ({' | '.join(names)}) {call_end}\n"
            "index: /[0-9]{1,3}/\n" + "\n".join(rules) + "\n"
        )

    def markers(self) -> tuple[str, ...]:
        return (self.begin, self.end, CALL_BEGIN, ARGUMENTS, CALL_END)
