"""`n > 1` through the real server and the openai client: n choices with their index, choice i equal
to the same request with n = 1 and seed + i, greedy choices equal, streamed chunks carrying their
choice's index, usage counting the prompt once, a disconnect cancelling every choice."""

from __future__ import annotations

import json
import time

import httpx

from tests.server.conftest import MODEL
from tests.server.test_concurrency import CANCELLED, TOKENS, wait_idle

MESSAGES = [{"role": "user", "content": "Tell me a story about a robot"}]
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 5, "max_tokens": 10, "extra_body": {"ignore_eos": True}}


def test_chat_choices_equal_their_seeded_requests(client):
    many = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, **SAMPLED)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **{**SAMPLED, "seed": 5 + i})
        for i in range(3)
    ]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in many.choices}) > 1
    # OpenAI's counting: the prompt once, every choice's completion tokens.
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 30


def test_greedy_completion_choices_are_equal(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=8, temperature=0)
    alone = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert [c.text for c in out.choices] == [alone.choices[0].text] * 2
    assert [c.index for c in out.choices] == [0, 1]


def test_streamed_chunks_carry_their_choice_index(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    texts, finished, usage = {0: "", 1: ""}, set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, **SAMPLED)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finished == {0, 1}
    assert usage is not None and usage.completion_tokens == 20
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_disconnect_cancels_every_choice(server, auth):
    before = server.metrics(auth)
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 5000, "ignore_eos": True, "stream": True}
    body["n"] = 3
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url + "/v1/completions", json=body, headers=auth) as r,
    ):
        lines, seen = r.iter_lines(), set()
        while len(seen) < 3:  # every choice is streaming
            line = next(lines)
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
    _, after = wait_idle(server, auth, timeout=5)
    assert after[CANCELLED] == before[CANCELLED] + 3  # each choice ended cancelled
    time.sleep(0.1)
    assert server.metrics(auth)[TOKENS] == after[TOKENS]  # nothing runs in the background
