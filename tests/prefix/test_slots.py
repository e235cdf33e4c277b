"""The prefix cache with several open sessions (continuous batching): each in a slot of its own,
interleaved forwards never touch each other's state, both attach on close, the live paths of all
slots are protected, and a begin beyond `reserve(n)` closes the oldest open session."""

from __future__ import annotations

import torch

from hybridlm.batch import Batch
from hybridlm.prefix.cache import CapturePlan, PrefixCache


def feed(model, session, ids):
    logits = model(Batch.single(ids, offset=session.offset), session.caches)
    session.advance(ids)
    return logits


def test_interleaved_sessions_keep_their_own_state_and_both_attach(tiny_model):
    pc = PrefixCache(tiny_model, plan=CapturePlan(cadence=8, tail=(1,)))
    pc.reserve(2)
    a, b = list(range(1, 30)), [7] * 5 + list(range(40, 60))
    sa, sb = pc.begin(a), pc.begin(b)
    assert not sa.closed and sa.slot is not sb.slot
    last = {}
    for i in range(0, 32, 8):  # interleaved chunks
        for name, session, ids in (("a", sa, a), ("b", sb, b)):
            if i < len(ids):
                last[name] = feed(tiny_model, session, ids[i : i + 8])
    fresh = lambda ids: tiny_model(Batch.single(ids), tiny_model.make_caches(1))
    torch.testing.assert_close(last["a"], fresh(a), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last["b"], fresh(b), rtol=1e-4, atol=1e-4)
    sa.close()
    sb.close()
    # Both prompts are stored: a continuation of each restores all of it.
    for ids in (a, b):
        session = pc.begin(ids + [3, 4])
        assert session.cached == len(ids)
        got = feed(tiny_model, session, session.remaining)
        torch.testing.assert_close(got, fresh(ids + [3, 4]), rtol=1e-4, atol=1e-4)
        session.close()


def test_live_paths_of_every_slot_are_protected_and_the_oldest_session_yields(tiny_model):
    pc = PrefixCache(tiny_model, plan=CapturePlan(cadence=8, tail=(1,)))
    pc.reserve(2)
    a, b = list(range(1, 20)), list(range(50, 70))
    for ids in (a, b):
        s = pc.begin(ids)
        feed(tiny_model, s, s.remaining)
        s.close()
    sa, sb = pc.begin(a + [1, 2]), pc.begin(b + [1, 2])
    protected = pc.live_path()
    assert {n.id for n in pc.trie.match(a)[0]} <= protected
    assert {n.id for n in pc.trie.match(b)[0]} <= protected
    third = pc.begin([9, 9, 9])  # both slots busy: the oldest open session is closed, its slot reused
    assert sa.closed and not sb.closed and third.slot is sa.slot
    third.close()
    sb.close()
