"""`ops.moe.combine`: the C kernel gives its definition's bits (`combine_reference`: index_add_ of the
weighted outputs in float32) at every ISA level, for bf16 and float32 routing weights."""

from __future__ import annotations

import pytest
import torch

from hybridlm.ops import moe
from hybridlm.ops.moe import combine, combine_reference

needs_kernel = pytest.mark.skipif(moe.COMBINE_KERNEL.get() is None, reason="moe kernel could not be built")


def routed(tokens: int, k: int, d: int, weights_dtype, seed: int):
    """Pairs as `dispatch` orders them (by expert: a token's pairs scattered over the call)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(tokens, k, generator=gen).to(weights_dtype)
    w_at = torch.randperm(tokens * k, generator=gen)
    ys = (4 * torch.randn(tokens * k, d, generator=gen)).bfloat16()
    return ys, weights, w_at, w_at // k


@needs_kernel
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "d"), [(1, 8, 1024), (3, 2, 40), (64, 5, 300)])
def test_combine_gives_the_bits_of_its_definition(isa, weights_dtype, tokens, k, d):
    ys, weights, w_at, rows = routed(tokens, k, d, weights_dtype, seed=tokens)
    want = combine_reference(ys, weights, w_at, rows, tokens)
    assert torch.equal(combine(ys, weights, w_at, rows, tokens), want)
    assert torch.equal(combine(ys, weights, w_at.tolist(), rows.tolist(), tokens), want)


@needs_kernel
def test_combine_adds_a_rows_pairs_in_their_order_rounding_each_bf16_product(isa):
    """The definition spelled out for one row: with bf16 weights each product is rounded to bf16,
    then the products are added in float32 from zero, in pair order, and the sum rounded once."""
    ys, weights, w_at, _ = routed(1, 6, 256, torch.bfloat16, seed=7)
    total = torch.zeros(256)
    for p, j in enumerate(w_at.tolist()):
        total = total + (ys[p] * weights[0, j]).float()
    assert torch.equal(combine(ys, weights, w_at, [0] * 6, 1)[0], total.bfloat16())


def test_the_reference_serves_float32_outputs():
    ys, weights, w_at, rows = routed(2, 3, 16, torch.float32, seed=1)
    ys = ys.float()
    want = torch.zeros(2, 16).index_add_(0, rows, ys * weights.reshape(-1)[w_at, None])
    assert torch.equal(combine(ys, weights, w_at, rows, 2), want)
