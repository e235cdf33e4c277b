"""The engine on the demo model: greedy parity, seeds, stop rules, cancellation, queueing, isolation."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest

from hybridlm.engine import (
    AsyncStream,
    Completion,
    Engine,
    InvalidParameter,
    PromptTooLong,
    QueueFull,
    SamplingParams,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LONG = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


# bf16 with the same chunking as Model.generate is bit-exact; other chunkings round differently in bf16,
# so the chunked case runs in float32.
@pytest.mark.parametrize(("which", "prefill_chunk"), [("model", 512), ("model32", 5)])
def test_greedy_equals_model_generate(request, chat_ids, which, prefill_chunk):
    model = request.getfixturevalue(which)
    ids = chat_ids("Write a function that adds two numbers.")
    expected = model.generate(ids, 24)
    with Engine(model.lm, model.tokenizer, prefill_chunk=prefill_chunk) as engine:
        result = engine.generate(ids, GREEDY)
    eos = model.tokenizer.eos_token_ids
    produced = result.token_ids[:-1] if result.token_ids[-1] in eos else result.token_ids
    assert produced == expected
    assert result.text == model.tokenizer.decode(expected, skip_special_tokens=True)
    assert result.finish_reason == ("stop" if len(expected) < 24 else "length")
    usage = result.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, usage.prefilled_tokens) == (
        len(ids),
        len(result.token_ids),
        0,
        len(ids),
    )
    t = result.timings
    assert t.queue_ms >= 0 and t.prefill_ms > 0 and t.decode_ms > 0
    assert t.queue_ms + t.prefill_ms <= t.first_token_ms <= t.total_ms


def test_streamed_text_concatenates_to_the_result(engine, chat_ids):
    ids = chat_ids("Hello")
    events = list(engine.stream(ids, GREEDY))
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert all(len(e.token_ids) == 1 for e in events)  # one token per step, recorded then streamed
    whole = engine.generate(ids, GREEDY)
    assert "".join(e.text for e in events) == whole.text
    assert [t for e in events for t in e.token_ids] == whole.token_ids


def test_seeded_sampling_is_reproducible_and_independent_of_other_requests(engine, chat_ids):
    ids = chat_ids("Tell me a story.")
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20)
    alone = engine.generate(ids, params)
    assert engine.generate(ids, params).token_ids == alone.token_ids

    # The same request queued between others with other seeds and prompts.
    results: dict[int, Completion] = {}
    done = threading.Event()
    order = [(chat_ids("Other prompt"), 1), (ids, 1234), (chat_ids("Yet another"), 99), (ids, 1235)]

    def sink_for(i):
        def sink(event):
            results.setdefault(i, Completion()).add(event)
            if (
                event.finished
                and len(results) == len(order)
                and all(r.finish_reason for r in results.values())
            ):
                done.set()

        return sink

    for i, (prompt, seed) in enumerate(order):
        engine.submit(
            prompt,
            SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=20),
            sink_for(i),
        )
    assert done.wait(30)
    assert results[1].token_ids == alone.token_ids
    assert results[3].token_ids != alone.token_ids  # another seed, another sample


def test_unseeded_sampling_differs(engine, chat_ids):
    ids = chat_ids("Hi")
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    assert engine.generate(ids, params).token_ids != engine.generate(ids, params).token_ids


def boundary_stop(tokenizer, tokens: list[int]) -> tuple[str, int, int]:
    """A stop string straddling a token boundary: (stop, its first index in the text, tokens up to it)."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    for i in range(2, len(tokens) - 2):
        left = tokenizer.decode(tokens[:i], skip_special_tokens=True)
        right = tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)
        if not text.startswith(right) or len(left) < 2 or len(right) - len(left) < 3 or "\ufffd" in right:
            continue
        stop = left[-2:] + right[len(left) : len(left) + 2]
        at = text.find(stop)
        if at == len(left) - 2:
            return stop, at, i + 1
    raise AssertionError("no token boundary to put a stop string on")


def test_stop_string_across_tokens_is_never_streamed_partially(engine, chat_ids, model):
    ids = chat_ids("Explain recursion.")
    free = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stop, at, tokens = boundary_stop(model.tokenizer, free.token_ids)
    expected = free.text[:at]

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=("zzz-never", stop))
    shown = ""
    for event in engine.stream(ids, params):
        shown += event.text
        assert expected.startswith(shown)  # nothing past the stop string, not even its first characters
        if event.finished:
            assert (event.finish_reason, event.stop_reason) == ("stop", stop)
            assert event.usage.completion_tokens == tokens  # the token that completed the match is counted
    assert shown == expected


def test_stop_token_ids_and_eos(model, chat_ids):
    ids = chat_ids("Count to ten.")
    with Engine(model.lm, model.tokenizer) as engine:
        free = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        target = free.token_ids[7]
        first = free.token_ids.index(target)
        stopped = engine.generate(
            ids, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(target,))
        )
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", target)
    assert stopped.text == model.tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)

    # The same token as the checkpoint's EOS: it ends generation unless ignore_eos.
    tokenizer = copy.copy(model.tokenizer)
    tokenizer.eos_token_ids = frozenset({target})
    with Engine(model.lm, tokenizer) as engine:
        eos = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=30))
        ignored = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert eos.token_ids == stopped.token_ids and eos.finish_reason == "stop" and eos.text == stopped.text
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_max_tokens_and_context_length(model, chat_ids):
    ids = chat_ids("Hello")
    with Engine(model.lm, model.tokenizer, context_length=len(ids) + 5) as engine:
        r = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert (r.usage.completion_tokens, r.finish_reason) == (3, "length")
        r = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        assert (r.usage.completion_tokens, r.finish_reason) == (5, "length")  # the context is full
        r = engine.generate(ids, SamplingParams(temperature=0.0, ignore_eos=True))
        assert r.usage.completion_tokens == 5
        with pytest.raises(PromptTooLong) as e:
            engine.generate(ids + [1] * 5, GREEDY)
        assert e.value.param == "prompt"
        with pytest.raises(InvalidParameter, match="prompt"):
            engine.generate([], GREEDY)
        with pytest.raises(InvalidParameter) as e:
            engine.generate(ids, SamplingParams(stop_token_ids=(10**9,)))
        assert e.value.param == "stop_token_ids"


def cancel_after(engine: Engine, ids: list[int], after: int) -> list:
    """Run a request whose sink cancels it on its `after`-th event; return all its events."""
    seen: list = []
    finished = threading.Event()

    def sink(event):
        seen.append(event)
        if len(seen) == after:
            request.cancel()  # on the engine thread, between two decode steps
        if event.finished:
            finished.set()

    request = engine.submit(ids, LONG, sink)
    assert finished.wait(10)
    return seen


@pytest.mark.parametrize("after", [1, 4])
def test_cancel_stops_within_one_step_and_the_engine_moves_on(engine, chat_ids, after):
    ids = chat_ids("Go on forever.")
    seen = cancel_after(engine, ids, after)
    assert seen[-1].finish_reason == "cancelled"
    assert seen[-1].usage.completion_tokens == after  # not one more forward
    assert sum(len(e.token_ids) for e in seen) == after
    assert engine.generate(ids, GREEDY).token_ids == engine.generate(ids, GREEDY).token_ids


def test_closing_a_stream_cancels_and_frees_the_engine(engine, chat_ids):
    stream = engine.stream(chat_ids("Never stop."), LONG)
    for _, _event in zip(range(3), stream, strict=False):
        pass
    stream.close()
    wait_until(lambda: engine.num_running == 0, timeout=2)
    tokens = engine.stats.generation_tokens
    time.sleep(0.05)
    assert engine.stats.generation_tokens == tokens


def test_cancel_while_queued_and_queue_bound(model, chat_ids):
    ids = chat_ids("Hi")
    with Engine(model.lm, model.tokenizer, max_queue=1) as engine:
        started = threading.Event()
        events: list = []
        running = engine.submit(ids, LONG, lambda e: (started.set(), events.append(e)))
        assert started.wait(10)
        queued_events: list = []
        queued = engine.submit(ids, GREEDY, queued_events.append)
        with pytest.raises(QueueFull):
            engine.submit(ids, GREEDY, lambda e: None)
        queued.cancel()
        wait_until(lambda: queued_events and queued_events[-1].finished)
        assert len(queued_events) == 1 and queued_events[0].finish_reason == "cancelled"
        assert queued_events[0].usage.completion_tokens == 0
        engine.submit(ids, GREEDY, lambda e: None).cancel()  # the slot is free again
        running.cancel()
        wait_until(lambda: events[-1].finished)
        assert engine.generate(ids, GREEDY).finish_reason in ("stop", "length")


def test_a_failing_request_does_not_take_the_engine_down(model, chat_ids, monkeypatch):
    ids = chat_ids("Hi")
    with Engine(model.lm, model.tokenizer) as engine:
        real = engine.step._prefill
        calls = iter([RuntimeError("boom")])

        def flaky(running):
            if (error := next(calls, None)) is not None:
                raise error
            return real(running)

        monkeypatch.setattr(engine.step, "_prefill", flaky)
        failed = engine.generate(ids, GREEDY)
        assert failed.finish_reason == "error" and "boom" in failed.error
        recovered = engine.generate(ids, GREEDY)
        assert recovered.finish_reason in ("stop", "length") and recovered.token_ids[:5] == model.generate(
            ids, 5
        )
        assert engine.stats.finished["error"] == 1


def test_async_stream_matches_blocking(engine, chat_ids):
    ids = chat_ids("Async hello")
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=10)

    async def collect():
        result = Completion()
        async for event in AsyncStream(engine, ids, params):
            result.add(event)
        return result

    got = asyncio.run(collect())
    want = engine.generate(ids, params)
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_closed_engine_refuses_and_close_cancels_running(model, chat_ids):
    ids = chat_ids("Hi")
    engine = Engine(model.lm, model.tokenizer)
    events: list = []
    engine.submit(ids, LONG, events.append)
    wait_until(lambda: events)
    engine.close()
    assert events[-1].finish_reason == "cancelled"
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit(ids, GREEDY, events.append)
