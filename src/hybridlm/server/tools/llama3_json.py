"""Llama 3.x JSON calls: the assistant message is `{"name": "f", "parameters": {...}}` (optionally
after `<|python_tag|>`); several calls are separated by `;`."""

from __future__ import annotations

import json

from hybridlm.server.tools.base import ToolCall, ToolFormat, json_rule

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    whole_message = True
    openers = (PYTHON_TAG, "{")

    def parse(self, block: str, functions: dict[str, dict]) -> list[ToolCall] | None:
        text = block.removeprefix(PYTHON_TAG).strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(text):
            try:
                call, at = decoder.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            args = call.get("parameters", call.get("arguments", {}))
            if not isinstance(args, dict):
                return None
            calls.append(ToolCall.of(call["name"], args))
            rest = text[at:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            at = len(text) - len(rest.removeprefix(";").lstrip())
        return calls or None

    def markers(self) -> tuple[str, ...]:
        return (PYTHON_TAG,)

    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": params},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, params in functions.items()
            ]
        }
        repeat = ' ("; " call)*' if parallel else ""
        return f"start: call{repeat}\ncall: {json_rule(schema)}\n"
