"""In bf16 on the CPU a verify pass computes every position bit for bit as a one-token decode step
does (the per-token kernels take up to FEW_TOKENS tokens and compute each token as alone), so
speculative greedy output equals plain greedy output in bf16 too, not only in float32."""

from __future__ import annotations

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.ops.linear import kernel_rows
from hybridlm.speculative import NgramDrafter
from tests.speculative.helpers import ids_for, plain_greedy, speculative_greedy

FAMILIES = ["qwen3_5_text", "qwen3_next", "lfm2", "gemma3_text", "gemma4_text", "dense_llama", "bamba",
            "nemotron_h", "granitemoehybrid_moe", "falcon_h1"]

needs_kernels = pytest.mark.skipif(kernel_rows() == 0, reason="the CPU kernels could not be built")


@needs_kernels
@pytest.mark.parametrize("name", FAMILIES)
def test_a_verify_pass_computes_each_position_as_decode_does(checkpoints, name):
    model = load_model(checkpoints(name).path, dtype=torch.bfloat16, device="cpu")
    prompt, more = ids_for(30, seed=1), ids_for(kernel_rows(), seed=2)
    stepped, passed = model.make_caches(1), model.make_caches(1)
    model(Batch.single(prompt), stepped)
    model(Batch.single(prompt), passed)
    steps = torch.cat([model(Batch.single([t], offset=len(prompt) + i), stepped) for i, t in enumerate(more)])
    together = model(Batch.single(more, offset=len(prompt)), passed, logits="all")[0]
    assert torch.equal(steps, together)


@needs_kernels
@pytest.mark.parametrize("name", ["qwen3_5_text", "gemma3_text", "bamba"])
def test_bf16_speculative_greedy_equals_plain_greedy(checkpoints, name):
    model = load_model(checkpoints(name).path, dtype=torch.bfloat16, device="cpu")
    prompt = ids_for(21, seed=3)
    truth = plain_greedy(model, prompt, 30)
    # prompt + truth as the prompt: prompt lookup then drafts long runs that are right
    seeded = prompt + truth + prompt
    expected = plain_greedy(model, seeded, 30)
    assert speculative_greedy(model, seeded, 30, NgramDrafter()) == expected
