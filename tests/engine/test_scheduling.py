"""One step of the scheduler: prefill chunks go round-robin across prompts (requests arriving together
start decoding together), and prompts arriving while streams decode prefill on the time share."""

from __future__ import annotations

import pytest

from hybridlm.engine import Completion, Engine, SamplingParams
from tests.engine.test_batching import LONG
from tests.engine.test_engine import wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def record_prefills(engine: Engine) -> list[int]:
    """Admission order of the sequence behind each prefill chunk the engine runs, in order."""
    order: list[int] = []
    real = engine.step._prefill

    def prefill(running):
        order.append(running.admitted)
        return real(running)

    engine.step._prefill = prefill
    return order


def test_prompts_admitted_together_take_chunks_in_turn(model):
    """Three 3-chunk prompts, one chunk per step: chunks go 1, 2, 3, 1, 2, 3, …, so the three finish
    their prefill in three consecutive steps, and each output equals its solo run."""
    prompts = [[(7 * i + 3 * k) % 200 + 5 for i in range(24)] for k in range(3)]
    with Engine(model.lm, model.tokenizer, max_running=3, prefill_chunk=8) as solo:
        want = [solo.generate(p, GREEDY).token_ids for p in prompts]
    with Engine(model.lm, model.tokenizer, max_running=3, prefill_chunk=8, max_batch_tokens=8) as engine:
        order = record_prefills(engine)
        handles = [Completion() for _ in prompts]
        with engine.scheduler.wake:  # the engine admits them in one scheduling round
            for p, c in zip(prompts, handles, strict=True):
                engine.submit(p, GREEDY, c.add)
        wait_until(lambda: all(c.finish_reason for c in handles), timeout=60)
    assert order == [1, 2, 3] * 3
    assert [c.token_ids for c in handles] == want


@pytest.mark.parametrize("share", [0.05, 1000.0])
def test_a_late_prompt_prefills_on_the_time_share(model, chat_ids, share):
    """A prompt arriving while a stream decodes: with a small share the stream decodes several tokens
    per chunk of it; with a huge one about a token per chunk (one chunk per step, as without a share).
    The late prompt's output is its solo run's either way."""
    long_ids = chat_ids("word " * 60)
    one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with Engine(model.lm, model.tokenizer, max_running=1, prefill_chunk=4) as solo:
        want = solo.generate(long_ids, one).token_ids
    with Engine(
        model.lm, model.tokenizer, max_running=2, prefill_chunk=4, max_batch_tokens=1, prefill_share=share
    ) as engine:
        events: list = []
        running = engine.submit(chat_ids("Go on"), LONG, events.append)
        wait_until(lambda: len(events) >= 2)
        before = len(events)
        late = engine.generate(long_ids, one)
        during = len(events) - before
        running.cancel()
        wait_until(lambda: events[-1].finished)
    chunks = -(-len(long_ids) // 4)
    assert late.token_ids == want and late.usage.prefilled_tokens == len(long_ids)
    if share < 1:
        assert during >= 3 * chunks
    else:
        assert chunks - 1 <= during <= 2 * chunks + 4


def test_prefill_share_must_be_positive(model):
    with pytest.raises(ValueError, match="prefill_share"):
        Engine(model.lm, model.tokenizer, prefill_share=0.0)


def test_a_prompt_arriving_during_a_burst_prefill_is_a_peer(model, chat_ids):
    """A prompt that arrives while the first prompt of a burst prefills (so it is admitted only after
    that prompt's first token) is a peer, not late: it prefills at full budget in the next step, even
    under a tiny time share that would hold a late prompt back for hundreds of steps."""
    first_ids, second_ids = chat_ids("Go on"), chat_ids("And then?")
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with Engine(model.lm, model.tokenizer, max_running=1) as solo:
        want = solo.generate(second_ids, one).token_ids
    with Engine(model.lm, model.tokenizer, max_running=2, prefill_share=0.001) as engine:
        events: list = []
        second, submitted, seen = Completion(), [], []

        def on_second(event):  # how many events the first stream had when the second one finished
            second.add(event)
            if event.finished:
                seen.append(len(events))

        real = engine.step._prefill

        def prefill(running):  # the second prompt arrives while the first one's (only) chunk runs
            if running.request.prompt_ids == first_ids and not submitted:
                submitted.append(engine.submit(second_ids, one, on_second))
            return real(running)

        engine.step._prefill = prefill
        running = engine.submit(first_ids, LONG, events.append)
        wait_until(lambda: second.finish_reason is not None, timeout=60)
        running.cancel()
        wait_until(lambda: events[-1].finished)
    assert second.token_ids == want
    assert seen[0] <= 3
