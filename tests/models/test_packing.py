"""Packed forwards (`forward_packed`) for every family: the rows of several sequences in one forward,
each segment's logits bit for bit those of that segment's own forward alone."""

from __future__ import annotations

import random
import types
from contextlib import nullcontext

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.models.base import forward_packed
from hybridlm.ops import attention as attention_mod
from hybridlm.ops import conv as conv_mod
from hybridlm.ops import gated_delta as gated_delta_mod
from hybridlm.ops import mamba2 as mamba2_mod
from hybridlm.ops.linear import rowwise
from hybridlm.ops.native import FEW_TOKENS

# One checkpoint per family, and every Gemma 4 variant (per-layer inputs and KV-shared layers; k = v
# without per-layer inputs; MoE beside the MLP; the multimodal layout's text model).
PACKING = [
    "qwen3_5_text",
    "qwen3_next",
    "qwen3_5_moe_text",
    "lfm2",
    "lfm2_moe",
    "gemma3_text",
    "gemma4_text",
    "gemma4_text_tied",
    "gemma4_moe",
    "gemma4_vl",
    "dense_qwen3",
    "dense_llama",
    "kimi_linear",
    "bailing_hybrid",
    "bamba",
    "granitemoehybrid_moe",
    "nemotron_h",
    "falcon_h1",
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

# A step with segments longer than FEW_TOKENS (prefill-chunk sized) beside decode rows: they run their
# mixers one by one while the decode rows share the packed kernels (`layers.per_segment`).
MIXED_STEP = [(1, 1, "last"), (0, 30, "last"), (3, 1, "last"), (2, 18, "all")]
# The families whose mixers have packed kernels (`Attention`, `GatedDeltaNet`, LFM2's `ShortConv`,
# `Mamba2Mixer`).
PACKED_MIXERS = [
    "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "gemma3_text", "dense_llama",
    "bamba", "nemotron_h", "falcon_h1",
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
    check_steps(checkpoints, name, dtype, STEPS)


@pytest.mark.parametrize("name", PACKED_MIXERS)
def test_long_segments_beside_decode_rows_equal_their_own_forwards_bitwise(checkpoints, name):
    """Segments of 30 and 18 rows packed between decode rows (the long ones take the one-by-one path
    inside the packed forward, the decode rows the packed kernels) equal their own forwards bit for
    bit; the long ones alone run under `rowwise()`, as packed rows do (the engine never packs a
    prefill chunk: it runs alone)."""
    check_steps(checkpoints, name, torch.bfloat16, [MIXED_STEP, STEPS[-1]])


@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2", "nemotron_h"])
def test_without_packed_kernels_the_segments_run_one_by_one_bitwise(checkpoints, name, monkeypatch):
    """Where a packed kernel does not apply (here: none built), the decode / verify segments the layer
    already took from their caches run one by one from those histories, with the same bits."""
    unbuilt = types.SimpleNamespace(get=lambda: None)
    monkeypatch.setattr(attention_mod, "PACKED_KERNEL", unbuilt)
    monkeypatch.setattr(conv_mod, "CONV_PACKED_KERNEL", unbuilt)
    monkeypatch.setattr(gated_delta_mod, "GDN_PACKED_KERNEL", unbuilt)
    monkeypatch.setattr(mamba2_mod, "PACKED_KERNEL", unbuilt)
    check_steps(checkpoints, name, torch.bfloat16, STEPS)


@pytest.mark.parametrize("name", ["bamba", "nemotron_h"])
def test_mamba2_decode_segments_take_one_packed_step_call_per_layer(checkpoints, name, monkeypatch):
    """The Mamba-2 layers step a packed forward's decode and verify segments in one kernel call each
    (the equality tests above would also pass one by one)."""
    kernel, calls = mamba2_mod.PACKED_KERNEL, []

    def counted():
        fn = kernel.get()
        return None if fn is None else (lambda *args: calls.append(args[12]) or fn(*args))

    monkeypatch.setattr(mamba2_mod, "PACKED_KERNEL", types.SimpleNamespace(get=counted))
    check_steps(checkpoints, name, torch.bfloat16, STEPS[:1])
    model = load_model(checkpoints(name).path, device="cpu")
    layers = sum(type(m).__name__ == "Mamba2Mixer" for m in model.modules())
    assert layers and calls == [len(STEPS[0])] * layers  # args[12]: the sequences of the call


def check_steps(checkpoints, name, dtype, steps):
    model = load_model(checkpoints(name).path, dtype=dtype, device="cpu")
    assert model.packs
    rng = random.Random(7)
    prompts = [tokens(rng, n) for n in PROMPTS]
    alone = [model.make_caches(1) for _ in prompts]
    packed = [model.make_caches(1) for _ in prompts]
    offsets = list(PROMPTS)
    for ids, a, p in zip(prompts, alone, packed, strict=True):
        model(Batch.single(ids), a)
        model(Batch.single(ids), p)
    for step in steps:
        pieces = [(i, tokens(rng, n), rows) for i, n, rows in step]
        segments = [Batch.single(ids, offset=offsets[i]) for i, ids, _ in pieces]
        got = forward_packed(model, segments, [packed[i] for i, _, _ in pieces], [r for _, _, r in pieces])
        for (i, ids, rows), g in zip(pieces, got, strict=True):
            plain = dtype == torch.bfloat16 and len(ids) <= FEW_TOKENS
            with nullcontext() if plain else rowwise():
                want = model(Batch.single(ids, offset=offsets[i]), alone[i], logits=rows)
            want = want if rows == "last" else want[0]
            assert g.shape == want.shape and g.dtype == want.dtype
            assert not g.requires_grad  # a step records no graph: the C kernels refuse inputs needing one
            assert g.equal(want), f"sequence {i} at offset {offsets[i]}: {(g - want).abs().max():.3e}"
            offsets[i] += len(ids)
