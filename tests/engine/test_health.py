"""The engine never dies of one failure, and `health_problem` tells when it is dead or stalled
(issue 11, point 11)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hybridlm.engine import Engine, SamplingParams
from hybridlm.engine.request import ERROR
from hybridlm.prefix.cache import PrefixCache

PARAMS = SamplingParams(max_tokens=3, temperature=0)


def generate(engine: Engine, prompt: list[int]):
    """engine.generate with a deadline (a dead engine would hang it)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(engine.generate, prompt, PARAMS).result(timeout=60)


def test_a_failing_prefix_cache_leaves_the_engine_serving(model, monkeypatch):
    prefix = PrefixCache(model.lm, ram_budget=1 << 20)
    real = PrefixCache._close
    calls = []

    def flaky(self, session):
        calls.append(session)
        if len(calls) == 1:
            raise OSError(30, "Read-only file system")
        return real(self, session)

    monkeypatch.setattr(PrefixCache, "_close", flaky)
    with Engine(model.lm, model.tokenizer, prefix=prefix) as engine:
        first = generate(engine, [1, 2, 3, 4])
        second = generate(engine, [1, 2, 3, 4, 5])
        assert first.finish_reason == second.finish_reason == "length"
        assert engine.health_problem() is None
    assert len(calls) == 2


def test_a_dead_worker_fails_its_requests_and_is_reported(model, monkeypatch):
    with Engine(model.lm, model.tokenizer) as engine:
        monkeypatch.setattr(engine.step, "run", lambda batch: 1 / 0)
        result = generate(engine, [1, 2, 3])
        assert result.finish_reason == ERROR and "ZeroDivisionError" in result.error
        engine._thread.join(10)
        assert engine.health_problem() == "engine thread dead"


def test_a_stalled_worker_is_reported(model, monkeypatch):
    release = threading.Event()
    real = model.lm.forward

    def stuck(*args, **kwargs):
        release.wait(30)
        return real(*args, **kwargs)

    with Engine(model.lm, model.tokenizer) as engine:
        engine.stall_seconds = 0.3
        assert engine.health_problem() is None
        monkeypatch.setattr(model.lm, "forward", stuck)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(engine.generate, [1, 2, 3], PARAMS)
            deadline = time.monotonic() + 10
            while engine.health_problem() is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert engine.health_problem() == "engine stalled"
            release.set()
            assert pending.result(timeout=60).finish_reason == "length"
        assert engine.health_problem() is None
