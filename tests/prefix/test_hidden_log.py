"""The prefix cache's hidden log: sessions fed with the target's hidden states store them beside the
snapshots, a hit hands back those of every restored position (also after edges were split), their
bytes count in the RAM budget, and a session missing any, or a node demoted to disk, stores none."""

from __future__ import annotations

import random

import torch

from hybridlm.batch import Batch
from hybridlm.prefix.cache import CapturePlan, PrefixCache
from hybridlm.prefix.disk import DiskTier, model_fingerprint
from tests.prefix.test_cache import tokens


def serve_with_hidden(pc: PrefixCache, model, prompt: list[int], generate: int, skip_hidden_at=None):
    """One greedy request whose forwards hand the session their hidden states (except the forward at
    offset `skip_hidden_at`); returns the session as `begin` made it."""
    session = pc.begin(prompt)
    ids = session.remaining
    while True:
        batch = Batch.single(ids, offset=session.offset)
        logits, hidden = model(batch, pc.caches, hidden="all")
        session.advance(ids, None if session.offset == skip_hidden_at else hidden[0])
        if len(session.fed) >= len(prompt) + generate - 1:
            break
        ids = [int(logits.argmax(-1)[0])]
    session.close()
    return session


def plain_hidden(model, ids: list[int]) -> torch.Tensor:
    return model(Batch.single(ids), model.make_caches(1), hidden="all")[1][0]


def test_a_hit_hands_back_the_hidden_states_of_every_restored_position(tiny_model):
    rng = random.Random(0)
    pc = PrefixCache(tiny_model, plan=CapturePlan(cadence=8, tail=(1, 3)))
    a = tokens(rng, 30)
    prompts = [a, a + tokens(rng, 9), a[:13] + tokens(rng, 7), a[:21] + tokens(rng, 5), a]
    hits = 0
    for prompt in prompts:
        session = serve_with_hidden(pc, tiny_model, prompt, generate=4)
        if session.cached == 0:
            assert session.hidden is None
            continue
        hits += 1
        expected = plain_hidden(tiny_model, prompt[: session.cached])
        torch.testing.assert_close(session.hidden, expected, rtol=0, atol=1e-4)
    assert hits == len(prompts) - 1
    for node in pc.trie.nodes():  # splits cut the hidden logs where they cut the edges
        assert node.hidden is not None and len(node.hidden) == len(node.tokens)


def test_hidden_states_count_in_the_ram_budget(tiny_model):
    prompt = tokens(random.Random(1), 20)
    without, with_hidden = PrefixCache(tiny_model), PrefixCache(tiny_model)
    session = without.begin(prompt)
    tiny_model(Batch.single(prompt), without.caches)
    session.advance(prompt)
    session.close()
    serve_with_hidden(with_hidden, tiny_model, prompt, generate=1)
    hidden = [n.hidden for n in with_hidden.trie.nodes()]
    extra = sum(h.numel() * h.element_size() for h in hidden)
    assert extra == len(prompt) * tiny_model.config.hidden_size * 4
    assert with_hidden.ram_bytes == without.ram_bytes + extra


def test_a_session_missing_hidden_states_stores_none(tiny_model):
    prompt = tokens(random.Random(2), 30)
    pc = PrefixCache(tiny_model, plan=CapturePlan(cadence=8))
    serve_with_hidden(pc, tiny_model, prompt, generate=4, skip_hidden_at=len(prompt))
    assert all(node.hidden is None for node in pc.trie.nodes())
    assert pc.begin(prompt).hidden is None


def test_nodes_demoted_to_disk_drop_their_hidden_states(tiny_model, tmp_path):
    prompt = tokens(random.Random(3), 30)
    disk = DiskTier(tmp_path, 1 << 30, model_fingerprint(tiny_model))
    pc = PrefixCache(tiny_model, plan=CapturePlan(cadence=8), disk=disk)
    serve_with_hidden(pc, tiny_model, prompt, generate=4)
    assert pc.persist() > 0
    session = pc.begin(prompt + [7])
    assert session.cached >= len(prompt) and session.hidden is None
