"""The Gemma 4 assistant as a drafter (speculative/assistant.py): every proposal's draft logits are
transformers' assistant's, fed from a plain run of the committed tokens, whatever accept / reject
patterns, plain steps and prefix-cache restores the target's caches went through; assisted greedy
decoding equals plain greedy decoding (several prompt lengths, across the sliding window's wrap,
with and without prefix-cache hits, stop strings / stop ids / EOS / max_tokens inside drafts) and
transformers' `generate(assistant_model=...)`; afterwards the target's caches equal a plain run's;
sampled drafts carry the assistant's distributions and speculative sampling keeps the target's;
the server reports its rounds; the CLI refuses an assistant for a target it cannot draft for,
naming why."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

import hybridlm
from hybridlm.batch import Batch
from hybridlm.demo import write_demo_model
from hybridlm.engine import Engine, SamplingParams
from hybridlm.models import load_model
from hybridlm.models.gemma4 import Gemma4
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.server.app import create_app
from hybridlm.speculative import (
    Assistant,
    AssistantDrafter,
    TargetPolicy,
    verify_and_commit,
)
from tests.models.test_families import assert_close_to_scale
from tests.oracles.common import VOCAB
from tests.oracles.gemma4 import allow_all_shared_layers, assistant_pair
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
from tests.speculative.test_sampling import chi_square_p

GENERATE = 40
WINDOW = 8  # the target's sliding window (tests/oracles/gemma4.py): every prompt below but one wraps it


@dataclass
class Pair:
    """A target, its assistant as a drafter factory, transformers' (target, assistant) for the same
    checkpoints (float32), and the assistant's checkpoint directory."""

    target: Gemma4
    assistant: Assistant
    hf: tuple
    path: Path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """`Pair`s by head kind (`ordered`: the ordered-embedding head, else a plain tied head) and
    vocabulary size."""
    made = {}

    def get(ordered: bool = False, vocab: int = VOCAB) -> Pair:
        if (ordered, vocab) not in made:
            out = tmp_path_factory.mktemp("assistant")
            target_ckpt, assistant_ckpt = assistant_pair(out, ordered, vocab)
            target = load_model(target_ckpt.path, dtype=torch.float32, device="cpu")
            allow_all_shared_layers()
            hf_assistant = assistant_ckpt.reference(torch.float32)
            hf_assistant.generation_config.num_assistant_tokens = 4
            hf = (target_ckpt.reference(torch.float32), hf_assistant)
            assistant = Assistant.load(assistant_ckpt.path, target)
            made[ordered, vocab] = Pair(target, assistant, hf, assistant_ckpt.path)
        return made[ordered, vocab]

    return get


class StepRecorder:
    """Wraps the assistant model, keeping every draft step's logits [V]."""

    def __init__(self, model):
        self.model = model
        self.logits: list[torch.Tensor] = []

    def __call__(self, embeds, hidden, position, kv):
        logits, state = self.model(embeds, hidden, position, kv)
        self.logits.append(logits[0].clone())
        return logits, state


class RecordingAssistantDrafter(AssistantDrafter):
    """The assistant drafter as served, remembering each proposal (the run, its own drafts and their
    logits); with `truth`, its drafts are then replaced by the known continuation (each token wrong
    with probability `wrong`), so that a random assistant, whose drafts are almost never accepted,
    still sees accepted runs."""

    def __init__(self, assistant: Assistant, prompt=None, truth=None, wrong: float = 0.3, seed: int = 0):
        super().__init__(assistant.target, StepRecorder(assistant.model))
        self.proposals: list[tuple[list[int], list[int], torch.Tensor]] = []
        self.oracle = None
        if truth is not None:
            self.oracle = OracleDrafter(prompt, truth, wrong, seed, assistant.target.vocab_size)

    def propose(self, tokens, k, policy):
        self.model.logits.clear()
        draft = super().propose(tokens, k, policy)
        self.proposals.append((list(tokens), draft.tokens, torch.stack(self.model.logits)))
        return draft if self.oracle is None else self.oracle.propose(tokens, len(draft), policy)


def transformers_drafts(hf, run: list[int], fed: list[int]) -> torch.Tensor:
    """transformers' assistant logits [len(fed) + 1, V] for the draft steps after the target read
    `run[:-1]`: the first step fed `run[-1]`, the next ones the tokens `fed` (as its
    SinglePositionMultiTokenCandidateGenerator runs them)."""
    target, assistant = hf
    with torch.no_grad():
        out = target(torch.tensor([run[:-1]]), return_shared_kv_states=True, output_hidden_states=True)
        hidden = out.hidden_states[-1][:, -1:]
        at = dict(position_ids=torch.tensor([[len(run) - 1]]), shared_kv_states=out.shared_kv_states)
        logits = []
        for token in [run[-1], *fed]:
            embeds = torch.cat([target.get_input_embeddings()(torch.tensor([[token]])), hidden], dim=-1)
            step = assistant(inputs_embeds=embeds, **at)
            logits.append(step.logits[0, 0])
            hidden = step.last_hidden_state
    return torch.stack(logits)


def assert_drafts_are_transformers(hf, proposals) -> None:
    """Each recorded proposal's step logits equal transformers' from a plain run of its run."""
    for run, tokens, logits in proposals:
        expected = transformers_drafts(hf, run, tokens[:-1])
        for got, want in zip(logits, expected, strict=True):
            assert_close_to_scale(got, want, 1e-4)


@pytest.mark.parametrize("truth", [False, True], ids=["own-drafts", "truth-drafts"])
def test_greedy_equals_plain_and_drafts_and_caches_equal_a_plain_runs(pairs, truth):
    """Assisted greedy = plain greedy for prompts shorter and longer than the window (and a restored
    prefix); every proposal's draft logits are transformers' from a plain run of its run, so the
    target's caches the assistant read after each accept / reject / plain step were a plain run's;
    at the end the target's caches give a plain run's next logits."""
    p = pairs()
    model, assistant, hf = p.target, p.assistant, p.hf
    for length, start in [(4, 0), (21, 0), (45, 0), (45, 30)]:
        prompt = ids_for(length, seed=length)
        expected = plain_greedy(model, prompt, GENERATE)
        drafter = RecordingAssistantDrafter(assistant, prompt, expected if truth else None, seed=length)
        out, caches = hidden_greedy(model, prompt, GENERATE, drafter, seed=length, start=start)
        assert out == expected, (length, start)
        assert len(drafter.proposals) >= 5
        assert_drafts_are_transformers(hf, drafter.proposals[::2])

        run = prompt + out
        logits = model(Batch.single([run[-1]], offset=len(run) - 1), caches)
        torch.testing.assert_close(logits, model(Batch.single(run), model.make_caches(1)), rtol=0, atol=1e-4)
        drafter.close()


@pytest.mark.parametrize("ordered", [False, True], ids=["plain_head", "ordered_head"])
def test_engine_output_equals_transformers_assisted_generation(pairs, ordered):
    """Through the engine, greedy decoding with the assistant drafting equals transformers'
    `generate(assistant_model=...)` (itself plain greedy) and our plain decoding."""
    p = pairs(ordered)
    model, assistant, (hf_target, hf_assistant) = p.target, p.assistant, p.hf
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    for length in (3, 30):
        prompt = ids_for(length, seed=40 + length)
        with torch.no_grad():
            ids = torch.tensor([prompt])
            kw = dict(do_sample=False, max_new_tokens=24, min_new_tokens=24)
            assisted = hf_target.generate(ids, assistant_model=hf_assistant, **kw)[0, length:].tolist()
            plain = hf_target.generate(ids, **kw)[0, length:].tolist()
        assert assisted == plain
        with Engine(model, None, speculative=speculator(assistant, 4)) as engine:
            got = engine.generate(prompt, greedy)
        assert got.token_ids == assisted
        assert got.usage.speculative.verify_passes > 0
        assert generate(model, None, prompt, greedy).token_ids == assisted


def test_engine_with_prefix_cache_hits_matches_plain_decoding(pairs):
    """Through the engine with a prefix cache: a first request, then one extending it and one
    diverging inside it (both restored partly from the cache, sliding rows included) decode exactly
    as without speculation, and the assistant's drafts after a restore are transformers'."""
    p = pairs()
    model, assistant, hf = p.target, p.assistant, p.hf
    record = lambda ids, truth, i: RecordingAssistantDrafter(assistant, ids, truth, wrong=0.3, seed=i)  # noqa: E731
    prompts, truths, results, drafters = prefix_hit_scenario(model, record)
    for got, truth, drafter in zip(results, truths, drafters, strict=True):
        assert got.token_ids == truth
        assert got.usage.speculative.accepted_tokens > 0
        assert_drafts_are_transformers(hf, drafter.proposals[:3])
    assert results[1].usage.cached_tokens >= len(prompts[1]) - 9 - 1
    assert results[2].usage.cached_tokens >= 30 > WINDOW
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    untouched = generate(model, None, prompts[1], greedy, speculative=speculator(assistant))
    assert untouched.token_ids == truths[1] and untouched.usage.speculative.verify_passes > 0


def test_stop_rules_inside_drafts_match_plain_decoding(pairs, tmp_path):
    """Stop strings, stop ids, EOS and max_tokens falling inside accepted drafts end the output
    exactly where plain decoding does (the demo tokenizer gives the ids text)."""
    p = pairs()
    model, assistant = p.target, p.assistant
    tok = Tokenizer.from_dir(write_demo_model(tmp_path / "demo"))
    ids = ids_for(20, seed=11)
    base = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = generate(model, tok, ids, base)
    truth = plain.token_ids
    make = lambda: RecordingAssistantDrafter(assistant, ids, truth, wrong=0.0)  # noqa: E731
    stop = plain.text[len(plain.text) // 2 :][:3]
    eos = next(t for i, t in enumerate(truth) if i >= 12 and t not in truth[:i])
    stops = [
        SamplingParams(temperature=0.0, max_tokens=29, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop_token_ids=[truth[30]]),
        SamplingParams(temperature=0.0, max_tokens=48),
    ]
    for params in stops:
        results = []
        for speculative in (None, speculator(make)):
            with Engine(model, tok, speculative=speculative) as engine:
                engine.eos_token_ids = frozenset({eos})
                results.append(engine.generate(ids, params))
        expected, got = results
        same_output(got, expected)
        assert got.usage.speculative.accepted_tokens >= 0.5 * len(got.token_ids)
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == eos


def test_sampled_drafts_carry_the_assistants_distributions(pairs):
    """Under a sampling policy each draft row q is transformers' assistant distribution (temperature
    and top-k applied) at that step, fed the tokens drawn before it."""
    p = pairs(ordered=True)
    model, assistant, hf = p.target, p.assistant, p.hf
    prompt = ids_for(30, seed=3)
    drafter = assistant()
    caches, logits = hidden_prefill(model, prompt, drafter)
    run = prompt + [int(logits.argmax())]
    policy = TargetPolicy(temperature=0.7, top_k=40, generator=torch.Generator().manual_seed(0))
    draft = drafter.propose(run, 4, policy)
    expected = policy.probs(transformers_drafts(hf, run, draft.tokens[:-1]))
    torch.testing.assert_close(draft.probs, expected, rtol=0, atol=1e-5)
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 3)])
def test_speculative_sampling_keeps_the_targets_distribution(pairs, temperature, top_k):
    """Over an 8-token vocabulary, where the assistant's and the target's distributions overlap:
    rounds of 2 sampled assistant drafts verified against the target emit (first, second) tokens
    with the target's joint distribution (chi-square, p > 0.01)."""
    vocab = 8
    p = pairs(vocab=vocab)
    model = p.target
    prompt = ids_for(12, seed=9, vocab=vocab)
    drafter = p.assistant()
    caches, logits = hidden_prefill(model, prompt, drafter)
    run = prompt + [int(logits.argmax())]
    policy = TargetPolicy(temperature, top_k, generator=torch.Generator().manual_seed(7))
    target = lambda ids: policy.probs(model(Batch.single(ids), model.make_caches(1))[0])  # noqa: E731
    first = target(run)
    second = torch.stack([target(run + [t]) for t in range(vocab)])  # [V, V]: row = first token
    counts = torch.zeros(vocab, vocab)
    for _ in range(700):
        draft = drafter.propose(run, 2, policy)
        out = verify_and_commit(model, caches, run[-1], draft, len(prompt), policy).tokens
        if len(out) == 1:  # the first draft was rejected: the second token is the target's own
            out.append(int(torch.multinomial(second[out[0]], 1, generator=policy.generator)))
        counts[out[0], out[1]] += 1
        for cache in caches:  # back to the prompt for the next round (the drafter was told nothing)
            assert cache is None or cache.restore(None, len(prompt))
    assert chi_square_p(counts.flatten(), (first[:, None] * second).flatten()) > 0.01


def test_server_reports_the_assistants_speculation(pairs):
    """`usage.speculative` and the /metrics counters count the assistant's rounds."""
    p = pairs()
    prompt = ids_for(20, seed=13)
    truth = generate(p.target, None, prompt, SamplingParams(temperature=0.0, max_tokens=24)).token_ids
    make = lambda: RecordingAssistantDrafter(p.assistant, prompt, truth)  # noqa: E731
    with Engine(p.target, None, speculative=speculator(make, 4)) as engine:
        client = TestClient(create_app(engine, "gemma4"))
        body = {"model": "gemma4", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        response = client.post("/v1/completions", json=body).json()
        metrics = client.get("/metrics").text
    spec = response["usage"]["speculative"]
    assert spec["verify_passes"] > 0 and 0 < spec["accepted_tokens"] <= spec["drafted_tokens"]
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert int(float(lines["hybridlm_speculative_verify_passes_total"])) == spec["verify_passes"]
    assert int(float(lines["hybridlm_speculative_accepted_tokens_total"])) == spec["accepted_tokens"]


def test_cli_serves_with_an_assistant_and_refuses_one_that_does_not_fit(pairs, checkpoints, tmp_path):
    from hybridlm.settings import Settings, make_speculator

    p = pairs()
    path = str(p.path)
    flags = ["--speculative", "draft", "--draft-model", path]
    args = Settings.parse(flags)
    served = SimpleNamespace(lm=p.target, path=tmp_path)
    assert isinstance(make_speculator(served, args).make_drafter(), AssistantDrafter)
    int8 = Settings.parse([*flags, "--draft-quantize", "int8"])
    assert make_speculator(served, int8).make_drafter().model.lm_head.qweight.dtype == torch.int8

    demo = hybridlm.load_model(write_demo_model(tmp_path / "demo"), dtype=torch.float32)
    with pytest.raises(SystemExit, match=re.escape(f"--draft-model {path}: a Gemma 4 assistant drafts only")):
        make_speculator(demo, args)
    unshared = load_model(checkpoints("gemma4_text_tied").path, dtype=torch.float32, device="cpu")
    unshared = SimpleNamespace(lm=unshared, path=tmp_path)
    with pytest.raises(SystemExit, match="num_kv_shared_layers = 0"):
        make_speculator(unshared, args)
