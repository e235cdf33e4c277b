"""RMSNorm variants: the fused C path against the torch composition (the reference implementations'
cast order) and against float64, and its rows independent of each other and of the thread count."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from hybridlm.ops import norms
from hybridlm.ops.norms import Float32RMSNorm, GatedRMSNorm, OffsetRMSNorm, RMSNorm, rms_normalize

needs_kernel = pytest.mark.skipif(norms.NORM_KERNEL.get() is None, reason="norm kernel could not be built")


def composed(norm, x, gate=None):
    """The torch ops the module runs without the kernel."""
    if isinstance(norm, Float32RMSNorm):  # an RMSNorm whose scale is applied before the cast
        return (rms_normalize(x, norm.eps) * norm.weight.float()).to(x.dtype)
    if isinstance(norm, RMSNorm):
        return norm.weight * rms_normalize(x, norm.eps).to(x.dtype)
    if isinstance(norm, OffsetRMSNorm):
        return (rms_normalize(x, norm.eps) * (1.0 + norm.weight.float())).to(x.dtype)
    y = norm.weight * rms_normalize(x, norm.eps).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def make(cls, dim, dtype, seed):
    torch.manual_seed(seed)
    norm = cls(dim, eps=1e-6).to(dtype).requires_grad_(False)
    norm.weight.copy_(torch.randn(dim))
    return norm


@needs_kernel
@pytest.mark.parametrize("cls", [RMSNorm, OffsetRMSNorm, GatedRMSNorm, Float32RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 4, 24), (5, 7)])
def test_fused_norm_equals_the_torch_composition(cls, dtype, shape, isa):
    norm = make(cls, shape[-1], dtype, seed=len(shape))
    x = (3 * torch.randn(shape)).to(dtype)
    gate = torch.randn(shape).to(dtype) if cls is GatedRMSNorm else None
    args = (x,) if gate is None else (x, gate)
    got, want = norm(*args), composed(norm, *args)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:  # same rounding points; a sum order can move a value across a rounding boundary
        ulps = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
        assert (ulps <= 2**-7).all() and (got == want).float().mean() > 0.95


@needs_kernel
@pytest.mark.parametrize(("cls", "offset"), [(OffsetRMSNorm, 1.0), (Float32RMSNorm, 0.0)])
def test_fused_norm_matches_float64(isa, cls, offset):
    norm = make(cls, 48, torch.float32, seed=3)
    x = torch.randn(4, 48)
    scale = offset + norm.weight.double()
    ref = x.double() / x.double().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * scale
    torch.testing.assert_close(norm(x).double(), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("cls", [RMSNorm, GatedRMSNorm, Float32RMSNorm])
def test_a_prompt_sized_input_gives_each_row_the_numbers_of_its_own_call(cls, isa):
    """Rows enough for the kernel to split them over threads (a prompt chunk) equal each row normed
    alone, bit for bit, on one thread or two, at every ISA level: a row's numbers never depend on its
    neighbours."""
    norm = make(cls, 96, torch.bfloat16, seed=5)
    x = (3 * torch.randn(1000, 96)).to(torch.bfloat16)
    gate = torch.randn(1000, 96).to(torch.bfloat16) if cls is GatedRMSNorm else None
    args = (x,) if gate is None else (x, gate)
    threads = torch.get_num_threads()
    try:
        got = [norm(*args)]
        torch.set_num_threads(1)
        got.append(norm(*args))
    finally:
        torch.set_num_threads(threads)
    alone = torch.cat([norm(*(a[i : i + 1] for a in args)) for i in range(x.shape[0])])
    for g in got:
        assert torch.equal(g, alone)


def test_a_strided_input_and_no_kernel_give_the_torch_composition(monkeypatch):
    norm = make(RMSNorm, 64, torch.float32, seed=4)
    strided = torch.randn(3, 128)[:, ::2]
    torch.testing.assert_close(norm(strided), composed(norm, strided), atol=1e-6, rtol=1e-5)
    x = torch.randn(5, 64)
    monkeypatch.setattr(norms, "NORM_KERNEL", types.SimpleNamespace(get=lambda: None))  # not built
    assert torch.equal(norm(x), composed(norm, x))
