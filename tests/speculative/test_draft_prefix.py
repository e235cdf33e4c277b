"""The prefix cache's draft companion: a hit restores the draft model's caches beside the target's,
so the draft model feeds only what it lacks, output stays plain greedy and the target's reuse is
what it is without the companion; restored draft caches compute what recomputed ones do; draft
snapshots count in the RAM budget."""

from __future__ import annotations

import pytest
import torch

import hybridlm
from hybridlm.batch import Batch
from hybridlm.demo import write_demo_model
from hybridlm.engine import Engine, SamplingParams
from hybridlm.prefix.cache import CapturePlan, PrefixCache
from hybridlm.speculative import DraftModel
from tests.speculative.helpers import generate, ids_for, same_output, speculator
from tests.speculative.test_verify import OTHER_DRAFT


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    """The demo model (hybrid, real tokenizer) in float32."""
    return hybridlm.load_model(write_demo_model(tmp_path_factory.mktemp("demo")), dtype=torch.float32)


class CountingModel:
    """A model that counts the tokens its forwards are fed (everything else is the model's)."""

    def __init__(self, model):
        self.model = model
        self.fed = 0

    def __call__(self, batch: Batch, caches, **kw):
        self.fed += sum(batch.query_lens)
        return self.model(batch, caches, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def conversation(prompt: list[int], first_output: list[int]) -> list[list[int]]:
    """A first request, a follow-up extending it, one diverging inside it, a regenerate."""
    return [
        prompt,
        prompt + first_output + ids_for(9, seed=6),
        prompt[:30] + ids_for(12, seed=7),
        prompt,
    ]


def serve_all(model, draft: CountingModel, prompts, params, companion: bool):
    """Greedy requests through one engine with a prefix cache; `companion`: it stores `draft`'s caches."""
    prefix = PrefixCache(model, plan=CapturePlan(cadence=16), draft=draft if companion else None)
    with Engine(model, None, prefix=prefix, speculative=speculator(DraftModel(draft))) as engine:
        return [engine.generate(ids, params) for ids in prompts]


# one family per kind of companion cache (GDN, conv, sliding window, KDA + MLA, MoE): the verify tests
# run every family; here each extra family costs ~25 s of CI for the same restore code
@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2", "gemma3_text", "kimi_linear", "qwen3_5_moe_text"])
@pytest.mark.parametrize("draft_kind", ["self-int8", "other"])
def test_draft_caches_restored_from_the_trie_feed_only_what_they_lack(models, name, draft_kind):
    model = models(name)
    draft_lm = models(name, int8=True) if draft_kind == "self-int8" else models(OTHER_DRAFT[name])
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = ids_for(37, seed=5)
    first = generate(model, None, prompt, greedy).token_ids
    prompts = conversation(prompt, first)
    with_draft, without = CountingModel(draft_lm), CountingModel(draft_lm)
    got = serve_all(model, with_draft, prompts, greedy, companion=True)
    reference = serve_all(model, without, prompts, greedy, companion=False)
    for ids, a, b in zip(prompts, got, reference, strict=True):
        same_output(a, generate(model, None, ids, greedy))
        assert a.usage.cached_tokens == b.usage.cached_tokens
        assert a.usage.speculative.verify_passes > 0
        # Restored draft caches draft what recomputed ones do (the int8 copy is mostly right, so a
        # wrong restore would show in what is accepted).
        assert a.usage.speculative.accepted_tokens == b.usage.speculative.accepted_tokens
    assert with_draft.fed < without.fed - 60  # three hits of ≥ 30 prompt tokens were not re-fed


@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2", "gemma3_text", "dense_llama"])
def test_restored_draft_caches_give_the_logits_of_a_draft_run_from_scratch(models, name):
    target, draft = models(name), models(OTHER_DRAFT[name])
    pc = PrefixCache(target, plan=CapturePlan(cadence=8, tail=(1, 3)), draft=draft)
    first = ids_for(29, seed=1)
    for prompt in (first, first + ids_for(11, seed=2), first[:17] + ids_for(6, seed=3)):
        session = pc.begin(prompt, draft=True)
        own = session.draft
        logits = draft(Batch.single(own.remaining, offset=own.offset), own.caches)
        own.advance(own.remaining)
        session.close()
        if prompt is not first:
            assert own.cached > 0
        expected = draft(Batch.single(prompt), draft.make_caches(1))
        torch.testing.assert_close(logits[0], expected[0], rtol=1e-4, atol=1e-4)


def test_budget_counts_draft_snapshots_and_gives_the_target_first_claim(models):
    target, draft = models("qwen3_5_text"), models("lfm2")
    budget = 460_000  # the target's snapshots take ~425 kB of it: the draft's get the rest
    pc = PrefixCache(target, ram_budget=budget, plan=CapturePlan(cadence=16, tail=(1,)), draft=draft)
    alone = PrefixCache(target, ram_budget=budget, plan=CapturePlan(cadence=16, tail=(1,)))
    for seed in range(8):
        prompt = ids_for(40, seed=seed % 3) + ids_for(20, seed=10 + seed)
        for cache in (pc, alone):
            session = cache.begin(prompt, draft=True)
            for own, model in ((session, target), (session.draft, draft)):
                if own is not None:
                    model(Batch.single(own.remaining, offset=own.offset), own.caches)
                    own.advance(own.remaining)
            session.close()
        assert pc.ram_bytes <= budget
        assert pc.nbytes == alone.nbytes  # the draft's snapshots never displace the target's
    assert pc.draft.nbytes > 0 and pc.draft.stats.evicted_nodes > 0


def test_cli_gives_the_prefix_cache_a_draft_companion_only_for_a_draft_model(demo_model):
    from hybridlm.settings import Settings, make_engine

    parse = lambda *flags: Settings.parse(flags)
    flags = ("--speculative", "draft", "--draft-model", str(demo_model.path))
    with make_engine(demo_model, parse(*flags)) as engine:
        assert engine.prefix.draft.model is engine.speculative.make_drafter.model
    for flags in ((), ("--speculative", "ngram")):
        with make_engine(demo_model, parse(*flags)) as engine:
            assert engine.prefix.draft is None
    with make_engine(demo_model, parse("--no-prefix-cache", *flags)) as engine:
        assert engine.prefix is None


def test_a_failed_draft_forward_drops_the_draft_session_and_later_requests_stay_lossless(models):
    model, draft = models("qwen3_5_text"), FailingOnce(models("lfm2"))
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    prompt = ids_for(37, seed=5)
    prefix = PrefixCache(model, plan=CapturePlan(cadence=16), draft=draft)
    with Engine(model, None, prefix=prefix, speculative=speculator(DraftModel(draft))) as engine:
        engine.generate(prompt, greedy)
        draft.fail_at = draft.calls + 3  # inside the second request's decoding
        failed = engine.generate(prompt + ids_for(5, seed=8), greedy)
        assert failed.finish_reason == "error"
        for ids in (prompt + ids_for(5, seed=8), prompt[:20] + ids_for(4, seed=9)):
            same_output(engine.generate(ids, greedy), generate(model, None, ids, greedy))


class FailingOnce(CountingModel):
    """A model whose forward number `fail_at` raises (after changing nothing)."""

    def __init__(self, model):
        super().__init__(model)
        self.calls, self.fail_at = 0, -1

    def __call__(self, batch: Batch, caches, **kw):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("draft forward failed")
        return super().__call__(batch, caches, **kw)
