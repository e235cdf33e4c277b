"""Packed forwards (`forward_packed`) for every family: the rows of several sequences in one forward,
each segment's logits bit for bit those of that segment's own forward alone."""

from __future__ import annotations

import random
from contextlib import nullcontext

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.models.base import forward_packed
from hybridlm.ops.linear import rowwise

# One checkpoint per family, and every Gemma 4 variant (per-layer inputs and KV-shared layers; k = v
# without per-layer inputs; MoE beside the MLP; the multimodal layout's text model).
PACKING = [
    "qwen3_5_text",
    "qwen3_next",
    "lfm2",
    "gemma3_text",
    "gemma4_text",
    "gemma4_text_tied",
    "gemma4_moe",
    "gemma4_vl",
    "dense_qwen3",
    "dense_llama",
]

# Prompt lengths: the longest runs past the Gemma sliding windows (12 and 16 tokens).
PROMPTS = [3, 21, 9, 34]
# Per step, (sequence, tokens, rows) in packing order; a sequence may sit a step out. Multi-row
# segments are what a speculative verify pass feeds (its current token and the drafts).
STEPS = [
    [(0, 1, "last"), (1, 5, "all"), (2, 1, "last"), (3, 17, "all")],
    [(3, 1, "last"), (0, 4, "all"), (1, 1, "last")],
    [(2, 7, "last"), (1, 1, "last"), (3, 2, "all"), (0, 1, "last")],
    [(0, 1, "last"), (1, 1, "last"), (2, 1, "last"), (3, 1, "last")],
]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", PACKING)
def test_each_packed_segment_equals_its_own_forward_bitwise(checkpoints, name, dtype):
    """Decode rows and multi-row segments of four sequences at their own offsets, packed in varying
    order and number over several steps: each segment's logits ("last" or "all") equal, bit for bit,
    those of the same segment run alone on that sequence's caches.

    bf16: the alone forward is the plain one (the per-token kernels compute up to FEW_TOKENS rows
    each as alone). float32 linears take MKL's GEMM, whose rounding depends on the row count, so
    there the alone forward runs under `rowwise()` too (each row as a one-row call)."""
    model = load_model(checkpoints(name).path, dtype=dtype, device="cpu")
    assert model.packs
    alone_ctx = rowwise if dtype == torch.float32 else nullcontext
    rng = random.Random(7)
    prompts = [tokens(rng, n) for n in PROMPTS]
    alone = [model.make_caches(1) for _ in prompts]
    packed = [model.make_caches(1) for _ in prompts]
    offsets = list(PROMPTS)
    for ids, a, p in zip(prompts, alone, packed, strict=True):
        model(Batch.single(ids), a)
        model(Batch.single(ids), p)
    for step in STEPS:
        pieces = [(i, tokens(rng, n), rows) for i, n, rows in step]
        segments = [Batch.single(ids, offset=offsets[i]) for i, ids, _ in pieces]
        got = forward_packed(model, segments, [packed[i] for i, _, _ in pieces], [r for _, _, r in pieces])
        for (i, ids, rows), g in zip(pieces, got, strict=True):
            with alone_ctx():
                want = model(Batch.single(ids, offset=offsets[i]), alone[i], logits=rows)
            want = want if rows == "last" else want[0]
            assert g.shape == want.shape and g.dtype == want.dtype
            assert g.equal(want), f"sequence {i} at offset {offsets[i]}: {(g - want).abs().max():.3e}"
            offsets[i] += len(ids)
