"""Sessions restoring the same trie node read its KV rows once (copy-on-write segments): against
recomputation from scratch and the brute-force prefix oracle, with evictions and disk paging while
the rows are read."""

from __future__ import annotations

import random
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridlm.batch import Batch
from hybridlm.cache.kv import KVCache, held_bytes
from hybridlm.models import load_model
from hybridlm.prefix.cache import CapturePlan, PrefixCache
from hybridlm.prefix.disk import DiskTier, model_fingerprint
from tests.prefix.test_cache import Oracle, assert_counted, full_logits_last, serve, tokens


def kv_caches(sessions) -> list[KVCache]:
    return [c for s in sessions for c in s.caches if isinstance(c, KVCache)]


def feed(model, session, ids):
    logits = model(Batch.single(ids, offset=session.offset), session.caches)
    session.advance(ids)
    return logits[0]


def assert_recomputed(model, session, logits):
    expected = full_logits_last(model, session.fed)
    assert (logits - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


@pytest.mark.parametrize("name", ["qwen3_5_text", "gemma3_text"])
def test_sessions_restoring_one_node_read_its_rows_once(checkpoints, name):
    """Four sessions at once continue one stored 300-token prompt: the trie restores it into each
    slot without a copy per slot (the ones that do not hold it live read the node's rows as segments:
    one copy in all, counted by the budget, none in the sessions' own bytes); each session's logits
    equal recomputation from scratch; a budget of 0 while they run frees none of the rows they read
    (locked nodes); once they end, the nodes go and no slot keeps the rows alive."""
    model = load_model(checkpoints(name).path, dtype=torch.float32, device="cpu")
    pc = PrefixCache(model, plan=CapturePlan(cadence=64, tail=(1,)))
    pc.reserve(4)
    rng = random.Random(3)
    prompt = tokens(rng, 300)
    oracle = Oracle()
    serve(pc, model, prompt, generate=1, oracle=oracle)
    prompts = [prompt + tokens(rng, 5) for _ in range(4)]
    sessions = [pc.begin(p) for p in prompts]
    assert [s.cached for s in sessions] == [oracle.best(p) for p in prompts] == [300] * 4
    readers = [s for s in sessions if any(c.segments for c in kv_caches([s]))]
    assert len(readers) == 3  # the fourth took the slot that computed the prompt (a live rewind)
    sources = {id(seg.source) for c in kv_caches(readers) for seg in c.segments}
    trie_snaps = {id(s) for n in pc.trie.match(prompt)[0] for s in n.snaps if s is not None}
    assert sources <= trie_snaps  # the node path's snapshots themselves, frozen once
    for layer in zip(*(kv_caches([s]) for s in readers), strict=True):
        assert all([g.source for g in c.segments] == [g.source for g in layer[0].segments] for c in layer)
        assert len(layer[0].segments) > 1 or layer[0].window is not None  # one per node on the path
    row = sum(
        2 * c.segments[0].k[0, :, 0].numel() * c.segments[0].k.element_size()
        for c in kv_caches(readers[:1])
    )
    assert held_bytes(kv_caches(readers)) == sum(c.nbytes for c in kv_caches(readers))  # the trie's
    assert sum(c.nbytes for c in kv_caches(readers)) < 3 * 300 * row / 4
    pc.ram_budget = 0
    pc.enforce_budget()
    read = [seg for c in kv_caches(readers) for seg in c.segments]
    assert all(not seg.source.closed and seg.in_trie for seg in read)
    for session in sessions:
        assert_recomputed(model, session, feed(model, session, session.remaining))
    for session in sessions:
        assert_recomputed(model, session, feed(model, session, [7]))
        session.close()
    pc.enforce_budget()
    assert pc.node_count == 0
    slots = [c for slot in pc.slots for c in slot.caches if isinstance(c, KVCache)]
    assert held_bytes(slots) == sum(c.nbytes for c in slots)  # no slot keeps freed rows alive


class SharedRestoreMachine(RuleBasedStateMachine):
    """Up to three sessions open at once on prompts that share prefixes, fed in interleaved chunks,
    under a RAM budget that is squeezed and a disk tier nodes are paged to: every logit equals
    recomputation, every restore equals the brute-force oracle (without a budget), and the rows an
    open session reads as segments are never freed by eviction nor changed by anyone."""

    model = None

    def __init__(self):
        super().__init__()
        self.dir = tempfile.TemporaryDirectory(prefix="hybridlm-shared-")
        disk = DiskTier(self.dir.name, 1 << 30, model_fingerprint(self.model))
        self.pc = PrefixCache(self.model, plan=CapturePlan(cadence=8, tail=(1, 3)), disk=disk)
        self.pc.reserve(3)
        self.oracle = Oracle()
        self.rng = random.Random(0)
        self.prompts: list[list[int]] = [tokens(self.rng, 48)]
        serve(self.pc, self.model, self.prompts[0], generate=1, oracle=self.oracle)  # a shared prefix
        self.open: list = []
        self.frozen: dict[int, tuple] = {}
        self.squeezed = False  # nodes were evicted: restores may fall short of the oracle
        self.squeezes = 0  # squeezes while open sessions read rows (the case under test)

    def teardown(self):
        self.dir.cleanup()

    @precondition(lambda self: len(self.open) < 3)
    @rule(base=st.integers(0, 50), cut=st.integers(8, 48), extra=st.integers(1, 10))
    def begin(self, base, cut, extra):
        base_prompt = self.prompts[base % len(self.prompts)]
        prompt = base_prompt[:cut] + tokens(self.rng, extra)
        best = self.oracle.best(prompt)
        session = self.pc.begin(prompt)
        if not self.squeezed:
            assert session.cached == best
        assert session.cached <= best
        self.prompts.append(prompt)
        self.open.append(session)

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 2), n=st.integers(1, 12))
    def advance(self, i, n):
        session = self.open[i % len(self.open)]
        ids = session.remaining[:n] or [self.rng.randrange(1, 500)]
        assert_recomputed(self.model, session, feed(self.model, session, ids))

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 2))
    def close(self, i):
        session = self.open.pop(i % len(self.open))
        session.close()
        self.oracle.stored.append(list(session.fed))

    def _read(self):
        return [seg for c in kv_caches(self.open) for seg in c.segments if seg.source is not None]

    @precondition(lambda self: self.open and self.pc.node_count > 1)
    @rule(tenths=st.integers(0, 9))
    def squeeze_budget(self, tenths):
        read = [seg for seg in self._read() if not seg.source.closed]  # (paged ones are the readers')
        self.pc.ram_budget = self.pc.nbytes * tenths // 10
        self.squeezed = True
        self.pc.enforce_budget()
        assert all(not seg.source.closed for seg in read), "eviction freed rows a session reads"
        self.squeezes += bool(read)

    @precondition(lambda self: self.open and self.pc.ram_nodes)
    @rule()
    def page_to_disk(self):
        self.pc.persist()  # read nodes too: their stand-ins go to disk, the rows stay with the readers
        slots = [c for slot in self.pc.slots for c in slot.caches if isinstance(c, KVCache)]
        shared = {seg.storage: seg.nbytes for c in slots for seg in c.segments if not seg.in_trie}
        assert held_bytes(slots) == sum(c.nbytes for c in slots) + sum(shared.values())

    @rule()
    def lift_budget(self):
        self.pc.ram_budget = None

    @invariant()
    def counted_bytes_are_the_nodes(self):
        assert_counted(self.pc)

    @invariant()
    def read_rows_never_change(self):
        for seg in self._read():
            if id(seg) not in self.frozen:
                self.frozen[id(seg)] = (seg, seg.k.clone(), seg.v.clone())
        for seg, k, v in self.frozen.values():
            assert torch.equal(seg.k, k) and torch.equal(seg.v, v)


def test_shared_restores_state_machine(tiny_model):
    SharedRestoreMachine.model = tiny_model
    run = SharedRestoreMachine.TestCase
    run.settings = settings(
        max_examples=12, stateful_step_count=16, deadline=None, suppress_health_check=list(HealthCheck)
    )
    run().runTest()
