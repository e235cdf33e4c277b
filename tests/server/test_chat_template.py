"""The server's chat prompts equal transformers' `apply_chat_template` for the demo checkpoint."""

from __future__ import annotations

import httpx
import pytest

from hybridlm.server.protocol import ChatCompletionRequest, render_chat
from tests.server.conftest import MODEL

transformers = pytest.importorskip("transformers")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

CASES = {
    "plain": dict(messages=[{"role": "user", "content": "Hi"}]),
    "system-and-history": dict(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "One?"},
            {"role": "assistant", "content": "Two."},
            {"role": "user", "content": "Three?"},
        ]
    ),
    "tools-and-tool-calls": dict(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
        tools=[WEATHER],
    ),
    "reasoning-in-history": dict(
        messages=[
            {"role": "user", "content": "Think first: 2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "<think>\nthree and three\n</think>\n\n6"},
        ],
        add_generation_prompt=False,
    ),
    "thinking-off": dict(
        messages=[{"role": "user", "content": "Quick."}], chat_template_kwargs={"enable_thinking": False}
    ),
    "content-parts": dict(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    ),
}


@pytest.fixture(scope="module")
def hf_tokenizer(demo_dir):
    return transformers.AutoTokenizer.from_pretrained(demo_dir)


def hf_render(hf_tokenizer, case: dict) -> str:
    return hf_tokenizer.apply_chat_template(
        case["messages"],
        tools=case.get("tools"),
        add_generation_prompt=case.get("add_generation_prompt", True),
        tokenize=False,
        **case.get("chat_template_kwargs", {}),
    )


@pytest.mark.parametrize("name", list(CASES))
def test_render_equals_transformers(tokenizer, hf_tokenizer, name):
    case = CASES[name]
    ours = render_chat(tokenizer, ChatCompletionRequest.model_validate(case))
    assert ours == hf_render(hf_tokenizer, case)


@pytest.mark.parametrize("name", ["tools-and-tool-calls", "thinking-off"])
def test_server_prompt_tokens_match_transformers(server, auth, hf_tokenizer, name):
    case = CASES[name]
    expected = hf_tokenizer(hf_render(hf_tokenizer, case), add_special_tokens=False)["input_ids"]
    body = {"model": MODEL, "max_tokens": 1, **case}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
