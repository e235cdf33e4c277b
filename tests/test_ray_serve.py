"""The prefix-aware router (prefix mode) in front of hybridlm replicas under Ray Serve, with a real
redis-server: a conversation's next turn goes to the replica holding its prefix — sent at once,
before that replica's store write landed, too — and a busy holder hands it to an idle replica,
which restores the prefix from the store."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from hybridlm.cluster import Deployment, StoreServer
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.prefix.store import StoreTier, prefix_keys
from hybridlm.ray_serve import PrefixAwareRouter, RayCluster, build, request_tokens
from hybridlm.server.response_store import ResponseStore
from hybridlm.server.responses import ResponsesRequest, prepare

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
    # The Responses API renders its items as the chat they are; a stored conversation is read from the
    # store the replicas share (here a local one), as the replica will read it; unknown: None.
    assert request_tokens(tokenizer, "/v1/responses", b'{"input": "hi there"}') == ids
    follow = b'{"input": "and then?", "previous_response_id": "r"}'
    assert request_tokens(tokenizer, "/v1/responses", follow) is None
    responses = ResponseStore()
    assert request_tokens(tokenizer, "/v1/responses", follow, responses) is None
    earlier = [*messages, {"role": "assistant", "content": "hello"}]
    responses.put({"id": "r"}, earlier)
    want = prepare(tokenizer, ResponsesRequest.model_validate(json.loads(follow)), earlier).ids
    assert request_tokens(tokenizer, "/v1/responses", follow, responses) == want
    assert request_tokens(tokenizer, "/api/chat", b'{"messages": []}') is None
    assert request_tokens(tokenizer, "/v1/chat/completions", b"{nope") is None


def test_an_unknown_routing_policy_is_refused():
    with pytest.raises(ValueError, match="routing policy"):
        build(RayCluster("m", None, None, policy="random"))


# ---- the router's decisions, without Ray: stand-ins for Ray's replicas and pending requests ----
def replicas(*names: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n)) for n in names]


def pending(rid: str, ids: list[int]) -> SimpleNamespace:
    body = json.dumps({"prompt": ids}).encode()
    return SimpleNamespace(args=("/v1/completions", body), metadata=SimpleNamespace(internal_request_id=rid))


@pytest.fixture
def router(demo_dir, tmp_path):
    """`PrefixAwareRouter(policy)` over a real redis-server, waiting at most 1.5 s; and a writer
    that stores an index entry for a prefix as a replica's store tier does."""
    store = StoreServer(tmp_path).start()
    fingerprint = "f" * 16

    def make(policy: str) -> PrefixAwareRouter:
        r = PrefixAwareRouter.__new__(PrefixAwareRouter)  # Ray's constructor needs a running Serve
        r.initialize_state(str(demo_dir), store.url, fingerprint, policy, wait_s=1.5)
        return r

    tier = StoreTier(store.url, fingerprint)

    def write(ids: list[int]) -> None:
        keys = prefix_keys(fingerprint, ids, [0, len(ids)])
        tier.put(keys[0], keys[len(ids)], 0, ids, {})
        tier.flush()

    yield make, write, store
    tier.close()
    store.stop()


def answered(r: PrefixAwareRouter, rid: str, ids: list[int], replica: str) -> None:
    """What Ray tells the router when request `rid` went to `replica` and was answered."""
    asyncio.run(r.choose_replicas(replicas("a", "b"), pending(rid, ids)))
    r.on_request_routed(pending(rid, ids), SimpleNamespace(unique_id=replica), None)
    r.on_request_completed(SimpleNamespace(unique_id=replica), rid)


def route(r: PrefixAwareRouter, rid: str, ids: list[int]) -> tuple[list[str], float]:
    t0 = time.perf_counter()
    ranks = asyncio.run(r.choose_replicas(replicas("a", "b"), pending(rid, ids)))
    return [rank[0].replica_id.unique_id for rank in ranks], time.perf_counter() - t0


def test_a_follow_up_sent_elsewhere_waits_for_the_answers_store_write(router):
    """Round-robin sends turn 2 to the other replica: the router waits until the store holds turn
    1's prompt (written 0.4 s later here), and no longer; never past its bound when the write never
    lands."""
    make, write, _ = router
    r = make("round_robin")
    turn1, turn2 = list(range(10, 60)), list(range(10, 60)) + [7, 8, 9]
    answered(r, "1", turn1, "a")
    threading.Timer(0.4, write, [turn1]).start()
    order, waited = route(r, "2", turn2)
    assert order == ["b", "a"] and 0.4 <= waited < 1.5
    r.on_request_routed(pending("2", turn2), SimpleNamespace(unique_id="b"), None)
    r.on_request_completed(SimpleNamespace(unique_id="b"), "2")
    order, waited = route(r, "3", turn2 + [5, 5])  # to a; b's write of turn 2 never lands
    assert order == ["a", "b"] and 1.5 <= waited < 3.5


def test_prefix_mode_sends_a_follow_up_to_the_replica_that_answered_unless_it_is_busy(router):
    make, write, store = router
    r = make("prefix")
    turn1, turn2 = list(range(10, 60)), list(range(10, 60)) + [7, 8, 9]
    answered(r, "1", turn1, "b")
    order, waited = route(r, "2", turn2)  # the store has nothing yet: the router remembers
    assert order == ["b", "a"] and waited < 0.5
    busy = list(range(100, 140))
    r.on_request_routed(pending("busy", busy), SimpleNamespace(unique_id="b"), None)  # b is busy
    threading.Timer(0.3, write, [turn1]).start()
    order, waited = route(r, "3", turn2)  # a, once the store holds turn 1
    assert order == ["a", "b"] and 0.3 <= waited < 1.5
    store.stop()  # a store that is down ends the wait at once
    order, waited = route(r, "4", turn2 + [1])
    assert order == ["a", "b"] and waited < 1.0
