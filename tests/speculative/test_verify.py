"""Greedy speculative decoding equals plain greedy decoding token for token on every family and
drafter, and after any accept / reject / stop pattern every cache (target and draft) equals a plain
run over the committed tokens (issue 5, acceptance 1 and 3)."""

from __future__ import annotations

import random

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.speculative import DraftModel, NgramDrafter, TargetPolicy, verify_and_commit
from tests.speculative.helpers import (
    OracleDrafter,
    ids_for,
    plain_greedy,
    speculative_greedy,
)

FAMILIES = [
    "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "gemma3_text", "dense_llama",
    "dense_qwen3", "kimi_linear", "bailing_hybrid",
]
# A draft model of another family with the same vocabulary: its caches are of other kinds.
OTHER_DRAFT = {
    "qwen3_5_text": "lfm2",
    "qwen3_next": "gemma3_text",
    "lfm2": "qwen3_5_text_tied",
    "gemma3_text": "qwen3_next",
    "dense_llama": "qwen3_5_text",
    "dense_qwen3": "lfm2",
    "qwen3_5_moe_text": "lfm2_moe",
    "lfm2_moe": "qwen3_5_moe_text",
    "kimi_linear": "qwen3_5_text",
    "bailing_hybrid": "lfm2",
}
PROMPT_LENGTHS = (4, 21, 45)  # the sliding layers (window 16) wrap in the prompt or while decoding
GENERATE = 40


def drafters(kind: str, name: str, models, prompt: list[int], truth: list[int]):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "draft-other":
        return DraftModel(models(OTHER_DRAFT[name]))()
    if kind == "draft-self-int8":  # mostly right, sometimes not: long accepted runs and rejections
        return DraftModel(models(name, int8=True))()
    return OracleDrafter(prompt, truth, wrong=0.25, seed=len(prompt))


@pytest.mark.parametrize("kind", ["ngram", "draft-other", "draft-self-int8", "oracle"])
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_plain_greedy(models, name, kind):
    model = models(name)
    for length in PROMPT_LENGTHS:
        prompt = ids_for(length, seed=length)
        expected = plain_greedy(model, prompt, GENERATE)
        drafter = drafters(kind, name, models, prompt, expected)
        assert speculative_greedy(model, prompt, GENERATE, drafter, seed=length) == expected, length


def test_repetitive_run_is_drafted_right_by_ngram():
    drafter = NgramDrafter()
    run = [5, 6, 7, 8, 9, 6, 7]
    assert drafter.propose(run, 3, TargetPolicy()).tokens == [8, 9, 6]  # trigram 6 7 → 8 …
    assert drafter.propose(run + [1], 3, TargetPolicy()).tokens == []  # 1 never occurred before
    assert drafter.propose([3, 3, 3], 4, TargetPolicy()).tokens == [3, 3, 3, 3]  # continued periodically
    assert NgramDrafter().propose([1, 2, 9, 2], 2, TargetPolicy()).tokens == [9, 2]  # unigram fallback


class Spy:
    """The target model, remembering the logits of its last forward."""

    def __init__(self, model):
        self.model, self.device, self.logits = model, model.device, None

    def __call__(self, batch, caches, logits="last"):
        self.logits = self.model(batch, caches, logits=logits)
        return self.logits


@pytest.mark.parametrize("name", FAMILIES)
def test_every_cache_equals_a_plain_run_after_random_patterns(models, name):
    """Rounds of random length with wrong drafts at random places and stops at random emitted
    tokens (a stopped token is not committed: the next round feeds it). Every verify forward sees
    the logits of recomputing the committed run from scratch; at the end a draft model's caches,
    rolled back and caught up after rounds it sometimes sat out, give its recomputed distributions."""
    model = models(name)
    spy = Spy(model)
    draft_model = models(OTHER_DRAFT[name])
    drafter = DraftModel(draft_model)()
    rng = random.Random(7)
    prompt = ids_for(19, seed=11)
    truth = plain_greedy(model, prompt, 60)
    oracle = OracleDrafter(prompt, truth, wrong=0.3, seed=3)
    caches = model.make_caches(1)
    model(Batch.single(prompt[:-1]), caches)
    run = list(prompt)  # prompt + emitted; the last token is not in the caches yet
    while len(run) < len(prompt) + 40:
        k = rng.randint(1, 7)
        stop_at = rng.randrange(k + 2) if rng.random() < 0.3 else None
        draft = oracle.propose(run, k, TargetPolicy())
        if rng.random() < 0.5:  # the draft model follows only some rounds, as when backed off
            drafter.propose(run, k, TargetPolicy())
        emitted = []

        def emit(token, logits, emitted=emitted, stop_at=stop_at):
            emitted.append(token)
            return len(emitted) - 1 == stop_at

        offset = len(run) - 1
        result = verify_and_commit(spy, caches, run[-1], draft, offset, emit=emit)
        expected = model(Batch.single(run + draft.tokens), model.make_caches(1), logits="all")[0]
        torch.testing.assert_close(spy.logits[0], expected[offset:], rtol=0, atol=2e-5)
        assert result.tokens == truth[len(run) - len(prompt) :][: len(result.tokens)]
        assert result.stopped == (stop_at is not None and stop_at < len(result.tokens))
        run += result.tokens
        assert result.offset == len(run) - 1 == offset + len(result.committed)
        assert all(c.offset == result.offset for c in caches if c is not None)

    g = torch.Generator().manual_seed(0)
    draft = drafter.propose(run, 3, TargetPolicy(temperature=1.0, generator=g))
    ref = draft_model(Batch.single(run + draft.tokens[:2]), draft_model.make_caches(1), logits="all")[0, -3:]
    torch.testing.assert_close(draft.probs, ref.softmax(-1), rtol=0, atol=1e-5)
    drafter.close()
