"""Hostile input against a real server process: every one is a 4xx in OpenAI's shape, never a 500,
and the server keeps serving (issue 11, points 1-3, 5, 8, 9)."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import pytest

from tests.server.conftest import MODEL
from tests.server.test_errors import CHAT, COMPLETIONS, answer, assert_openai_error

DEEP = 1000


def post(server, auth, path, content: bytes | str, **headers) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=content,
        headers={**auth, "Content-Type": "application/json", **headers},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("path", "content", "param"),
    [
        (CHAT, "[" * DEEP + "]" * DEEP, None),
        (CHAT, '{"messages": ' + "[" * DEEP + "]" * DEEP + "}", None),
        # Deep, yet within the JSON parser's own limit: refused before validation or templates see it.
        (CHAT, '{"messages": [{"role": "user", "content": ' + "[" * 500 + "]" * 500 + "}]}", "messages"),
        (COMPLETIONS, '{"prompt": "x", "stop": ' + "[" * 200 + "]" * 200 + "}", "stop"),
    ],
    ids=["bare-array", "in-messages", "under-parser-limit", "in-stop"],
)
def test_deeply_nested_json_is_a_400(server, auth, path, content, param):
    error = assert_openai_error(post(server, auth, path, content), 400, param)
    assert "nests deeper" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": "\ud800abc", "max_tokens": 2}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "\ud800abc"}], "max_tokens": 2}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": ["\udfff"]}, "stop"),
    ],
    ids=["prompt", "message-content", "stop"],
)
def test_lone_surrogate_is_a_400(server, auth, path, body, param):
    # json.dumps writes the surrogate as the escape "\ud800", as a hostile client would.
    error = assert_openai_error(post(server, auth, path, json.dumps(body)), 400, param)
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("top_p", [1e-40, 1e-45, 1.1754943508222875e-38])
def test_tiny_top_p_samples_the_top_token(server, auth, top_p):
    """top_p below float32's normal range keeps only the most likely token: the sampled answer equals
    the greedy one, streamed or not."""
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 6, "ignore_eos": True}
    greedy = httpx.post(server.url + COMPLETIONS, json={**body, "temperature": 0}, headers=auth, timeout=60)
    sampled = httpx.post(server.url + COMPLETIONS, json={**body, "top_p": top_p}, headers=auth, timeout=60)
    assert sampled.status_code == 200, sampled.text
    assert sampled.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    stream = httpx.post(
        server.url + COMPLETIONS, json={**body, "top_p": top_p, "stream": True}, headers=auth, timeout=60
    )
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert all("error" not in c for c in chunks), stream.text
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy.json()["choices"][0]["text"]


def answered(raw: bytes) -> bool:
    """Whether `raw` holds a whole response (its head and the body its Content-Length announces): read
    by its length, as an HTTP client reads it, not to the connection's end (a refused chunked body
    leaves the connection open until the server's body timeout)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return False
    fields = dict(line.lower().split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    return b"content-length" in fields and len(body) >= int(fields[b"content-length"])


def send_until_answered(server, auth, path: str, head: str, parts) -> httpx.Response:
    """POST over a raw socket: the head, then body parts until the server answers (a server that
    refuses a body early closes the connection; an HTTP client still writing would see a reset
    instead of the answer). Returns the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth['Authorization']}\r\n"
            f"Content-Type: application/json\r\n{head}\r\n".encode()
        )
        for part in parts:
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        raw = b""
        while not answered(raw) and (chunk := s.recv(1 << 16)):
            raw += chunk
    head_bytes, _, body = raw.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    return httpx.Response(status, content=body)


def test_body_over_the_limit_is_a_413(server, auth):
    """The default limit (16 MiB): refused from Content-Length before reading, and while reading a
    body of unknown length."""
    good_answer = answer(server, auth)
    declared = send_until_answered(server, auth, COMPLETIONS, f"Content-Length: {17 << 20}\r\n", [])
    assert_openai_error(declared, 413, None, "body_too_large")
    mib = b"a" * (1 << 20)
    chunks = [b'100000\r\n' + mib + b"\r\n"] * 17 + [b"0\r\n\r\n"]
    streamed = send_until_answered(server, auth, COMPLETIONS, "Transfer-Encoding: chunked\r\n", chunks)
    assert_openai_error(streamed, 413, None, "body_too_large")
    assert answer(server, auth) == good_answer


def test_max_body_flag(guarded):
    body = {"prompt": "a" * 70_000, "max_tokens": 1}
    assert_openai_error(httpx.post(guarded.url + COMPLETIONS, json=body), 413, None, "body_too_large")
    # Just under the limit (unknown fields are ignored): served.
    under = {"prompt": "hi", "max_tokens": 1, "padding": "x" * 60_000}
    assert httpx.post(guarded.url + COMPLETIONS, json=under).status_code == 200


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc", "/nothing", "/v1/models", "/metrics"])
def test_everything_but_health_needs_the_key(server, path):
    assert_openai_error(httpx.get(server.url + path), 401, None, "invalid_api_key")


def test_openapi_schema_describes_the_request_bodies(server, auth):
    schema = httpx.get(server.url + "/openapi.json", headers=auth).json()
    for path, model in ((CHAT, "ChatCompletionRequest"), (COMPLETIONS, "CompletionRequest")):
        ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and "temperature" in chat["properties"]
    assert "prompt" in schema["components"]["schemas"]["CompletionRequest"]["required"]


def test_client_disconnect_is_a_cancellation_not_a_shutdown(server, auth):
    key = f'hybridlm_http_requests_total{{endpoint="{COMPLETIONS}",status="%d"}}'
    before = server.metrics(auth)
    body = json.dumps({"prompt": "Once", "max_tokens": 3000, "ignore_eos": True}).encode()
    head = (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: {auth['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head + body)
        time.sleep(0.5)  # generating now
    deadline = time.monotonic() + 30
    while (now := server.metrics(auth)).get(key % 499, 0) <= before.get(key % 499, 0):
        assert time.monotonic() < deadline, "the disconnect was not counted"
        time.sleep(0.1)
    assert now.get(key % 503, 0) == before.get(key % 503, 0)
    cancelled = 'hybridlm_requests_finished_total{reason="cancelled"}'
    assert now[cancelled] == before[cancelled] + 1
