"""/health tells the truth, and the event loop keeps answering it while a request's prompt is
prepared (issue 11, points 6 and 11)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hybridlm.engine import Engine
from hybridlm.server import create_app
from tests.server.inprocess import running

# What /health may take while a huge prompt is handled: a probe waits at most for one GIL-holding step
# of the handling on a worker thread (decoding 3.2 M ids: ≤ 0.37 s on a loaded 2-core machine; text:
# ≤ 0.06 s). The engine's validation on the event loop stalled it 0.9 s for 4 M ids (quiet machine);
# test_health_answers_while_prompt_ids_are_validated proves that one off the loop exactly.
# Under CI's two pytest-xdist workers the other worker's tests share the 2 cores: one probe took
# 0.88 s. A blocking parse of the 3.2 M ids (seconds) still fails this bound; the exact property is
# the sibling test's.
HEALTH_BOUND_S = 1.5


def health_answers_while_blocked(engine, monkeypatch, owner, method: str, path: str, body: dict) -> None:
    """Send `body` to `path` with `owner.method` blocked until /health has answered: /health answers
    200 meanwhile (so that work runs off the event loop), and the request then succeeds."""
    real = getattr(owner, method)
    entered, release = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, method, slow)
    with running(create_app(engine, "demo")) as url, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, url + path, json=body, timeout=60)
        assert entered.wait(30)
        try:
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        finally:
            release.set()
        assert pending.result().status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("encode", "/v1/completions", {"prompt": "slow", "max_tokens": 2}),
        ("apply_chat_template", "/v1/chat/completions", {"messages": [{"role": "user", "content": "slow"}]}),
    ],
    ids=["tokenization", "chat-template"],
)
def test_health_answers_while_a_prompt_is_prepared(demo_engine, monkeypatch, method, path, body):
    """Tokenization and template rendering (seconds for a 16 MiB prompt) run off the event loop:
    here they block until /health has answered."""
    health_answers_while_blocked(demo_engine, monkeypatch, demo_engine.tokenizer, method, path,
                                 {**body, "max_tokens": 2})


def test_health_is_503_when_the_engine_thread_is_dead(demo_dir, monkeypatch):
    import hybridlm

    model = hybridlm.load_model(demo_dir)
    with Engine(model.lm, model.tokenizer) as engine:

        async def main():
            transport = httpx.ASGITransport(app=create_app(engine, "demo"))
            async with httpx.AsyncClient(transport=transport, base_url="http://hybridlm") as http:
                assert (await http.get("/health")).status_code == 200
                monkeypatch.setattr(engine.step, "run", lambda batch: 1 / 0)
                failed = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
                assert failed.status_code == 500
                await asyncio.to_thread(engine._thread.join, 10)
                r = await http.get("/health")
                assert (r.status_code, r.json()) == (503, {"status": "engine thread dead"})
                refused = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
                assert refused.status_code == 503

        asyncio.run(main())


def test_health_answers_while_prompt_ids_are_validated(demo_engine, monkeypatch):
    """The engine's validation reads every prompt id (≈ 1 s for a 15 MiB prompt): it runs off the
    event loop too — here it blocks until /health has answered."""
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    health_answers_while_blocked(demo_engine, monkeypatch, demo_engine, "validate", "/v1/completions", body)


@pytest.mark.parametrize(
    "prompt",
    [
        "hello world " * ((16 << 20) // 12 - 100),  # refused untokenized: more characters than fit
        " ".join(["hello"] * 40_000),  # 40 k tokens: tokenized, then every id validated
        list(range(1, 500)) * 6_400,  # 3.2 M ids (15.3 MiB of JSON): decoded, then validated
    ],
    ids=["16MiB-text", "40k-token-text", "3.2M-ids"],
)
def test_health_stays_fast_while_a_huge_prompt_is_handled(server, auth, prompt):
    """A real server handed a huge prompt (refused as longer than its context once it knows) keeps
    answering /health quickly all the while."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": 1}
    latencies = []
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=30) as probe:
        url = server.url + "/v1/completions"
        pending = pool.submit(httpx.post, url, json=body, headers=auth, timeout=120)
        while not pending.done():
            t0 = time.perf_counter()
            assert probe.get(server.url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
        refused = pending.result()
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert len(latencies) >= 3  # probed while it was handled
    assert max(latencies) < HEALTH_BOUND_S, sorted(latencies)[-5:]
