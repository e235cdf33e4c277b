"""The prefix-aware router (prefix mode) in front of hybridlm replicas under Ray Serve, with a real
redis-server: a conversation's next turn goes to the replica holding its prefix — sent at once,
before that replica's store write landed, too — and a busy holder hands it to an idle replica,
which restores the prefix from the store."""

from __future__ import annotations

import json

import httpx
import pytest

from hybridlm.cluster import Deployment
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.ray_serve import RayCluster, build, request_tokens

MODEL = "hybridlm"


@pytest.fixture(scope="module")
def app(ray_port, demo_dir):
    with Deployment(ray_port, "prefix", 2, str(demo_dir), serve_args=["--model-name", MODEL]) as d:
        yield d.url


def chat(url: str, messages: list[dict], max_tokens: int = 4, **extra) -> tuple[int, dict, httpx.Headers]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
    return r.status_code, r.json(), r.headers


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


class Busy:
    """A long streamed request after `messages`, decoding until `stop()` closes it (the replica
    cancels it)."""

    def __init__(self, url: str, messages: list[dict]):
        messages = [*messages, {"role": "user", "content": "Now write a very long story."}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        self.client = httpx.Client(timeout=180)
        self.response = self.client.send(
            self.client.build_request("POST", f"{url}/v1/chat/completions", json=body), stream=True
        )
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()  # kept: dropping the iterator closes the stream
        next(self.lines)  # routed and decoding
        self.replica = self.response.headers["x-hybridlm-replica"]

    def stop(self) -> None:
        self.response.close()
        self.client.close()


def test_next_turn_goes_to_the_holder_at_once_and_to_an_idle_replica_when_it_is_busy(app):
    messages = [{"role": "user", "content": "Describe a harbour at dawn, with boats and gulls. " * 4}]
    status, first, where = chat(app, messages)
    assert status == 200
    holder = where["x-hybridlm-replica"]
    # Sent at once: the holder's store write may not have landed; the router remembers whom it sent
    # the prefix to.
    for question in ("And at noon?", "And at night?"):
        messages += [first["choices"][0]["message"], {"role": "user", "content": question}]
        status, second, where = chat(app, messages)
        assert status == 200 and where["x-hybridlm-replica"] == holder and cached(second) > cached(first)
        first = second

    # The holder may be busy with a long request: then the next turn goes to the idle replica,
    # which restores the conversation from the store.
    messages.append(second["choices"][0]["message"])
    busy = Busy(app, messages)
    messages.append({"role": "user", "content": "And at dusk?"})
    try:
        status, third, where = chat(app, messages)
    finally:
        busy.stop()
    assert busy.replica == holder
    assert status == 200 and cached(third) > cached(second)
    assert where["x-hybridlm-replica"] != busy.replica


def test_the_router_tokenizes_prompts_as_the_server_does(demo_dir):
    """The router's token ids equal the usage the replica reports (chat and text completions); a
    route without an OpenAI prompt or an unreadable body gives None (the replica answers those)."""
    tokenizer = Tokenizer.from_dir(demo_dir)
    messages = [{"role": "user", "content": "hi there"}]
    ids = request_tokens(tokenizer, "/v1/chat/completions", json.dumps({"messages": messages}).encode())
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert request_tokens(tokenizer, "/v1/completions", b'{"prompt": ["abc"]}') == tokenizer.encode(
        "abc", add_special_tokens=True
    )
    assert request_tokens(tokenizer, "/v1/completions", b'{"prompt": [5, 6, 7]}') == [5, 6, 7]
    assert request_tokens(tokenizer, "/api/chat", b'{"messages": []}') is None
    assert request_tokens(tokenizer, "/v1/chat/completions", b"{nope") is None


def test_an_unknown_routing_policy_is_refused():
    with pytest.raises(ValueError, match="routing policy"):
        build(RayCluster("m", None, None, policy="random"))
