"""`n > 1`: one prompt prefilled once, n choices forked from its state, each a sequence of its own;
choice i equals the same request with n = 1 and seed + i (bf16, bit for bit), greedy choices are
equal, the choices share the prompt's KV rows (copy-on-write) and every choice's continuation reaches the
prefix trie, a cancelled request ends every choice, n beyond max_running is refused."""

from __future__ import annotations

import pytest
import torch

import hybridlm
import hybridlm.engine.step as engine_module
from hybridlm.cache import KVCache
from hybridlm.cache.kv import held_bytes
from hybridlm.engine import Engine, InvalidParameter, SamplingParams
from hybridlm.ops.attention import KEY_BLOCK
from hybridlm.prefix.cache import PrefixCache, common_prefix
from hybridlm.speculative import NgramDrafter
from tests.engine.test_engine import wait_until
from tests.speculative.helpers import speculator

SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True, n=3)


def solo(lm, tokenizer, ids, params, **engine_kw) -> list[list[int]]:
    """Each choice's oracle: the same request with n = 1 and seed + i, alone in a fresh engine."""
    out = []
    for i in range(params.n):
        one = SamplingParams(**{**params.__dict__, "n": 1, "seed": params.choice_seed(i)})
        with Engine(lm, tokenizer, max_running=1, **engine_kw) as engine:
            out.append(engine.generate(ids, one).token_ids)
    return out


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
def test_each_choice_equals_its_own_seeded_request(model, chat_ids, spec):
    kw = {"speculative": speculator(NgramDrafter, depth=4)} if spec else {}
    ids = chat_ids("Tell me a story about a robot")
    with Engine(model.lm, model.tokenizer, max_running=4, **kw) as engine:
        choices = engine.generate_choices(ids, SAMPLED)
        usage = [c.usage for c in choices]
    assert [c.token_ids for c in choices] == solo(model.lm, model.tokenizer, ids, SAMPLED, **kw)
    assert len({tuple(c.token_ids) for c in choices}) > 1  # the seeds differ: so do the samples
    # The prompt was prefilled once: the forked choices computed none of it.
    assert [u.prefilled_tokens for u in usage] == [len(ids), 0, 0]
    assert all(u.completion_tokens == 12 for u in usage)


def test_greedy_choices_are_equal(model, chat_ids):
    ids = chat_ids("2+2?")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with Engine(model.lm, model.tokenizer, max_running=4) as engine:
        alone = engine.generate(ids, params).token_ids
        choices = engine.generate_choices(ids, SamplingParams(**{**params.__dict__, "n": 4}))
    assert [c.token_ids for c in choices] == [alone] * 4


def test_choices_fork_from_a_prefix_cache_session(demo_dir, chat_ids):
    """With the prefix cache the first choice records the prompt; a second request hits it; every
    choice still equals its seeded request alone (float32: a hit's state rounds as a full prefill)."""
    loaded = hybridlm.load_model(demo_dir, dtype=torch.float32)
    ids = chat_ids("Write a poem about the sea")
    params = SamplingParams(**{**SAMPLED.__dict__, "n": 2})
    want = solo(loaded.lm, loaded.tokenizer, ids, params)
    prefix = PrefixCache(loaded.lm)
    with Engine(loaded.lm, loaded.tokenizer, max_running=2, prefix=prefix) as engine:
        first = engine.generate_choices(ids, params)
        again = engine.generate_choices(ids, params)
    assert [c.token_ids for c in first] == want == [c.token_ids for c in again]
    assert again[0].usage.cached_tokens == len(ids) - 1


def test_cancelling_ends_every_choice(model, chat_ids):
    long = SamplingParams(temperature=0.5, seed=1, max_tokens=100_000, ignore_eos=True, n=3)
    with Engine(model.lm, model.tokenizer, max_running=3) as engine:
        events: list = []
        request = engine.submit(chat_ids("Go on"), long, events.append)
        wait_until(lambda: {e.index for e in events} == {0, 1, 2})
        request.cancel()
        wait_until(lambda: sum(e.finished for e in events) == 3)
        wait_until(lambda: engine.num_running == 0)
    assert sorted(e.index for e in events if e.finished) == [0, 1, 2]
    assert {e.finish_reason for e in events if e.finished} == {"cancelled"}


def test_a_request_cancelled_while_queued_ends_every_choice(model, chat_ids):
    with Engine(model.lm, model.tokenizer, max_running=2) as engine:
        long = SamplingParams(max_tokens=100_000, ignore_eos=True)
        busy = engine.submit(chat_ids("Go on"), long, lambda e: None)
        events: list = []
        waiting = engine.submit(chat_ids("Hi"), SamplingParams(max_tokens=4, n=2), events.append)
        waiting.cancel()
        wait_until(lambda: sum(e.finished for e in events) == 2)
        busy.cancel()
    assert sorted(e.index for e in events) == [0, 1]


def test_n_beyond_max_running_is_refused(model, chat_ids):
    with Engine(model.lm, model.tokenizer, max_running=2) as engine, pytest.raises(InvalidParameter) as info:
        engine.submit(chat_ids("Hi"), SamplingParams(n=3), lambda e: None)
    assert info.value.param == "n"


def test_choices_of_a_long_prompt_share_its_kv_rows(model, chat_ids, monkeypatch):
    """n = 4 after a ~1,450-token prompt: the choices read one copy of the prompt's KV rows (copy-on-
    write) and each holds only its own rows after the split, not a copy of the prompt; every choice
    still equals its seeded request alone, bit for bit in bf16."""
    ids = chat_ids("Tell me a story about a robot " * 120)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=6, ignore_eos=True, n=4)
    held: dict[int, list] = {}  # every choice's caches, kept past the request's end
    fork = engine_module.fork_caches

    def watched(caches, fresh):
        held[id(caches)] = caches
        out = held[id(fresh)] = fork(caches, fresh)
        return out

    monkeypatch.setattr(engine_module, "fork_caches", watched)
    with Engine(model.lm, model.tokenizer, max_running=4) as engine:
        choices = engine.generate_choices(ids, params)
    assert [c.token_ids for c in choices] == solo(model.lm, model.tokenizer, ids, params)
    assert len(held) == 4
    split = len(ids) // KEY_BLOCK * KEY_BLOCK
    layers = [list(layer) for layer in zip(*held.values(), strict=True) if isinstance(layer[0], KVCache)]
    assert layers
    for layer in layers:
        (shared,) = layer[0].segments
        assert all(c.segments == [shared] for c in layer) and shared.holders == 4
        assert (shared.start, shared.end) == (0, split)
        row = shared.k[0, :, 0].numel() * shared.k.element_size() * 2  # a position's key + value
        prompt_buffer = -(-len(ids) // layer[0].step) * layer[0].step * row
        assert shared.nbytes == prompt_buffer  # the prefill's buffer, frozen: no copy was made
        for c in layer:  # own rows: the few after the split and the generated ones (one growth step)
            assert c.nbytes == layer[0].step * row
        cow = held_bytes(layer)
        assert cow == prompt_buffer + 4 * layer[0].step * row
        assert cow < 0.45 * 4 * prompt_buffer  # four private copies of the prompt's rows


def test_every_choice_reaches_the_trie(model32, chat_ids):
    """Each choice's continuation is attached below the prompt's node when it ends: a follow-up of
    any choice restores exactly what the brute-force oracle (the longest prefix among every stored
    sequence) says, and still answers as it does alone (float32: a hit rounds as a full prefill)."""
    ids = chat_ids("Tell me a story about a robot " * 8)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=6, ignore_eos=True, n=3)
    prefix = PrefixCache(model32.lm)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with Engine(model32.lm, model32.tokenizer, max_running=3, prefix=prefix) as engine:
        choices = engine.generate_choices(ids, params)
        assert [c.token_ids for c in choices] == solo(model32.lm, model32.tokenizer, ids, params)
        stored = [ids + c.token_ids[:-1] for c in choices]  # what each choice fed (its last token: not)
        assert len({tuple(s) for s in stored}) == 3
        for c in choices:
            follow = ids + c.token_ids + [5]
            got = engine.generate(follow, greedy)
            oracle = max(common_prefix(s, follow[:-1]) for s in stored)
            assert got.usage.cached_tokens == oracle == len(stored[0])
            assert got.token_ids == solo(model32.lm, model32.tokenizer, follow, greedy)[0]
