"""Hermes-style JSON calls (Qwen3, Qwen2.5, the demo model):
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block per call."""

from __future__ import annotations

import json

from hybridlm.server.tools.base import ToolCall, ToolFormat, json_rule, marker


class Hermes(ToolFormat):
    name = "hermes"
    begin = "<tool_call>"
    end = "</tool_call>"

    def parse(self, block: str, functions: dict[str, dict]) -> list[ToolCall] | None:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", call.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        return [ToolCall.of(call["name"], args)] if isinstance(args, dict) else None

    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        # The template writes {"name": ..., "arguments": ...}: the same keys in the same order.
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, params in functions.items()
            ]
        }
        begin, end = marker(self.begin, special), marker(self.end, special)
        repeat = ' ("\\n" call)*' if parallel else ""
        return f'start: call{repeat}\ncall: {begin} "\\n" body "\\n" {end}\nbody: {json_rule(schema)}\n'
