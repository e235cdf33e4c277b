"""Tool calls in model output: one parser per published format, picked from what the checkpoint's
chat template emits (never from the model's name)."""

from __future__ import annotations

from hybridlm.server.tools.arg_xml import ArgXml
from hybridlm.server.tools.base import ToolCall, ToolCallStream, ToolFormat, tool_functions
from hybridlm.server.tools.gemma4 import Gemma4
from hybridlm.server.tools.hermes import Hermes
from hybridlm.server.tools.kimi import Kimi
from hybridlm.server.tools.llama3_json import Llama3Json
from hybridlm.server.tools.pythonic import Pythonic
from hybridlm.server.tools.qwen_xml import QwenXml

_ALL = (QwenXml(), ArgXml(), Pythonic(), Gemma4(), Kimi(), Hermes(), Llama3Json())
FORMATS: dict[str, ToolFormat] = {f.name: f for f in _ALL}


def detect(template: str | None) -> ToolFormat | None:
    """The format a chat template writes assistant tool calls in (None: none it knows)."""
    if not template:
        return None
    if "<function=" in template and "<parameter=" in template:
        return FORMATS["qwen3_xml"]
    if "<arg_key>" in template:
        return FORMATS["glm45"]
    if "<|tool_call_start|>" in template:
        return FORMATS["pythonic"]
    if "<|tool_call>" in template:
        return FORMATS["gemma4"]
    if "<|tool_calls_section_begin|>" in template:
        return FORMATS["kimi"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if '"parameters": ' in template and "<|start_header_id|>" in template:
        return FORMATS["llama3_json"]
    return None


__all__ = ["FORMATS", "ToolCall", "ToolCallStream", "ToolFormat", "detect", "tool_functions"]
