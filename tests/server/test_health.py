"""/health tells the truth, and the event loop keeps answering it while a request's prompt is
prepared (issue 11, points 6 and 11)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hybridlm.engine import Engine
from hybridlm.server import create_app
from tests.server.inprocess import running


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
    tokenizer = demo_engine.tokenizer
    real = getattr(tokenizer, method)
    entered, release = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, method, slow)
    with running(create_app(demo_engine, "demo")) as url, ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, url + path, json={**body, "max_tokens": 2}, timeout=60)
        assert entered.wait(30)
        try:
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        finally:
            release.set()
        assert pending.result().status_code == 200


def test_health_is_503_when_the_engine_thread_is_dead(demo_dir, monkeypatch):
    import hybridlm

    model = hybridlm.load_model(demo_dir)
    with Engine(model.lm, model.tokenizer) as engine:

        async def main():
            transport = httpx.ASGITransport(app=create_app(engine, "demo"))
            async with httpx.AsyncClient(transport=transport, base_url="http://hybridlm") as http:
                assert (await http.get("/health")).status_code == 200
                monkeypatch.setattr(engine, "_step", lambda batch: 1 / 0)
                failed = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
                assert failed.status_code == 500
                await asyncio.to_thread(engine._thread.join, 10)
                r = await http.get("/health")
                assert (r.status_code, r.json()) == (503, {"status": "engine thread dead"})
                refused = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
                assert refused.status_code == 503

        asyncio.run(main())
