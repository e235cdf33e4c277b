"""Replicas behind SGLang's router, sharing a real redis-server: a conversation moves between
replicas with the oracle's exact reuse (recurrent layers included) and a single server's output;
a replica killed mid-request fails only its own in-flight request."""

from __future__ import annotations

import json
import threading
import time
import urllib.error

import httpx
import pytest

from hybridlm.cluster import Deployment, get_json, post_json
from hybridlm.demo import write_demo_model
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.prefix.cache import common_prefix

MODEL = "hybridlm-demo"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def deployments(demo_dir):
    """Two replicas + store + round-robin router, and a single server with a private cache."""
    named = ["--model-name", MODEL]
    cluster = Deployment(2, str(demo_dir), store=True, policy="round_robin", serve_args=named)
    single = Deployment(1, str(demo_dir), store=False, policy=None, serve_args=named)
    try:
        cluster.launch(), single.launch()
        yield cluster.ready(), single.ready()
    finally:
        cluster.stop()
        single.stop()


def chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return post_json(f"{url}/v1/chat/completions", body)


def prompt_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_replica_b_continues_replica_a_conversation_exactly(deployments, demo_dir):
    """Turn 1 on replica A (one generated token: A stores exactly the prompt), turn 2 on replica B:
    B's cached_tokens equal the oracle's exact reuse — the common prefix of turn 2's tokens with
    what was stored — and its answer equals a single server's that served both turns."""
    (cluster, single), tokenizer = deployments, Tokenizer.from_dir(demo_dir)
    layers = json.loads((demo_dir / "config.json").read_text())["layer_types"]
    assert "linear_attention" in layers  # Gated DeltaNet layers: the reuse restores recurrent state
    a, b = cluster.urls
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    turn1 = [system, {"role": "user", "content": "Tell me about the sea and the sky."}]
    first_a, first_single = chat(a, turn1, 1), chat(single.urls[0], turn1, 1)
    answer = first_a["choices"][0]["message"]["content"]
    assert answer == first_single["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And rivers?"}]
    ids1, ids2 = prompt_ids(tokenizer, turn1), prompt_ids(tokenizer, turn2)
    oracle = min(len(ids2) - 1, common_prefix(ids1, ids2))
    time.sleep(0.5)  # A's writes are asynchronous
    second_b, second_single = chat(b, turn2, 12), chat(single.urls[0], turn2, 12)
    assert second_b["usage"]["prompt_tokens"] == len(ids2)
    assert second_b["usage"]["prompt_tokens_details"]["cached_tokens"] == oracle > len(ids1) // 2
    assert second_single["usage"]["prompt_tokens_details"]["cached_tokens"] == oracle
    assert second_b["choices"][0]["message"] == second_single["choices"][0]["message"]
    fetched = [_metric(u, "hybridlm_prefix_store_fetched_nodes_total") for u in cluster.urls]
    assert fetched[1] > 0


def test_long_answers_move_between_replicas_with_a_single_servers_reuse(deployments):
    """A conversation with multi-token answers, each turn on the other replica: every turn reuses
    exactly what a single server reuses (generated tokens included) and answers the same."""
    cluster, single = deployments
    messages = [{"role": "user", "content": "Count the waves on the shore, one by one."}]
    for turn in range(3):
        replica = cluster.urls[turn % 2]
        got, want = chat(replica, messages, 10), chat(single.urls[0], messages, 10)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["usage"]["prompt_tokens_details"] == want["usage"]["prompt_tokens_details"]
        if turn:
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        messages += [got["choices"][0]["message"], {"role": "user", "content": f"And then {turn}?"}]
        time.sleep(0.5)


def test_a_replica_killed_mid_request_fails_only_its_own_request(deployments):
    """Kill the replica serving a long streamed request: that stream breaks, every later request
    through the router succeeds (on the survivor) with a single server's answer, and the survivor
    still reuses the conversation the dead replica computed (from the store)."""
    cluster, single = deployments
    messages = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]
    chat(cluster.urls[1], messages, 1)  # computed by replica 1, which is about to die
    time.sleep(0.5)
    outcome: dict = {}

    def stream() -> None:
        body = {"model": MODEL, "messages": messages, "max_tokens": 4000, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{cluster.urls[1]}/v1/chat/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    outcome["started"] = True
            outcome["finished"] = True
        except httpx.HTTPError as e:
            outcome["error"] = e

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 60
    while "started" not in outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    cluster.kill("replica1")
    client.join(30)
    assert "error" in outcome and "finished" not in outcome
    follow = [*messages, {"role": "assistant", "content": "Once"}, {"role": "user", "content": "Go on."}]
    for _ in range(4):  # round-robin would send every other one to the dead replica
        try:
            got = chat(cluster.router_url, follow, 6)
        except urllib.error.HTTPError as e:
            pytest.fail(f"a request failed after the kill: {e.code} {e.read()[:300]!r}")
        want = chat(single.urls[0], follow, 6)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert get_json(f"{cluster.urls[0]}/health")["status"] == "ok"


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
