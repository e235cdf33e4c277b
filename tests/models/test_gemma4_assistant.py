"""The Gemma 4 assistant drafter against transformers' Gemma4AssistantForCausalLM: the draft
steps of a round, fed as transformers' assisted generation feeds them, from our target's caches."""

from __future__ import annotations

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.models.gemma4_assistant import load_assistant, target_kv
from tests.models.test_families import assert_close_to_scale, ids_for
from tests.oracles.gemma4 import allow_all_shared_layers, assistant_pair

PROMPT = 40  # wraps the sliding window (8) five times
STEPS = 3


@pytest.fixture(scope="module", params=[False, True], ids=["plain_head", "ordered_head"])
def pair(request, tmp_path_factory):
    return assistant_pair(tmp_path_factory.mktemp("assistant"), ordered=request.param)


def reference_drafts(target_ckpt, assistant_ckpt, ids: list[int]) -> list[torch.Tensor]:
    """transformers' draft logits [V] for `STEPS` steps after the target has read `ids` (as
    SinglePositionMultiTokenCandidateGenerator runs them right after the prefill)."""
    allow_all_shared_layers()
    target = target_ckpt.reference(torch.float32)
    assistant = assistant_ckpt.hf_class.from_pretrained(assistant_ckpt.path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = target(torch.tensor([ids]), return_shared_kv_states=True, output_hidden_states=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        hidden = out.hidden_states[-1][:, -1:]
        position = torch.tensor([[len(ids)]])
        drafts = []
        for _ in range(STEPS):
            embeds = torch.cat([target.get_input_embeddings()(token), hidden], dim=-1)
            kv = out.shared_kv_states
            step = assistant(inputs_embeds=embeds, position_ids=position, shared_kv_states=kv)
            drafts.append(step.logits[0, 0])
            token, hidden = step.logits.argmax(-1), step.last_hidden_state
    return drafts


def prompt_end_caches(target, ids: list[int], how: str):
    """Caches holding `ids[:PROMPT]` and the final hidden state at PROMPT - 1: the target reads the
    prompt and 5 more tokens (as a verify pass would) in chunks, then every cache is rewound to the
    prompt's end ("rewind"), or fresh caches are restored from compacted snapshots of those
    (the point checkpoints the prefix cache keeps: sliding layers hold only what their window needs)."""
    caches = target.make_caches(1)
    hidden = []
    for start in range(0, len(ids), 7):
        piece = ids[start : start + 7]
        hidden.append(target.hidden_states(Batch.single(piece, offset=start), caches)[0])
    for cache in caches:
        assert cache is None or cache.restore(None, PROMPT)
    if how == "restored":
        fresh = target.make_caches(1)
        for cache, new in zip(caches, fresh, strict=True):
            if cache is not None:
                assert new.restore(cache.compact(cache.snapshot(0)), PROMPT)
        caches = fresh
    return caches, torch.cat(hidden)[PROMPT - 1 : PROMPT]


@pytest.mark.parametrize("how", ["rewind", "restored"])
def test_draft_logits_match_transformers(pair, how):
    """The assistant drafts from our target's caches at the prompt's end: each step's logits are
    transformers' (whose target only ever read the prompt)."""
    target_ckpt, assistant_ckpt = pair
    ids = ids_for(PROMPT + 5, seed=7)
    expected = reference_drafts(target_ckpt, assistant_ckpt, ids[:PROMPT])

    target = load_model(target_ckpt.path, dtype=torch.float32, device="cpu")
    assistant = load_assistant(assistant_ckpt.path, dtype=torch.float32, device="cpu")
    assistant.check_target(target)
    caches, h = prompt_end_caches(target, ids, how)
    token = target.head(h).argmax(-1)
    kv = target_kv(target, caches, PROMPT)
    for want in expected:
        logits, h = assistant(target.embed_ids(token), h, PROMPT, kv)
        assert_close_to_scale(logits[0], want, 1e-4)
        token = logits.argmax(-1)


def test_drafting_needs_a_target_that_shares_keys_and_values(pair, checkpoints):
    _, assistant_ckpt = pair
    unshared = load_model(checkpoints("gemma4_text_tied").path, dtype=torch.float32, device="cpu")
    assistant = load_assistant(assistant_ckpt.path, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        target_kv(unshared, unshared.make_caches(1), 1)
    with pytest.raises(ValueError, match="num_kv_shared_layers"):
        assistant.check_target(unshared)
