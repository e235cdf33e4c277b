"""An agent loop through the openai client (issue 10, acceptance 4): ten turns of forced tool call →
tool result → next request against a real server with a prefix cache. The history the client sends
back re-renders byte for byte to what was generated, and every turn's `cached_tokens` equals the
brute-force oracle: the longest common prefix with any sequence the server stored (each request's
prompt plus its output but the last, never-fed token), keeping one prompt token to seed decoding.

The output token ids come from the same checkpoint run in this process (float32 on both sides, so
greedy decoding agrees); each turn checks that this run wrote the very call the server returned.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

import hybridlm
from hybridlm.engine import Engine, SamplingParams
from hybridlm.server.chat import plan_chat, read_answer
from tests.server.conftest import MODEL, ServerProcess

TURNS = 10
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 10},
                "page": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["query", "page"],
            "additionalProperties": False,
        },
    },
}
FORCED = {"type": "function", "function": {"name": "lookup"}}


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def agent_server(demo_dir, tmp_path_factory):
    server = ServerProcess(
        ["--model", str(demo_dir), "--model-name", MODEL, "--dtype", "float32"],
        {},
        tmp_path_factory.mktemp("agent") / "server.log",
    ).ready()
    yield server
    assert server.stop() == 0, server.log.read_text()


def test_ten_turn_agent_loop_hits_the_cache_as_the_oracle_says(agent_server, demo_dir):
    torch.set_num_threads(1)
    demo = hybridlm.load_model(demo_dir, dtype=torch.float32)
    tok = demo.tokenizer
    client = openai.OpenAI(base_url=agent_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    messages = [
        {"role": "system", "content": "You are a research agent. Use the lookup tool."},
        {"role": "user", "content": "Find the boiling point of water."},
    ]
    stored: list[list[int]] = []
    previous_text, previous_prompt = None, 0
    with Engine(demo.lm, tok) as local:
        for turn in range(TURNS):
            plan = plan_chat(tok, messages, [LOOKUP], FORCED)
            if previous_text is not None:  # the history re-renders to what was generated
                assert plan.prompt.startswith(previous_text)
            prompt = tok.encode(plan.prompt)
            reply = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=[LOOKUP],
                tool_choice=FORCED,
                temperature=0,
                max_tokens=200,
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert reply.usage.prompt_tokens == len(prompt)
            expected = min(len(prompt) - 1, max((lcp(s, prompt) for s in stored), default=0))
            assert reply.usage.prompt_tokens_details.cached_tokens == expected, turn
            if turn:  # at least the whole previous prompt is reused (its generated call too, here)
                assert expected >= previous_prompt

            ours = local.generate(prompt, plan.params(SamplingParams(temperature=0.0, max_tokens=200)))
            (mine,) = read_answer(plan, ours.text).calls
            assert (mine.name, mine.arguments) == (call.function.name, call.function.arguments)
            stored.append(prompt + ours.token_ids[:-1])
            previous_text, previous_prompt = plan.prompt + ours.text, len(prompt)

            messages.append(
                {"role": "assistant", "content": choice.message.content, "tool_calls": [call.model_dump()]}
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"hits": turn})})
