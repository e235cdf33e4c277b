"""Disconnects cancel, concurrent clients get exactly their solo answers, SIGTERM drains gracefully."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from tests.server.conftest import API_KEY, MODEL

RUNNING = "hybridlm_requests_running"
CANCELLED = 'hybridlm_requests_finished_total{reason="cancelled"}'
TOKENS = "hybridlm_generation_tokens_total"


def wait_idle(server, auth, timeout: float) -> tuple[float, dict]:
    """Seconds until the engine runs nothing, and the metrics then."""
    start = time.monotonic()
    while True:
        m = server.metrics(auth)
        if m[RUNNING] == 0 and m["hybridlm_queue_depth"] == 0:
            return time.monotonic() - start, m
        assert time.monotonic() - start < timeout, m
        time.sleep(0.005)


def test_disconnect_mid_stream_stops_generation(server, auth):
    before = server.metrics(auth)
    body = {
        "model": MODEL,
        "prompt": [3, 4, 5],
        "max_tokens": 5000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url + "/v1/completions", json=body, headers=auth) as r,
    ):
        lines, chunks = r.iter_lines(), 0
        while chunks < 5:
            chunks += next(lines).startswith("data: {")
        assert server.metrics(auth)[RUNNING] == 1
    # Leaving the blocks closed the connection.
    seconds, after = wait_idle(server, auth, timeout=5)
    assert seconds < 2.0
    assert after[CANCELLED] == before[CANCELLED] + 1
    generated = after[TOKENS] - before[TOKENS]
    assert 5 <= generated < 200  # far from max_tokens: stopped at the disconnect
    time.sleep(0.1)
    assert server.metrics(auth)[TOKENS] == after[TOKENS]  # and nothing runs in the background


def test_disconnect_while_waiting_for_a_non_streaming_answer(server, auth):
    before = server.metrics(auth)
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 5000, "temperature": 0, "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=0.5)
        raise AssertionError("5000 tokens cannot be ready in 0.5 s")
    except httpx.ReadTimeout:
        pass
    _, after = wait_idle(server, auth, timeout=5)
    assert after[CANCELLED] == before[CANCELLED] + 1
    assert after[TOKENS] - before[TOKENS] < 1000


def test_twenty_concurrent_clients_get_their_solo_answers(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def request(i: int) -> dict:
        return dict(
            model=MODEL,
            messages=[{"role": "user", "content": f"Question number {i}?"}],
            max_tokens=12,
            temperature=0.9,
            top_p=0.95,
            seed=1000 + i,
        )

    async def ask(i: int, stream: bool) -> tuple[str, str, int]:
        if stream:
            chunks = await client.chat.completions.create(
                **request(i), stream=True, stream_options={"include_usage": True}
            )
            text, finish, tokens = "", None, None
            async for c in chunks:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
                if c.usage:
                    tokens = c.usage.completion_tokens
            return text, finish, tokens
        r = await client.chat.completions.create(**request(i))
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    async def main():
        # Every run after the first of a prompt restores it from the prefix cache and computes only
        # its last token, which in bf16 rounds differently from the same token inside a full
        # prefill. A solo pass first makes every compared run a cached one, so any difference
        # below can only come from the requests running concurrently.
        for i in range(20):
            await ask(i, stream=False)
        together = await asyncio.gather(*(ask(i, stream=i % 2 == 0) for i in range(20)))
        alone = [await ask(i, stream=False) for i in range(20)]
        await client.close()
        return together, alone

    together, alone = asyncio.run(main())
    assert together == alone
    assert all(finish in ("stop", "length") and tokens >= 1 for _, finish, tokens in together)
    assert len({text for text, _, _ in alone}) > 10  # distinct prompts and seeds, distinct answers
