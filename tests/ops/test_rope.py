import itertools

import pytest
import torch

import hybridlm.ops.rope as rope_mod
from hybridlm.ops.native import NativeKernel
from hybridlm.ops.rope import Rotary, apply_rotary, default_inv_freq, rotate_half

needs_kernel = pytest.mark.skipif(
    rope_mod.ROTARY_KERNEL.get() is None, reason="the rotary kernel could not be built"
)


def _composed(x, cos, sin):
    """The torch ops transformers applies: x * cos + rotate_half(x) * sin on the first rot dims."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def _case(batch, heads, length, dim, rot, heads_first, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    if heads_first:
        x = torch.randn(batch, heads, length, dim, generator=g) * 3
    else:  # a [B, L, H, D] projection viewed heads-first, as the attention layers make it
        x = (torch.randn(batch, length, heads, dim, generator=g) * 3).transpose(1, 2)
    positions = torch.randint(0, 1 << 17, (batch, length), generator=g)
    cos, sin = Rotary(default_inv_freq(dim, 10000.0, rot / dim)).cos_sin(positions, dtype)
    return x.to(dtype), cos, sin


@needs_kernel
@pytest.mark.parametrize(
    ("batch", "heads", "length", "dim", "rot", "heads_first"),
    [c for c in itertools.product([1, 2], [1, 8], [1, 3, 17, 300], [64, 256], [16, 64], [True, False])
     if c[4] <= c[3]],
)
def test_the_kernel_gives_the_composed_ops_bits(batch, heads, length, dim, rot, heads_first, isa):
    x, cos, sin = _case(batch, heads, length, dim, rot, heads_first)
    assert rope_mod._kernel_applies(x, cos, sin)
    y = apply_rotary(x, cos, sin)
    assert y.is_contiguous()
    assert torch.equal(y, _composed(x, cos, sin))


@needs_kernel
def test_a_row_is_rotated_as_it_would_be_alone(isa):
    x, cos, sin = _case(2, 8, 17, 256, 64, heads_first=False)
    whole = apply_rotary(x, cos, sin)
    for b, t in [(0, 0), (1, 16), (1, 5)]:
        at = (slice(b, b + 1), slice(None), slice(t, t + 1))
        assert torch.equal(apply_rotary(x[at], cos[at], sin[at]), whole[at])


def test_without_the_kernel_the_torch_ops_give_the_same_result(monkeypatch):
    x, cos, sin = _case(1, 8, 5, 256, 64, heads_first=False)
    expected = _composed(x, cos, sin)
    monkeypatch.setenv("HYBRIDLM_COMPILE", "0")
    k = rope_mod.ROTARY_KERNEL
    fresh = NativeKernel(k.name, k.file, k.symbol, k.argtypes, k.restype, k.fallback)
    monkeypatch.setattr(rope_mod, "ROTARY_KERNEL", fresh)
    assert torch.equal(apply_rotary(x, cos, sin), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_dtypes_take_the_torch_ops(dtype):
    x, cos, sin = _case(1, 2, 3, 64, 64, heads_first=True, dtype=dtype)
    assert not rope_mod._kernel_applies(x, cos, sin)
    assert torch.equal(apply_rotary(x, cos, sin), x * cos + rotate_half(x) * sin)
