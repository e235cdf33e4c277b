"""Handing evicted snapshots' heap memory back to the system (`engine.memory.HeapTrimmer`): a trim
after every quota of bytes the prefix cache released, between engine steps."""

from __future__ import annotations

import random

import hybridlm
from hybridlm.engine import Engine
from hybridlm.engine.memory import HeapTrimmer, _malloc_trim
from hybridlm.engine.params import SamplingParams
from hybridlm.prefix.cache import CapturePlan, PrefixCache


class Counted(HeapTrimmer):
    """A trimmer whose trims are counted, not run."""

    def __init__(self, every: int):
        super().__init__(every)
        self.trims: list[int] = []
        self._trim = self.trims.append


def test_a_trim_follows_each_released_quota():
    trimmer = Counted(every=100)
    trimmed = [trimmer(n) for n in (0, 99, 100, 150, 199, 200, 450)]
    assert trimmed == [False, False, True, False, False, True, True]
    assert len(trimmer.trims) == 3


def test_without_glibc_nothing_is_trimmed(monkeypatch):
    monkeypatch.setattr("sys.platform", "darwin")
    assert _malloc_trim() is None
    trimmer = HeapTrimmer(every=1)
    trimmer._trim = None
    assert not trimmer(10)


def test_an_engine_at_its_budget_trims_as_it_evicts(demo_dir):
    """Distinct prompts through a small budget: the trie releases bytes as it evicts, the count only
    grows, and the engine trims once per quota of them."""
    lm = hybridlm.load_model(demo_dir).lm
    prefix = PrefixCache(lm, ram_budget=4 << 20, plan=CapturePlan())
    rng = random.Random(0)
    prompts = [[rng.randrange(lm.vocab_size) for _ in range(300)] for _ in range(6)]
    seen = []
    with Engine(lm, None, prefix=prefix, prefill_chunk=128) as engine:
        engine._trim = Counted(every=1 << 20)
        for prompt in prompts:
            engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
            seen.append(prefix.released_bytes)
        trims = engine._trim.trims
    assert prefix.stats.evicted_nodes > 0
    assert seen == sorted(seen) and seen[-1] >= 2 << 20
    assert 1 <= len(trims) <= seen[-1] // (1 << 20)
