"""The MTP drafter (a Qwen3.5 / Qwen3-Next checkpoint's `mtp.*` head): its draft distributions equal
the published structure run by transformers' modules in float64 (tests/oracles/mtp.py), also when
its context starts after a prefix-cache hit; speculative greedy decoding with it equals plain greedy
decoding, in the engine too (prefix-cache hits, stop strings, stop ids and max_tokens inside drafts);
resuming from stored hidden states equals observing them, so after a prefix-cache hit the head drafts
exactly what it drafts without a prefix cache;
after accept / reject / plain-step patterns the target's caches equal a plain run and the head's
cache equals a head fed the plain run from scratch; a checkpoint or family without a head is refused
with a clear error."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

import hybridlm
from hybridlm.batch import Batch
from hybridlm.demo import write_demo_model
from hybridlm.engine import Engine, SamplingParams
from hybridlm.models import load_model
from hybridlm.models.checkpoint import CheckpointError
from hybridlm.prefix.cache import PrefixCache
from hybridlm.speculative import MTP, MTPDrafter, TargetPolicy
from tests.oracles.common import Checkpoint
from tests.oracles.mtp import MODEL_TYPE, MTPReference, add_mtp
from tests.speculative.helpers import (
    OracleDrafter,
    generate,
    hidden_greedy,
    hidden_prefill,
    ids_for,
    plain_greedy,
    prefix_hit_scenario,
    same_output,
    speculator,
)

NAMES = ["qwen3_5_text_mtp", "qwen3_next_mtp"]  # dense MLP / MoE in the head's layer; one file / an index
# The head's own structure and losslessness per MoE family; the engine and prefix-cache paths, which
# do not depend on the head's feed-forward block, run on NAMES only (CI time).
WITH_QWEN3_5_MOE = [*NAMES, "qwen3_5_moe_text_mtp"]
GENERATE = 40


@pytest.fixture(scope="module")
def heads(checkpoints, models):
    """(target, MTP, checkpoint) by checkpoint name, float32."""
    made = {}

    def get(name: str):
        if name not in made:
            model = models(name)
            made[name] = model, MTP.load(checkpoints(name).path, model), checkpoints(name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def demo_mtp(tmp_path_factory):
    """The demo model (real tokenizer) with a random MTP head added, float32."""
    path = write_demo_model(tmp_path_factory.mktemp("demo-mtp"))
    add_mtp(Checkpoint(path, Qwen3_5ForCausalLM, "demo"), "qwen3_5_text", shard=False)
    return hybridlm.load_model(path, dtype=torch.float32)


class RecordingMTPDrafter(MTPDrafter):
    """The MTP drafter as served, remembering every report of target hidden states; with `truth`, its
    drafts are then replaced by the known continuation (each token wrong with probability `wrong`),
    so that random heads, whose own drafts are almost never accepted, still see accepted runs."""

    def __init__(self, mtp: MTP, prompt=None, truth=None, wrong: float = 0.3, seed: int = 0):
        super().__init__(mtp.target, mtp.head)
        self.observed: list[tuple[int, list[int], torch.Tensor]] = []
        self.oracle = None
        if truth is not None:
            self.oracle = OracleDrafter(prompt, truth, wrong, seed, mtp.target.vocab_size)

    def observe(self, offset, tokens, hidden):
        self.observed.append((offset, list(tokens), hidden.clone()))
        super().observe(offset, tokens, hidden)

    def propose(self, tokens, k, policy):
        draft = super().propose(tokens, k, policy)
        return draft if self.oracle is None else self.oracle.propose(tokens, len(draft), policy)


def log_probs(draft) -> torch.Tensor:
    return draft.probs.double().log()


@pytest.mark.parametrize("name", WITH_QWEN3_5_MOE)
@pytest.mark.parametrize("start", [0, 17])
def test_drafts_follow_the_published_structure(heads, name, start):
    """Sampled drafts carry the head's distributions: equal to the reference's, step after step on
    its own hidden state, with the head's context starting at `start` (a prefix-cache hit); greedy
    drafts are the reference's argmax."""
    model, mtp, ckpt = heads(name)
    ref = MTPReference(ckpt, MODEL_TYPE[name])
    run = ids_for(40, seed=4)
    drafter = mtp()
    hidden_prefill(model, run[:-1], drafter, start)
    g = torch.Generator().manual_seed(0)
    draft = drafter.propose(run, 4, TargetPolicy(temperature=1.0, generator=g))
    expected = ref.logits(run, draft.tokens[:-1], start=start).log_softmax(-1)
    torch.testing.assert_close(log_probs(draft), expected, rtol=0, atol=1e-4)

    greedy = mtp()
    hidden_prefill(model, run[:-1], greedy, start)
    tokens = greedy.propose(run, 4, TargetPolicy()).tokens
    assert tokens == ref.logits(run, tokens[:-1], start=start).argmax(-1).tolist()


@pytest.mark.parametrize("name", WITH_QWEN3_5_MOE)
@pytest.mark.parametrize("truth", [False, True], ids=["own-drafts", "truth-drafts"])
def test_greedy_equals_plain_and_every_cache_equals_a_plain_run(heads, name, truth):
    """Speculative greedy = plain greedy for several prompt lengths (and a restored prefix). The
    target's hidden states reported to the drafter are those of a plain run, committed positions
    only and each once; afterwards the target's caches give a plain run's next logits, and the
    head's cache holds exactly the rows of a head fed the plain run from scratch."""
    model, mtp, _ = heads(name)
    for length, start in [(4, 0), (21, 0), (45, 0), (45, 30)]:
        prompt = ids_for(length, seed=length)
        expected = plain_greedy(model, prompt, GENERATE)
        drafter = RecordingMTPDrafter(mtp, prompt, expected if truth else None, seed=length)
        out, caches = hidden_greedy(model, prompt, GENERATE, drafter, seed=length, start=start)
        assert out == expected, (length, start)

        run = prompt + out
        end = len(run) - 1  # positions in the target's caches (the last token was never fed)
        ends = [o + h.shape[0] for o, _, h in drafter.observed]
        assert [o for o, _, _ in drafter.observed] == [start, *ends[:-1]] and ends[-1] == end
        assert [t for _, tokens, _ in drafter.observed for t in tokens] == run[start:end]
        reported = torch.cat([h for _, _, h in drafter.observed])
        plain_hidden = model(Batch.single(run[:end]), model.make_caches(1), hidden="all")[1][0, start:]
        torch.testing.assert_close(reported, plain_hidden, rtol=0, atol=1e-4)

        logits = model(Batch.single([run[-1]], offset=end), caches)
        fresh = model(Batch.single(run), model.make_caches(1))
        torch.testing.assert_close(logits, fresh, rtol=0, atol=1e-4)

        drafter.propose(run, 1, TargetPolicy())  # catch up on the last reports
        scratch = mtp()
        scratch.observe(start, run[start:end], plain_hidden)
        scratch.propose(run, 1, TargetPolicy())
        fed = end - start
        assert drafter.fed == scratch.fed == fed
        for ours, theirs in zip(drafter.cache.rows(0, fed), scratch.cache.rows(0, fed), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
        drafter.close()
        scratch.close()


@pytest.mark.parametrize("name", NAMES)
def test_engine_with_prefix_cache_hits_matches_plain_decoding(heads, name):
    """Through the engine with a prefix cache: a first request, then one extending it and one
    diverging inside it (both served partly from the cache) decode exactly as without speculation;
    the target reports hidden states from the first position it recomputed."""
    model, mtp, _ = heads(name)
    record = lambda ids, truth, i: RecordingMTPDrafter(mtp, ids, truth, wrong=0.3, seed=i)  # noqa: E731
    prompts, truths, results, drafters = prefix_hit_scenario(model, record)
    for got, truth, drafter in zip(results, truths, drafters, strict=True):
        assert got.token_ids == truth
        assert got.usage.speculative.accepted_tokens > 0
        assert drafter.observed[0][0] == got.usage.cached_tokens
    assert results[1].usage.cached_tokens >= len(prompts[1]) - 9 - 1
    assert results[2].usage.cached_tokens >= 30
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    untouched = generate(model, None, prompts[1], greedy, speculative=speculator(mtp))
    assert untouched.token_ids == truths[1] and untouched.usage.speculative.verify_passes > 0


@pytest.mark.parametrize("name", NAMES)
def test_resuming_from_stored_hidden_states_equals_observing_them(heads, name, monkeypatch):
    """`resume` over t restored positions (in several head forwards) leaves the head's cache, its
    pending hidden state and its next proposal as reports of those positions do."""
    model, mtp, _ = heads(name)
    monkeypatch.setattr("hybridlm.speculative.mtp.RESUME_CHUNK", 7)
    run = ids_for(30, seed=9)
    t = 23
    hidden = model(Batch.single(run[:t]), model.make_caches(1), hidden="all")[1][0]
    resumed, observed = mtp(), mtp()
    resumed.resume(run[:t], hidden)
    observed.observe(0, run[:t], hidden)
    assert (resumed.start, resumed.fed, resumed.known) == (observed.start, observed.fed, observed.known)
    for ours, theirs in zip(resumed.cache.rows(0, t - 1), observed.cache.rows(0, t - 1), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    greedy = TargetPolicy()
    assert resumed.propose(run[: t + 1], 4, greedy).tokens == observed.propose(run[: t + 1], 4, greedy).tokens


class ProposalRecorder(MTPDrafter):
    """The MTP drafter as served, remembering each proposal: (run length, drafts, the absolute
    position where the head's context starts)."""

    def __init__(self, mtp: MTP):
        super().__init__(mtp.target, mtp.head)
        self.proposals: list[tuple[int, list[int], int]] = []

    def propose(self, tokens, k, policy):
        draft = super().propose(tokens, k, policy)
        self.proposals.append((len(tokens), list(draft.tokens), self.start))
        return draft


def serve_recording(model, mtp: MTP, prompts, params, prefix: PrefixCache | None):
    """Greedy requests through one engine; returns (results, each request's `ProposalRecorder`)."""
    drafters: list[ProposalRecorder] = []

    def make():
        drafters.append(ProposalRecorder(mtp))
        return drafters[-1]

    with Engine(model, None, prefix=prefix, speculative=speculator(make)) as engine:
        return [engine.generate(ids, params) for ids in prompts], drafters


@pytest.mark.parametrize("name", NAMES)
def test_after_a_prefix_cache_hit_the_head_drafts_what_it_drafts_without_one(heads, name):
    """A follow-up extending a cached conversation, one diverging inside it and a regenerate are
    served partly from the trie, whose nodes hold the target's hidden states: the head rebuilds its
    context from them (it starts at position 0), so every proposal equals the one made without a
    prefix cache; output is plain greedy and the target's reuse is what it is without speculation."""
    model, mtp, _ = heads(name)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = ids_for(37, seed=5)
    first = generate(model, None, prompt, greedy).token_ids
    prompts = [prompt, prompt + first + ids_for(9, seed=6), prompt[:30] + ids_for(12, seed=7), prompt]
    got, cached = serve_recording(model, mtp, prompts, greedy, PrefixCache(model))
    reference, fresh = serve_recording(model, mtp, prompts, greedy, None)
    with Engine(model, None, prefix=PrefixCache(model)) as engine:
        plain_reuse = [engine.generate(ids, greedy).usage.cached_tokens for ids in prompts]
    assert [r.usage.cached_tokens for r in got] == plain_reuse
    assert all(reuse >= 30 for reuse in plain_reuse[1:])
    for ids, a, b, ours, theirs in zip(prompts, got, reference, cached, fresh, strict=True):
        same_output(a, generate(model, None, ids, greedy))
        same_output(a, b)
        assert ours.proposals and all(start == 0 for _, _, start in ours.proposals)
        assert [p[:2] for p in ours.proposals] == [p[:2] for p in theirs.proposals]


def test_stop_rules_inside_drafts_match_plain_decoding(demo_mtp):
    tok = demo_mtp.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count: one two three one two"}]))
    base = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = generate(demo_mtp.lm, tok, ids, base)
    truth = plain.token_ids
    mtp = MTP.load(demo_mtp.path, demo_mtp.lm)
    make = lambda: RecordingMTPDrafter(mtp, ids, truth, wrong=0.0)  # noqa: E731
    stop = plain.text[len(plain.text) // 2 :][:3]
    eos = next(t for i, t in enumerate(truth) if i >= 12 and t not in truth[:i])  # the EOS id below
    stops = [
        SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop_token_ids=[truth[30]]),
        SamplingParams(temperature=0.0, max_tokens=48),
    ]
    for params in stops:
        results = []
        for speculative in (None, speculator(make)):
            with Engine(demo_mtp.lm, tok, speculative=speculative) as engine:
                engine.eos_token_ids = frozenset({eos})
                results.append(engine.generate(ids, params))
        expected, got = results
        same_output(got, expected)
        assert got.usage.speculative.accepted_tokens >= 0.5 * len(got.token_ids)
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == eos


def test_seeded_sampling_with_mtp_is_reproducible(demo_mtp):
    tok = demo_mtp.tokenizer
    ids = tok.encode("def add(a, b):")
    params = SamplingParams(temperature=0.8, seed=42, max_tokens=24, ignore_eos=True)
    with Engine(demo_mtp.lm, tok, speculative=speculator(MTP.load(demo_mtp.path, demo_mtp.lm))) as engine:
        a, b = engine.generate(ids, params), engine.generate(ids, params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert a.usage.speculative.verify_passes > 0


def test_missing_heads_are_refused_clearly(checkpoints, models, demo_mtp, tmp_path):
    plain = checkpoints("qwen3_5_text")
    with pytest.raises(CheckpointError, match=re.escape(f"{plain.path}: no mtp.* tensors")):
        MTP.load(plain.path, models("qwen3_5_text"))
    lfm2 = checkpoints("lfm2")
    with pytest.raises(CheckpointError, match="'lfm2' has no multi-token-prediction head"):
        MTP.load(lfm2.path, models("lfm2"))

    from hybridlm.settings import Settings, make_speculator

    args = Settings.parse(["--speculative", "mtp", "--num-draft", "3"])
    speculator = make_speculator(demo_mtp, args)
    assert speculator.controller.max_depth == 3 and isinstance(speculator.make_drafter(), MTPDrafter)
    no_head = write_demo_model(tmp_path / "no-head")
    with pytest.raises(SystemExit, match=re.escape(f"--speculative mtp: {no_head}: no mtp.* tensors")):
        make_speculator(hybridlm.load_model(no_head, dtype=torch.float32), args)


def test_a_head_missing_a_tensor_names_it(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoints("qwen3_5_text_mtp").path
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    state = load_file(broken / "model.safetensors")
    del state["mtp.layers.0.self_attn.k_norm.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    model = load_model(broken, dtype=torch.float32, device="cpu")  # the target does not need the head
    with pytest.raises(CheckpointError, match="missing tensor 'mtp.layers.0.self_attn.k_norm.weight'"):
        MTP.load(broken, model)
