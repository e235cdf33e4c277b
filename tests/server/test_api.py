"""The OpenAI-compatible API through the official `openai` client against a real server process."""

from __future__ import annotations

import httpx

from tests.server.conftest import CONTEXT, MODEL

HELLO = [{"role": "user", "content": "Write a haiku about caches."}]


def test_health_models_and_metrics(server, client, auth):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == CONTEXT
    m = server.metrics(auth)
    assert m["hybridlm_context_length"] == CONTEXT and m["hybridlm_queue_limit"] == 64
    assert m[f'hybridlm_model_info{{model="{MODEL}"}}'] == 1


def test_chat_non_streaming_and_usage(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(HELLO))
    assert r.usage.prompt_tokens == len(prompt)
    # The session's server is shared by every server test file, and the trie reuses any shared
    # prefix (the template's opening tokens at least): what ran before decides how much is cached.
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 12
    else:
        assert choice.finish_reason == "stop" and r.usage.completion_tokens <= 12


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [whole.choices[0].finish_reason]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    last = chunks[-1]
    assert last.choices == [] and all(getattr(last.usage, k) == getattr(whole.usage, k) for k in counts)
    assert all(c.usage is None for c in chunks[:-1])
    # The same prompt a second time: everything but the seed token comes from the prefix cache.
    prompt = whole.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert last.usage.cache == {
        "cached_tokens": prompt - 1,
        "replayed_tokens": 0,
        "prefilled_tokens": 1,
        "restore_ms": last.usage.cache["restore_ms"],
    }


def test_sse_wire_format_ends_with_done(server, auth):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1


def test_completions_with_token_ids_equals_text_prompt(client, tokenizer):
    text = "def fibonacci(n):"
    ids = tokenizer.encode(text, add_special_tokens=True)
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.object == "text_completion"
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    streamed = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == by_ids.choices[0].text


def test_max_tokens_and_max_completion_tokens(client):
    r = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (7, "length")
    r = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "length")


def test_stop_strings(client):
    prompt = [11, 12, 13, 14]
    free = (
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    cut = free[: free.find(stop)]
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=30,
        temperature=0,
        stop=[stop, "@@@"],
        extra_body={"ignore_eos": True},
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=30,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(
        model=MODEL, messages=HELLO, max_tokens=16, temperature=1.0, top_p=0.9, extra_body={"top_k": 40}
    )
    a = client.chat.completions.create(**kwargs, seed=42).choices[0].message.content
    b = client.chat.completions.create(**kwargs, seed=42).choices[0].message.content
    c = client.chat.completions.create(**kwargs, seed=43).choices[0].message.content
    streamed = client.chat.completions.create(**kwargs, seed=42, stream=True)
    assert a == b == "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert a != c


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy picks the most likely token
    c = client.completions.create(
        model=MODEL,
        prompt=[1, 2, 3],
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4


def test_penalties_and_sampling_knobs_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.2, "min_p": 0.05, "top_k": 20},
    )
    assert r.usage.completion_tokens >= 1
