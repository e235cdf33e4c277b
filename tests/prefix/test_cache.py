"""The prefix cache against a brute-force oracle (best possible reuse over every sequence ever
stored) and against recomputation from scratch (logits after any restore)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.prefix.cache import CapturePlan, PrefixCache, Session, common_prefix
from hybridlm.prefix.session import budgeted
from hybridlm.prefix.trie import Trie

KINDS = [
    "qwen3_5_text", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "gemma3_text", "gemma4_text", "dense_llama",
    "kimi_linear", "bailing_hybrid", "bamba", "nemotron_h", "falcon_h1",
]


class Oracle:
    """Every token sequence whose state was ever stored; best reuse = longest common prefix."""

    def __init__(self):
        self.stored: list[list[int]] = []

    def best(self, prompt: list[int]) -> int:
        keep = len(prompt) - 1
        return min(keep, max((common_prefix(s, prompt) for s in self.stored), default=0))


def assert_counted(pc: PrefixCache) -> None:
    """The RAM figure the cache keeps as nodes change equals a count over every node."""
    assert pc.nbytes == sum(budgeted(n) for n in Trie.nodes(pc.trie)) + pc.pending_bytes
    if pc.draft is not None:
        assert_counted(pc.draft)


def full_logits_last(model, ids):
    return model(Batch.single(ids), model.make_caches(1))[0]


def serve(pc: PrefixCache, model, prompt: list[int], generate: int, oracle=None, cancel_at=None):
    """One request: restore, prefill the rest (chunks of 16), greedy-generate; returns the session
    and the logits at the prompt's last token."""
    session = pc.begin(prompt)
    rest = session.remaining
    logits = None
    for i in range(0, len(rest), 16):
        piece = rest[i : i + 16]
        if cancel_at is not None and session.offset + len(piece) > cancel_at:
            session.close()
            if oracle is not None:
                oracle.stored.append(list(session.fed))
            return session, None
        logits = model(Batch.single(piece, offset=session.offset), pc.caches)
        session.advance(piece)
    first = logits[0]
    for _ in range(max(generate - 1, 0)):
        token = int(logits.argmax(-1)[0])
        logits = model(Batch.single([token], offset=session.offset), pc.caches)
        session.advance([token])
    session.close()
    if oracle is not None:
        oracle.stored.append(list(session.fed))
    return session, first


def tokens(rng, n):
    return [rng.randrange(1, 500) for _ in range(n)]


def scenario(rng):
    """Multi-turn, rewritten tail, regenerate, edit of an earlier message, shared system prompt,
    interleaved conversations: prompts as the engine would see them."""
    system = tokens(rng, 40)
    a1 = system + tokens(rng, 25)
    yield a1
    yield a1  # regenerate
    a2 = a1 + tokens(rng, 6) + tokens(rng, 20)
    yield a2  # next turn (the previous answer is not exactly what was generated)
    yield a2[:-12] + tokens(rng, 15)  # history rewritten near the end
    b1 = system + tokens(rng, 30)
    yield b1  # another conversation sharing the system prompt
    yield a1[:23] + tokens(rng, 30)  # edit inside an old prompt (divergence mid-edge)
    yield a2 + tokens(rng, 10)
    yield b1 + tokens(rng, 12)


@pytest.mark.parametrize("name", KINDS)
def test_reuse_equals_oracle_and_logits_equal_recompute(checkpoints, name):
    model = load_model(checkpoints(name).path, dtype=torch.float32, device="cpu")
    pc = PrefixCache(model, plan=CapturePlan(cadence=16, tail=(1, 4)))
    oracle = Oracle()
    rng = random.Random(7)
    for prompt in scenario(rng):
        best = oracle.best(prompt)
        session, first = serve(pc, model, prompt, generate=5, oracle=oracle)
        assert session.cached == best, f"reused {session.cached}, oracle {best}"
        expected = full_logits_last(model, prompt)
        scale = expected.abs().max().item()
        assert (first - expected).abs().max().item() <= 2e-5 * scale


@pytest.mark.parametrize("name", ["qwen3_5_text"])
def test_cancelled_prefill_keeps_what_it_computed(checkpoints, name):
    model = load_model(checkpoints(name).path, dtype=torch.float32, device="cpu")
    pc = PrefixCache(model, plan=CapturePlan(cadence=16, tail=(1,)))
    oracle = Oracle()
    prompt = tokens(random.Random(3), 90)
    session, _ = serve(pc, model, prompt, generate=3, oracle=oracle, cancel_at=50)
    assert 0 < session.offset <= 50
    retry, first = serve(pc, model, prompt, generate=3, oracle=oracle)
    assert retry.cached == session.offset
    expected = full_logits_last(model, prompt)
    assert (first - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


def test_replay_restores_mid_edge_for_recurrent_layers(checkpoints):
    """A divergence inside a long edge (no checkpoint near it) is recovered by scan replay."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")
    pc = PrefixCache(model, plan=CapturePlan(cadence=1000, tail=()))
    rng = random.Random(5)
    base = tokens(rng, 70)
    serve(pc, model, base, generate=1)
    edited = base[:37] + tokens(rng, 10)
    session, first = serve(pc, model, edited, generate=1)
    assert session.cached == 37 and session.replayed == 37
    expected = full_logits_last(model, edited)
    assert (first - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


def test_budget_holds_after_every_request(checkpoints):
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")
    budget = 400_000
    pc = PrefixCache(model, ram_budget=budget, plan=CapturePlan(cadence=16, tail=(1,)))
    rng = random.Random(9)
    for prompt in list(scenario(rng)) * 2:
        serve(pc, model, prompt, generate=4)
        assert pc.nbytes <= budget
    assert pc.stats.evicted_nodes + pc.stats.compacted_snapshots > 0


def test_requests_under_the_budget_never_walk_the_trie(checkpoints, monkeypatch):
    """The budget is checked at every prefill forward and every close: under the budget those checks
    read the figure kept as nodes change, never walk every node (a server's trie holds thousands after
    hours of traffic; walking it at each forward made every request slower than the one before)."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")
    pc = PrefixCache(model, ram_budget=1 << 40, plan=CapturePlan(cadence=16, tail=(1,)))
    rng = random.Random(13)
    for _ in range(12):
        serve(pc, model, tokens(rng, 40), generate=3)
    walks = []
    nodes = Trie.nodes
    monkeypatch.setattr(Trie, "nodes", lambda trie: walks.append(1) or nodes(trie))
    serve(pc, model, tokens(rng, 60), generate=3)
    assert walks == []
    assert_counted(pc)


def test_nodes_are_compacted_once(checkpoints, monkeypatch):
    """At the budget every forward makes room; nodes compacted before have nothing left to drop and
    are not gone through again."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")
    pc = PrefixCache(model, plan=CapturePlan(cadence=8, tail=(1, 3)))
    rng = random.Random(14)
    for _ in range(6):
        serve(pc, model, tokens(rng, 40), generate=2)
    pc.ram_budget = 0
    pc.enforce_budget(delete=False)  # compacts every node, deletes none
    assert pc.stats.compacted_snapshots > 0
    assert_counted(pc)
    calls = []
    for kind in {type(c) for c in pc.caches if c is not None}:
        compact = kind.compact
        monkeypatch.setattr(kind, "compact", lambda cache, snap, f=compact: calls.append(1) or f(cache, snap))
    pc.enforce_budget(delete=False)
    assert calls == []
    assert_counted(pc)


class PrefixMachine(RuleBasedStateMachine):
    """Random begin / prefill / generate / cancel / budget sequences against the oracle."""

    model = None

    def __init__(self):
        super().__init__()
        self.pc = PrefixCache(self.model, ram_budget=None, plan=CapturePlan(cadence=8, tail=(1, 3)))
        self.oracle = Oracle()
        self.rng = random.Random(0)
        self.prompts: list[list[int]] = []

    def _prompt(self, base_index, cut, extra):
        if self.prompts and base_index is not None:
            base = self.prompts[base_index % len(self.prompts)]
            return base[: min(cut, len(base))] + [self.rng.randrange(1, 40) for _ in range(extra)]
        return [self.rng.randrange(1, 40) for _ in range(extra + 1)]

    @rule(
        base=st.one_of(st.none(), st.integers(0, 50)),
        cut=st.integers(0, 40),
        extra=st.integers(1, 12),
        gen=st.integers(0, 4),
    )
    def request(self, base, cut, extra, gen):
        prompt = self._prompt(base, cut, extra)
        best = self.oracle.best(prompt)
        session, _ = serve(self.pc, self.model, prompt, gen, self.oracle)
        assert session.cached <= best
        if self.pc.ram_budget is None:
            assert session.cached == best
        self.prompts.append(prompt)

    @rule(base=st.integers(0, 50), extra=st.integers(2, 30), at=st.integers(1, 20))
    def cancelled(self, base, extra, at):
        prompt = self._prompt(base, 40, extra)
        cancel_at = self.oracle.best(prompt) + at
        serve(self.pc, self.model, prompt, 0, self.oracle, cancel_at=cancel_at)
        self.prompts.append(prompt)

    @precondition(lambda self: self.pc.node_count > 2)
    @rule(fraction=st.floats(0.1, 0.9))
    def squeeze_budget(self, fraction):
        self.pc.ram_budget = int(self.pc.nbytes * fraction)
        self.pc.enforce_budget()

    @invariant()
    def structure(self):
        pc = self.pc
        offsets = {pc.caches[i].offset for i in pc.layers}
        assert offsets == {len(pc.live)}
        for node in pc.trie.nodes():
            assert node.tokens and node.parent.children[node.tokens[0]] is node
            assert node.start == node.parent.end
            for snap in node.snaps:
                if snap is not None:
                    assert not snap.closed and (snap.start, snap.end) == (node.start, node.end)
        assert_counted(pc)
        if pc.ram_budget is not None:
            assert pc.nbytes <= pc.ram_budget or pc.node_count == len(pc.live_path())


def test_prefix_cache_state_machine(tiny_model):
    PrefixMachine.model = tiny_model
    run = PrefixMachine.TestCase
    run.settings = settings(
        max_examples=10, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck)
    )
    run().runTest()


def test_abandoned_session_resets_the_live_caches_and_keeps_the_trie(checkpoints):
    """After a failed forward the engine abandons the session: the live caches restart at 0, the
    trie still serves what was stored before, and results equal recomputation."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")
    pc = PrefixCache(model, plan=CapturePlan(cadence=16, tail=(1,)))
    rng = random.Random(11)
    first = tokens(rng, 40)
    serve(pc, model, first, generate=2)
    session = pc.begin(first + tokens(rng, 10))
    model(Batch.single(session.remaining[:5], offset=session.offset), pc.caches)
    session.abandon()
    assert pc.live == [] and {pc.caches[i].offset for i in pc.layers} == {0}
    again, logits = serve(pc, model, first + tokens(rng, 3), generate=1)
    assert again.cached == len(first)
    expected = full_logits_last(model, first + again.prompt[len(first) :])
    assert (logits - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


def test_live_state_outliving_its_evicted_nodes_never_attaches_across_a_gap(checkpoints):
    """The budget may evict the live path's nodes while the live caches keep their state; a
    session continuing from that state must not hang its pieces below a shorter stored prefix
    (they would claim tokens at the wrong positions)."""
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")
    pc = PrefixCache(model, plan=CapturePlan(cadence=8, tail=(1, 3)))
    rng = random.Random(12)
    first = tokens(rng, 20)
    serve(pc, model, first, generate=2)
    pc.ram_budget = 0
    pc.enforce_budget()
    assert pc.node_count == 0 and len(pc.live) == 21
    pc.ram_budget = None
    longer = pc.live + tokens(rng, 12)
    session, logits = serve(pc, model, longer, generate=1)
    assert session.cached == 21  # the live caches alone
    for node in pc.trie.nodes():
        assert node.start == node.parent.end
        assert all((s.start, s.end) == (node.start, node.end) for s in node.snaps if s is not None)
    again, logits = serve(pc, model, longer[:25] + tokens(rng, 4), generate=1)
    expected = full_logits_last(model, again.prompt)
    assert (logits - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


def owned_bytes(pc: PrefixCache) -> int:
    """Bytes the prefix cache's snapshots own right now: the trie's in RAM and the captures a running
    prefill has taken but not yet handed over."""
    pending = sum(s.nbytes for i in pc.layers for s in pc.caches[i].captures())
    return sum(node.nbytes for node in pc.trie.nodes()) + pending


@pytest.mark.parametrize("name", ["qwen3_5_text", "gemma3_text"])
def test_budget_holds_at_every_forward_during_requests(checkpoints, name, monkeypatch):
    """Captures taken inside a prefill count before they are kept, and rows a lazy trie snapshot names
    count before the live buffer overwrites them: after every forward of every request, the RAM the
    snapshots own — and the figure reported — stay within the budget."""
    model = load_model(checkpoints(name).path, dtype=torch.float32, device="cpu")
    budget = 300_000
    pc = PrefixCache(model, ram_budget=budget, plan=CapturePlan(cadence=16, tail=(1,)))
    seen = []
    real = Session.advance

    def advance(session, ids, hidden=None):
        real(session, ids, hidden)
        seen.append((owned_bytes(pc), pc.ram_bytes))

    monkeypatch.setattr(Session, "advance", advance)
    for prompt in list(scenario(random.Random(9))) * 2:
        serve(pc, model, prompt, generate=4)
    assert max(owned for owned, _ in seen) <= budget
    assert max(reported for _, reported in seen) <= budget
    assert pc.stats.evicted_nodes > 0
