"""Bad input gets the right status and an OpenAI-shaped body, and the server keeps serving."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

import hybridlm
from hybridlm.engine import Engine
from hybridlm.server import create_app
from tests.server.conftest import CONTEXT, MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}


CASES = [
    # (id, path, raw body or JSON object, status, param, code)
    ("malformed-json", CHAT, b'{"model": "demo", "messages": [', 400, None, None),
    ("not-an-object", CHAT, b"[1, 2]", 400, None, None),
    ("unknown-model", CHAT, chat(model="gpt-7"), 404, "model", "model_not_found"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", None),
    ("messages-not-a-list", CHAT, chat(messages="hi"), 400, "messages", None),
    ("bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages", None),
    ("n-zero", CHAT, chat(n=0), 400, "n", None),
    ("n-over-max-running", CHAT, chat(n=9), 400, "n", None),  # the server runs 8 sequences at once
    ("n-over-openai-bound", CHAT, chat(n=129), 400, "n", None),
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature", None),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature", None),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", None),
    ("top-k", CHAT, chat(top_k=-5), 400, "top_k", None),
    ("min-p", CHAT, chat(min_p=2), 400, "min_p", None),
    ("presence", CHAT, chat(presence_penalty=3), 400, "presence_penalty", None),
    ("frequency", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty", None),
    ("repetition", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty", None),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max-completion-tokens", CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens", None),
    ("seed-huge", CHAT, chat(seed=2**70), 400, "seed", None),
    ("stop-type", CHAT, chat(stop=5), 400, "stop", None),
    ("stop-empty", CHAT, chat(stop=[""]), 400, "stop", None),
    ("top-logprobs", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", None),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    (
        "prompt-over-context",
        CHAT,
        chat(messages=[{"role": "user", "content": "cache " * CONTEXT}]),
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "completion-token-out-of-vocab",
        COMPLETIONS,
        {"model": MODEL, "prompt": [1, 10**8]},
        400,
        "prompt",
        None,
    ),
    ("completion-empty-prompt", COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("completion-batch", COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    ("completion-echo", COMPLETIONS, {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo", None),
    (
        "completion-over-context",
        COMPLETIONS,
        {"model": MODEL, "prompt": [7] * CONTEXT},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "completion-logprobs",
        COMPLETIONS,
        {"model": MODEL, "prompt": "a", "logprobs": 99},
        400,
        "logprobs",
        None,
    ),
]


def assert_openai_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert (error["param"], error["code"]) == (param, code)
    return error


GOOD = chat(max_tokens=6, temperature=0.8, seed=3)


def answer(server, auth) -> dict:
    r = httpx.post(server.url + CHAT, json=GOOD, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    # Token counts only: repeating the request is served from the prefix cache, so its cache
    # figures differ from the first answer's by design.
    counts = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"message": body["choices"][0]["message"], "usage": counts}


@pytest.fixture(scope="module")
def good_answer(server, auth) -> dict:
    """What a valid request gets from an undisturbed server."""
    return answer(server, auth)


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_request_then_good_request(server, auth, good_answer, path, body, status, param, code):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        server.url + path, headers={**auth, "Content-Type": "application/json"}, timeout=30, **kwargs
    )
    error = assert_openai_error(r, status, param, code)
    if param:
        assert param in error["message"]
    assert answer(server, auth) == good_answer


def test_body_is_json_whatever_the_content_type(server, auth):
    r = httpx.post(
        server.url + CHAT,
        content=b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}',
        headers={**auth, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic sk-test-key", "Bearer"])
def test_api_key_required(server, header):
    headers = {"Authorization": header} if header else {}
    for method, path in [("POST", CHAT), ("POST", COMPLETIONS), ("GET", "/v1/models"), ("GET", "/metrics")]:
        r = httpx.request(method, server.url + path, json=chat(), headers=headers)
        assert_openai_error(r, 401, None, "invalid_api_key")
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_openai_client_raises_typed_errors(server):
    bad_key = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test-key", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-2)
    assert e.value.body["param"] == "temperature"


def test_unknown_route_and_method(server, auth):
    assert_openai_error(httpx.get(server.url + "/v1/nothing", headers=auth), 404)
    assert_openai_error(httpx.get(server.url + CHAT, headers=auth), 405)


def test_concurrent_bad_requests_do_not_disturb_a_stream(server, auth, client):
    """A stream keeps its exact output while malformed requests hit the server."""
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0.7, seed=9)
    alone = client.chat.completions.create(**kwargs).choices[0].message.content
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            httpx.post(server.url + CHAT, content=b"{broken", headers=auth)
            httpx.post(server.url + CHAT, json=chat(temperature=-5), headers=auth)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        streamed = client.chat.completions.create(**kwargs, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    finally:
        stop.set()
        thread.join()
    assert text == alone


def test_engine_failure_is_a_500_and_the_next_request_works(demo_dir, monkeypatch):
    """In-process (ASGI transport): a request whose forward fails gets a server_error, in the body or as the
    stream's last event, and the engine goes on serving."""
    model = hybridlm.load_model(demo_dir)
    with Engine(model.lm, model.tokenizer) as engine:
        failures = iter([RuntimeError("device lost")] * 2)
        real = engine.step._prefill

        def flaky(running):
            if (error := next(failures, None)) is not None:
                raise error
            return real(running)

        monkeypatch.setattr(engine.step, "_prefill", flaky)

        async def main():
            transport = httpx.ASGITransport(app=create_app(engine, MODEL))
            async with httpx.AsyncClient(transport=transport, base_url="http://hybridlm") as http:
                body = {"prompt": [1, 2], "max_tokens": 2}
                error = assert_openai_error(await http.post(COMPLETIONS, json=body), 500)
                assert error["type"] == "server_error" and "device lost" in error["message"]
                streamed = await http.post(COMPLETIONS, json={**body, "stream": True})
                lines = [line for line in streamed.text.splitlines() if line]
                assert '"type":"server_error"' in lines[-2] and lines[-1] == "data: [DONE]"
                assert (await http.post(COMPLETIONS, json=body)).status_code == 200

        asyncio.run(main())
