"""Concurrent requests restoring the same long prefix from the trie read its KV rows once (copy-on-
write segments), and each answers exactly as it does alone with the same prefix stored."""

from __future__ import annotations

import threading
from collections import Counter

from hybridlm.cache import KVCache
from hybridlm.cache.kv import RowsSnapshot, held_bytes
from hybridlm.engine import Engine, SamplingParams
from hybridlm.prefix.cache import PrefixCache, Session, common_prefix
from hybridlm.prefix.session import snap_bytes as _snap_bytes


def test_concurrent_requests_restoring_one_prefix_hold_it_once(model, chat_ids, monkeypatch):
    """A ~1,450-token conversation is stored; four continuations of it then run at once: each
    restores exactly what the brute-force oracle says (the whole conversation); the slots that did
    not compute it read the trie node path's rows as segments (the KV rows of the four sequences and
    the trie together: two copies of the prompt and three small own buffers, against five copies);
    each output equals, token for token in bf16, the same request alone after the same
    conversation."""
    first = chat_ids("Tell me a story about a robot " * 120)
    base = SamplingParams(temperature=0.9, top_p=0.95, seed=1, max_tokens=4, ignore_eos=True)
    follow = [first + [40 + i, 50 + i, 60] for i in range(4)]
    params = [SamplingParams(**{**base.__dict__, "seed": 10 + i, "max_tokens": 6}) for i in range(4)]
    peak = {"readers": 0, "kv": 0}
    prefix = PrefixCache(model.lm)
    real = Session.advance

    def advance(session, ids, hidden=None):  # after every forward: what the running slots hold
        real(session, ids, hidden)
        running = [s for s in prefix.slots if s.session is not None]
        kv = [c for s in running for c in s.caches if isinstance(c, KVCache)]
        reading = Counter(
            source
            for s in running
            for source in {id(g.source) for c in s.caches if isinstance(c, KVCache) for g in c.segments}
        )
        snaps = [x for n in prefix.trie.nodes() for x in n.snaps if isinstance(x, RowsSnapshot)]
        trie = sum(_snap_bytes(x) for x in snaps)
        peak["readers"] = max(peak["readers"], *reading.values(), 0)
        peak["kv"] = max(peak["kv"], held_bytes(kv) + trie)

    monkeypatch.setattr(Session, "advance", advance)
    with Engine(model.lm, model.tokenizer, max_running=4, prefix=prefix) as engine:
        stored = engine.generate(first, base)
        fed = first + stored.token_ids[:-1]
        results: dict[int, object] = {}
        start = threading.Barrier(4)

        def run(i):
            start.wait()
            results[i] = engine.generate(follow[i], params[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    monkeypatch.setattr(Session, "advance", real)
    for i, ids in enumerate(follow):
        oracle = min(len(ids) - 1, common_prefix(fed, ids))
        assert results[i].usage.cached_tokens == oracle == len(first)
    assert peak["readers"] >= 3  # three slots read one node's rows at once (the fourth rewound its own)
    # A position's keys and values over every attention layer (bf16); buffers grow by `step` rows.
    row = sum(2 * m.kv_heads * m.head_dim * 2 for m in model.lm.modules() if hasattr(m, "kv_heads"))
    step = next(c for c in model.lm.make_caches(1) if isinstance(c, KVCache)).step
    one = len(first) * row
    # The trie's copy (of what the first request and the continuations that ended fed), the slot that
    # computed it (its buffer, grown by steps) and three own buffers of one step each; a copy per slot
    # would hold at least five copies.
    trie = len(fed) + sum(len(f) - len(first) + p.max_tokens for f, p in zip(follow, params, strict=True))
    shared = trie * row + -(-(len(first) + 16) // step) * step * row + 3 * step * row
    assert peak["kv"] <= shared < 0.6 * 5 * one
    for i, ids in enumerate(follow):
        with Engine(model.lm, model.tokenizer, max_running=1, prefix=PrefixCache(model.lm)) as alone:
            alone.generate(first, base)
            assert results[i].token_ids == alone.generate(ids, params[i]).token_ids
