"""Replicas under Ray Serve sharing a real redis-server, every turn on the next replica (the router's
round-robin mode): a conversation moves between replicas with the oracle's exact reuse (recurrent
layers included) and a single server's output, follow-ups sent at once included; answers stream
through the router on every API; a replica killed mid-request fails only its own request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hybridlm.cluster import Deployment, free_port
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.prefix.cache import common_prefix

MODEL = "hybridlm-demo"


@pytest.fixture(scope="module")
def single(demo_dir):
    """One `hybridlm serve` process with a private cache and the replicas' thread count: the oracle."""
    port = free_port()
    args = [sys.executable, "-m", "hybridlm.cli", "serve", "--model", str(demo_dir), "--model-name", MODEL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*args, "--port", str(port)], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        yield proc, url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def cluster(ray_port, demo_dir, single):
    """Two replicas + store + the router in round-robin mode; and the single server, up."""
    deployment = Deployment(
        ray_port, "rr", 2, str(demo_dir), policy="round_robin", serve_args=["--model-name", MODEL]
    )
    with deployment:
        proc, url = single
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the single server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=2).json()["status"] == "ok":
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield deployment.url, url


def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[dict, httpx.Headers]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json(), r.headers


def prompt_ids(tokenizer: Tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_replica_b_continues_replica_a_conversation_exactly_even_at_once(cluster, demo_dir):
    """Turn 1 on replica A (one generated token: A stores exactly the prompt), turn 2 sent as soon
    as the answer arrives goes to replica B: B's cached_tokens equal the oracle's exact reuse — the
    common prefix of turn 2's tokens with what was stored — and its answer equals a single
    server's that served both turns (the router waited for A's store write)."""
    (router, single), tokenizer = cluster, Tokenizer.from_dir(demo_dir)
    layers = json.loads((demo_dir / "config.json").read_text())["layer_types"]
    assert "linear_attention" in layers  # Gated DeltaNet layers: the reuse restores recurrent state
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    turn1 = [system, {"role": "user", "content": "Tell me about the sea and the sky."}]
    first_single, _ = chat(single, turn1, 1)
    answer = first_single["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And rivers?"}]
    second_single, _ = chat(single, turn2, 12)
    (first, a), (second, b) = chat(router, turn1, 1), chat(router, turn2, 12)  # back to back
    assert first["choices"][0]["message"]["content"] == answer
    assert b["x-hybridlm-replica"] != a["x-hybridlm-replica"]
    ids1, ids2 = prompt_ids(tokenizer, turn1), prompt_ids(tokenizer, turn2)
    oracle = min(len(ids2) - 1, common_prefix(ids1, ids2))
    assert second["usage"]["prompt_tokens"] == len(ids2)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == oracle > len(ids1) // 2
    assert second_single["usage"]["prompt_tokens_details"]["cached_tokens"] == oracle
    assert second["choices"][0]["message"] == second_single["choices"][0]["message"]


def test_long_answers_move_between_replicas_with_a_single_servers_reuse(cluster):
    """A conversation with multi-token answers, each turn on the other replica and sent at once:
    every turn reuses exactly what a single server reuses (generated tokens included) and answers
    the same."""
    router, single = cluster
    messages = [{"role": "user", "content": "Count the waves on the shore, one by one."}]
    turns = []  # (messages, the single server's answer), then the same turns through the router
    for turn in range(3):
        want, _ = chat(single, messages, 10)
        turns.append((list(messages), want))
        messages = [*messages, want["choices"][0]["message"], {"role": "user", "content": f"And {turn}?"}]
    served = []
    for turn, (messages, want) in enumerate(turns):
        got, where = chat(router, messages, 10)
        served.append(where["x-hybridlm-replica"])
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["usage"]["prompt_tokens_details"] == want["usage"]["prompt_tokens_details"]
        if turn:
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert served[0] != served[1] != served[2]


def stream(url: str, path: str, body: dict) -> tuple[httpx.Headers, list[str], float, float]:
    """(headers, non-empty lines, seconds to the first line, seconds to the end) of a streamed answer."""
    t0, first, lines = time.perf_counter(), None, []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line:
                first = first or time.perf_counter() - t0
                lines.append(line)
        return r.headers, lines, first, time.perf_counter() - t0


def sse_text(lines: list[str], field) -> str:
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(field(e) or "" for e in events)


def test_answers_stream_through_the_router_on_every_api(cluster):
    """`stream: true` through the router: OpenAI chat and completions (SSE, ending with [DONE]),
    Anthropic messages (SSE events) and Ollama chat (NDJSON) carry the single server's text, and
    the first event arrives long before the end (streamed, not buffered)."""
    router, single = cluster
    messages = [{"role": "user", "content": "Tell a long tale of ships."}]
    common = {"model": MODEL, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    chat_body = {**common, "messages": messages}
    headers, lines, first, total = stream(router, "/v1/chat/completions", chat_body)
    assert headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"
    want = stream(single, "/v1/chat/completions", chat_body)[1]
    delta = lambda e: e["choices"][0]["delta"].get("content") if e["choices"] else None
    assert sse_text(lines, delta) == sse_text(want, delta) != ""
    assert first < total / 2, (first, total)

    completion = {**common, "prompt": "Once upon a time"}
    lines = stream(router, "/v1/completions", completion)[1]
    text = lambda e: e["choices"][0]["text"] if e["choices"] else None
    assert lines[-1] == "data: [DONE]"
    assert sse_text(lines, text) == sse_text(stream(single, "/v1/completions", completion)[1], text)

    anthropic = {"model": MODEL, "max_tokens": 20, "messages": messages, "stream": True, "temperature": 0}
    headers, lines, _, _ = stream(router, "/v1/messages", anthropic)
    text = lambda e: e.get("delta", {}).get("text")
    assert headers["content-type"].startswith("text/event-stream")
    assert "event: message_stop" in lines
    assert sse_text(lines, text) == sse_text(stream(single, "/v1/messages", anthropic)[1], text) != ""

    ollama = {"model": MODEL, "messages": messages, "options": {"num_predict": 20, "temperature": 0}}
    lines = stream(router, "/api/chat", ollama)[1]
    parts = [json.loads(line) for line in lines]
    assert parts[-1]["done"] and len(parts) > 2
    want = [json.loads(line) for line in stream(single, "/api/chat", ollama)[1]]
    assert [p["message"]["content"] for p in parts] == [p["message"]["content"] for p in want]


def test_a_stored_response_continues_fetches_and_deletes_on_any_replica(cluster):
    """Responses API through the router, every request on the next replica: the second turn
    (`previous_response_id`) finds the first, stored by the other replica, in the shared store and
    answers as the single server does; GET and DELETE reach the stored response from either."""
    router, single = cluster

    def post(url: str, body: dict) -> tuple[dict, httpx.Headers]:
        r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json(), r.headers

    def text(response: dict) -> list:
        return [c.get("text") for o in response["output"] for c in o.get("content") or []]

    turn1 = {"input": "Name a river.", "max_output_tokens": 8}
    turn2 = {"input": "And a sea?", "max_output_tokens": 8}
    want1, _ = post(single, turn1)
    want2, _ = post(single, {**turn2, "previous_response_id": want1["id"]})
    first, a = post(router, turn1)
    second, b = post(router, {**turn2, "previous_response_id": first["id"]})
    assert b["x-hybridlm-replica"] != a["x-hybridlm-replica"]
    assert text(first) == text(want1) and text(second) == text(want2)
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    for _ in range(2):  # round robin: both replicas answer
        got = httpx.get(f"{router}/v1/responses/{first['id']}", timeout=30)
        assert got.status_code == 200 and got.json()["output"] == first["output"]
    assert httpx.delete(f"{router}/v1/responses/{first['id']}", timeout=30).status_code == 200
    for _ in range(2):
        assert httpx.get(f"{router}/v1/responses/{first['id']}", timeout=30).status_code == 404


def test_the_router_answers_an_unrouted_path_and_a_bad_body_with_errors(cluster):
    router, _ = cluster
    r = httpx.post(f"{router}/v1/embeddings", json={"input": "x"}, timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(
        f"{router}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()


def test_a_replica_killed_mid_request_fails_only_its_own_request(cluster):
    """Kill the replica serving a long streamed request: that stream breaks, every later request
    through the router succeeds with a single server's answer, and still reuses the conversation
    the dead replica computed (from the store). Last in the module: Ray replaces the replica."""
    router, single = cluster
    messages = [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]
    chat(router, messages, 1)
    outcome: dict = {}

    def long_stream() -> None:
        body = {"model": MODEL, "messages": messages, "max_tokens": 4000, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, timeout=60) as r:
                outcome["pid"] = int(r.headers["x-hybridlm-pid"])
                outcome["lines"] = [line for line in r.iter_lines() if line]
        except httpx.HTTPError as e:
            outcome["error"] = e

    client = threading.Thread(target=long_stream)
    client.start()
    deadline = time.monotonic() + 60
    while "pid" not in outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # decoding
    os.kill(outcome["pid"], signal.SIGKILL)
    client.join(60)
    assert "error" in outcome or outcome["lines"][-1] != "data: [DONE]"
    follow = [*messages, {"role": "assistant", "content": "Once"}, {"role": "user", "content": "Go on."}]
    for _ in range(4):  # round-robin: some of these went to the dead replica's place
        got, _ = chat(router, follow, 6)
        want, _ = chat(single, follow, 6)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
