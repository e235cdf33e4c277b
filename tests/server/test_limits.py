"""The small server (settings from HYBRIDLM_* variables, the README's no --model path): the queue bound,
the context length, and graceful shutdown on SIGTERM (last, as it stops the server)."""

from __future__ import annotations

import signal

import httpx

from tests.server.test_errors import COMPLETIONS, assert_openai_error


def test_queue_full_gets_429_and_others_are_undisturbed(small_server):
    """max_queue 1 (from HYBRIDLM_MAX_QUEUE): one running, one waiting, the third is refused."""
    url = small_server.url + COMPLETIONS
    long = {"prompt": [1, 2, 3], "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=long) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # generating now
        with http.stream("POST", url, json=long) as waiting:
            assert waiting.status_code == 200  # queued: headers go out at once
            refused = httpx.post(url, json={**long, "stream": False})
            assert_openai_error(refused, 429, None, "queue_full")
            assert refused.headers["retry-after"] == "1"
            # The Responses API words it as OpenAI's Responses clients know it.
            refused = httpx.post(
                small_server.url + "/v1/responses", json={"input": "x", "max_output_tokens": 2}
            )
            assert_openai_error(refused, 429, None, "rate_limit_exceeded")
            tail = [line for line in waiting.iter_lines() if line]
        rest = [line for line in lines if line]
    # Both accepted requests ran to completion, unaffected by the refusal.
    for stream in (rest, tail):
        assert stream[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in stream[-2]
    r = httpx.post(url, json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_context_length_from_environment(small_server):
    url = small_server.url + COMPLETIONS
    error = assert_openai_error(
        httpx.post(url, json={"prompt": [5] * 256}), 400, "prompt", "context_length_exceeded"
    )
    assert "256" in error["message"]
    r = httpx.post(url, json={"prompt": [5] * 250, "max_tokens": 50, "ignore_eos": True}).json()
    assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (6, "length")


def test_sigterm_lets_a_running_stream_finish(small_server):
    """Last in this module: it stops the server."""
    server = small_server
    body = {"prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        server.proc.send_signal(signal.SIGTERM)  # SIGTERM while generating
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    assert server.proc.wait(30) == 0
    log = server.log.read_text()
    assert "Traceback" not in log, log
