"""Continuous batching: many requests at once, each output equal to its solo run (bf16), prefill
chunks beside decode rows under the token budget, cancellation, failures, memory-bounded admission."""

from __future__ import annotations

import threading

import pytest

from hybridlm.batch import Batch
from hybridlm.engine import Completion, Engine, SamplingParams
from hybridlm.models.base import forward_packed
from hybridlm.speculative import Draft, TargetPolicy, VerifyRows
from tests.engine.test_engine import wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)


def run_together(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
    """Submit every job at once (before the engine can finish any) and wait for all."""
    results = [Completion() for _ in jobs]
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(event):
            results[i].add(event)
            if event.finished:
                done.release()

        return sink

    for i, (ids, params) in enumerate(jobs):
        engine.submit(ids, params, sink_for(i))
    for _ in jobs:
        assert done.acquire(timeout=60)
    return results


@pytest.fixture(scope="module")
def jobs(chat_ids):
    texts = ["Hi", "Write a poem about the sea and the sky", "2+2?", "Tell me a long story about a robot"]
    return [(chat_ids(t), GREEDY if i % 2 == 0 else SEEDED) for i, t in enumerate(texts * 2)]


@pytest.fixture(scope="module")
def solo(model, jobs):
    with Engine(model.lm, model.tokenizer, max_running=1, prefill_chunk=8) as engine:
        return [engine.generate(ids, params).token_ids for ids, params in jobs]


def test_packed_decode_rows_equal_one_row_forwards_bitwise(model):
    """Decode rows of several sequences at different offsets in one packed forward: every row's logits
    equal that sequence's own one-row forward, bit for bit (bf16)."""
    lm = model.lm
    prompts = [[5, 6, 7], [9] * 11, [3, 1, 4, 1, 5, 9, 2, 6]]
    alone, packed = [lm.make_caches(1) for _ in prompts], [lm.make_caches(1) for _ in prompts]
    for ids, a, b in zip(prompts, alone, packed, strict=True):
        lm(Batch.single(ids), a)
        lm(Batch.single(ids), b)
    for step in range(3):
        tokens = [100 + step, 200 + step, 300 + step]
        segments = [Batch.single([t], offset=len(p) + step) for t, p in zip(tokens, prompts, strict=True)]
        got = forward_packed(lm, segments, packed, ["last"] * 3)
        for t, p, a, g in zip(tokens, prompts, alone, got, strict=True):
            want = lm(Batch.single([t], offset=len(p) + step), a)
            assert g.dtype == want.dtype and g.equal(want)


def test_packed_verify_rows_equal_their_own_verify_forward_bitwise(model):
    """Verify rows of two sequences packed beside a plain decode row: each verify segment's logits
    equal its own verify forward's bit for bit (bf16), each commits the same prefix, and the caches
    it leaves decode the next token exactly as the solo verify's do."""
    lm = model.lm
    prompts = [[5, 6, 7], [9] * 11, [3, 1, 4, 1, 5, 9, 2, 6]]
    drafts = [Draft([11, 12, 13]), None, Draft([7, 7])]  # None: a plain decode row
    current = [100, 200, 300]
    alone, packed = [lm.make_caches(1) for _ in prompts], [lm.make_caches(1) for _ in prompts]
    for ids, a, b in zip(prompts, alone, packed, strict=True):
        lm(Batch.single(ids), a)
        lm(Batch.single(ids), b)
    want = []
    for ids, draft, token, caches in zip(prompts, drafts, current, alone, strict=True):
        if draft is None:
            want.append((lm(Batch.single([token], offset=len(ids)), caches), None))
            continue
        rows = VerifyRows.schedule(caches, token, draft, len(ids))
        logits = lm(Batch.single(rows.ids, offset=len(ids)), caches, logits="all")[0]
        want.append((logits, rows.commit(logits, TargetPolicy())))
    scheduled = [
        None if draft is None else VerifyRows.schedule(caches, token, draft, len(ids))
        for ids, draft, token, caches in zip(prompts, drafts, current, packed, strict=True)
    ]
    segments = [
        Batch.single([token] if rows is None else rows.ids, offset=len(ids))
        for ids, token, rows in zip(prompts, current, scheduled, strict=True)
    ]
    which = ["last" if rows is None else "all" for rows in scheduled]
    got = forward_packed(lm, segments, packed, which)
    for (logits, result), g, rows in zip(want, got, scheduled, strict=True):
        assert g.equal(logits)
        if rows is not None:
            assert rows.commit(g, TargetPolicy()) == result
    for ids, a, b, (_, result) in zip(prompts, alone, packed, want, strict=True):
        offset = len(ids) + 1 if result is None else result.offset
        step = Batch.single([42], offset=offset)
        assert lm(step, a).equal(lm(step, b))


@pytest.mark.parametrize("budget", [4, 512])
def test_concurrent_outputs_equal_solo_runs(model, jobs, solo, budget):
    """8 requests at once (greedy and seeded), prompts in chunks of 8: with a budget of 4 tokens a step
    mixes one prefill chunk with decode rows; with 512 several chunks share a step."""
    with Engine(model.lm, model.tokenizer, max_running=8, prefill_chunk=8, max_batch_tokens=budget) as engine:
        results = run_together(engine, jobs)
        rows = engine.stats.batch_rows
    assert [r.token_ids for r in results] == solo
    assert rows.count > 0 and rows.sum / rows.count > 1  # steps did run several rows


def test_a_long_prompt_is_prefilled_between_decode_steps(model, chat_ids):
    """While one request decodes, a long prompt goes in one chunk per step (budget 1 token): the running
    stream keeps receiving a token every step rather than waiting for the whole prefill."""
    with Engine(model.lm, model.tokenizer, max_running=2, prefill_chunk=4, max_batch_tokens=1) as engine:
        events: list = []
        running = engine.submit(chat_ids("Go on"), LONG, events.append)
        wait_until(lambda: len(events) >= 2)
        long_ids = chat_ids("word " * 60)
        before = len(events)
        first = engine.generate(long_ids, SamplingParams(temperature=0.0, max_tokens=1))
        during = len(events) - before
        running.cancel()
        wait_until(lambda: events[-1].finished)
    chunks = -(-len(long_ids) // 4)
    assert first.usage.prefilled_tokens == len(long_ids)
    # One decode token per step while the prompt's chunks ran one per step (the last step may race).
    assert during >= chunks - 1


def test_cancelling_one_request_leaves_the_others_exact(model, jobs, solo):
    with Engine(model.lm, model.tokenizer, max_running=8, prefill_chunk=8) as engine:
        events: list = []
        victim = engine.submit(jobs[0][0], LONG, events.append)
        results = run_together(engine, jobs[1:4])
        wait_until(lambda: len(events) >= 3)
        victim.cancel()
        wait_until(lambda: events[-1].finished)
        wait_until(lambda: engine.num_running == 0)
    assert events[-1].finish_reason == "cancelled"
    assert [r.token_ids for r in results] == solo[1:4]


def test_a_failing_forward_fails_only_its_requests(model, jobs, solo, monkeypatch):
    """A request whose prefill raises finishes with an error; the others running beside it are exact."""
    with Engine(model.lm, model.tokenizer, max_running=8, prefill_chunk=8) as engine:
        real = engine.step._prefill
        bad = jobs[2][0]

        def flaky(running):
            if running.request.prompt_ids == bad:
                raise RuntimeError("boom")
            return real(running)

        monkeypatch.setattr(engine.step, "_prefill", flaky)
        results = run_together(engine, jobs[:4])
    assert results[2].finish_reason == "error" and "boom" in results[2].error
    assert [r.token_ids for i, r in enumerate(results) if i != 2] == [solo[0], solo[1], solo[3]]


def test_admission_is_bounded_by_memory(model, jobs, solo):
    """With room for one sequence's caches only, requests run one at a time and all complete."""
    with Engine(model.lm, model.tokenizer, max_running=8, prefill_chunk=8, max_memory=1) as engine:
        seen: list[int] = []
        engine_step = engine.step.run
        engine.step.run = lambda batch: (seen.append(len(batch)), engine_step(batch))[1]
        results = run_together(engine, jobs[:3])
    assert max(seen) == 1
    assert [r.token_ids for r in results] == solo[:3]


def test_max_running_bounds_the_running_set(model, jobs, solo):
    with Engine(model.lm, model.tokenizer, max_running=2, prefill_chunk=8) as engine:
        seen: list[int] = []
        engine_step = engine.step.run
        engine.step.run = lambda batch: (seen.append(len(batch)), engine_step(batch))[1]
        results = run_together(engine, jobs[:5])
    assert max(seen) == 2
    assert [r.token_ids for r in results] == solo[:5]


@pytest.mark.parametrize("field", ["max_running", "max_batch_tokens"])
def test_engine_refuses_bad_limits(model, field):
    with pytest.raises(ValueError, match=field):
        Engine(model.lm, model.tokenizer, **{field: 0})
