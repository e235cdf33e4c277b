"""Anthropic's streaming events for an answer with reasoning, text and a tool call, in Anthropic's
order, whatever the streamed piece boundaries."""

from __future__ import annotations

import asyncio
import json

from hybridlm.engine import Event, Usage
from hybridlm.server.anthropic import _events
from hybridlm.server.chat import plan_chat
from tests.server.test_tools import TOOLS


class FakeStream:
    def __init__(self, events):
        self.events = events

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for e in self.events:
            yield e

    def cancel(self):
        pass


def run(plan, pieces: list[str]) -> list[dict]:
    events = [Event((1,), p) for p in pieces[:-1]]
    events.append(Event((2,), pieces[-1], finish_reason="stop", usage=Usage(10, 5, 4)))

    async def collect():
        return [chunk async for chunk in _events(None, FakeStream(events), plan, {"id": "msg_1"}, 10)]

    out = []
    for chunk in asyncio.run(collect()):
        kind, data = chunk.decode().strip().split("\n")
        out.append(json.loads(data.removeprefix("data: ")) | {"event": kind.removeprefix("event: ")})
    return out


def test_thinking_text_and_tool_use_blocks_in_order(tokenizer):
    plan = plan_chat(tokenizer, [{"role": "user", "content": "hi"}], TOOLS)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    text = "<think>\nhm\n</think>\n\nOk.\n" + call
    for cut in range(1, len(text), 7):
        events = run(plan, [text[:cut], text[cut:]])
        kinds = [e["event"] for e in events if e["event"] != "content_block_delta"]
        assert kinds == [
            "message_start",
            *["content_block_start", "content_block_stop"] * 3,
            "message_delta",
            "message_stop",
        ]
        starts = [e["content_block"]["type"] for e in events if e["event"] == "content_block_start"]
        assert starts == ["thinking", "text", "tool_use"]
        deltas = [e["delta"] for e in events if e["event"] == "content_block_delta"]
        assert "".join(d.get("thinking", "") for d in deltas) == "hm"
        assert "".join(d.get("text", "") for d in deltas) == "Ok."
        assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == {"city": "Rome"}
        final = events[-2]
        assert final["delta"]["stop_reason"] == "tool_use"
        assert final["usage"] == {
            "input_tokens": 6,
            "output_tokens": 5,
            "cache_read_input_tokens": 4,
            "cache_creation_input_tokens": 0,
        }
