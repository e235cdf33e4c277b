"""LFM2's pythonic call list between its tool-call tokens:
`<|tool_call_start|>[get_weather(city="Paris"), get_time()]<|tool_call_end|>`."""

from __future__ import annotations

import ast

from hybridlm.server.tools.base import ToolCall, ToolFormat, json_rule, lark_string, marker

_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr) -> object:
    """A Python (or JSON-spelled) literal; raises ValueError for anything else."""
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)


class Pythonic(ToolFormat):
    name = "pythonic"
    begin = "<|tool_call_start|>"
    end = "<|tool_call_end|>"

    def parse(self, block: str, functions: dict[str, dict]) -> list[ToolCall] | None:
        try:
            tree = ast.parse(block.strip(), mode="eval").body
        except (SyntaxError, ValueError):
            return None
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, TypeError, SyntaxError):
                return None
            if len(args) != len(node.keywords):
                return None
            calls.append(ToolCall.of(node.func.id, args))
        return calls or None

    def grammar(self, functions: dict[str, dict], parallel: bool, special: dict[str, int]) -> str:
        rules, names = [], []
        for i, (name, params) in enumerate(functions.items()):
            # Every declared parameter, in schema order (optional ones too: still valid). JSON
            # strings and numbers are Python literals, and the parser reads true / false / null.
            parts = []
            for j, (key, schema) in enumerate(params.get("properties", {}).items()):
                rules.append(f"v{i}_{j}: {json_rule(schema)}")
                parts.append(f"{lark_string(key + '=')} v{i}_{j}")
            names.append(f"f{i}")
            args = ' ", " '.join(parts) or '""'
            rules.append(f'f{i}: {lark_string(name + "(")} {args} ")"')
        begin, end = marker(self.begin, special), marker(self.end, special)
        repeat = ' (", " call)*' if parallel else ""
        head = f'start: {begin} "[" call{repeat} "]" {end}\ncall: {" | ".join(names)}\n'
        return head + "\n".join(rules) + "\n"
