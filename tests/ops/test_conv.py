"""causal_conv1d against a float64 reference, transformers' conv functions, and itself (carried prior,
ragged rows, split points)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlm.ops import conv as conv_mod
from hybridlm.ops.conv import causal_conv1d
from tests.ops.packed import packed_layout


def make_inputs(B, L, C, K, *, dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, C, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(C, K, generator=gen)).to(dtype)
    b = torch.randn(C, generator=gen).to(dtype) if bias else None
    prior = torch.randn(B, K - 1, C, generator=gen).to(dtype)
    return x, weight, b, prior


def reference(x, weight, bias, prior, activation=None):
    """out[b, t, c] = act(bias[c] + Σ_j weight[c, j] · cat(prior, x)[b, t + j, c]) in float64."""
    xp = torch.cat((prior, x), dim=1).double()
    L, K = x.shape[1], weight.shape[1]
    out = sum(weight[:, j].double() * xp[:, j : j + L] for j in range(K))
    if bias is not None:
        out = out + bias.double()
    return F.silu(out) if activation == "silu" else out


def is_compact(t):
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("B, L, C, K", [(2, 1, 6, 4), (2, 13, 6, 4), (1, 5, 3, 2), (3, 9, 5, 1)])
def test_fp32_matches_float64_reference(B, L, C, K, bias, activation, isa):
    x, weight, b, prior = make_inputs(B, L, C, K, bias=bias)
    out, tail, _ = causal_conv1d(x, weight, b, prior, activation=activation)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), reference(x, weight, b, prior, activation), atol=1e-5, rtol=1e-5)
    assert tail.shape == prior.shape
    assert torch.equal(tail, torch.cat((prior, x), dim=1)[:, L:])


@pytest.mark.parametrize("L", [1, 7])
def test_bf16_matches_float64_reference_within_bf16_rounding(L, isa):
    x, weight, b, prior = make_inputs(2, L, 16, 4, dtype=torch.bfloat16, seed=1)
    out, tail, _ = causal_conv1d(x, weight, b, prior, activation="silu")
    assert out.dtype == torch.bfloat16 and tail.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(x, weight, b, prior, "silu"), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [1, 2, 11])
def test_zero_prior_matches_transformers_causal_conv1d_fn(dtype, L):
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, weight, b, prior = make_inputs(2, L, 8, 4, dtype=dtype, seed=2)
    out, _, _ = causal_conv1d(x, weight, b, torch.zeros_like(prior), activation="silu")
    expected = causal_conv1d_fn(x.transpose(1, 2), weight, b, activation="silu").transpose(1, 2)
    atol = 1e-6 if dtype == torch.float32 else 0.0  # bf16: the same single rounding of a float32 sum
    torch.testing.assert_close(out, expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_decode_matches_transformers_causal_conv1d_update(dtype, activation):
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_update

    x, weight, b, prior = make_inputs(2, 1, 8, 3, dtype=dtype, seed=3)
    conv_state = prior.transpose(1, 2).clone()  # transformers keeps [B, C, K-1]
    expected = causal_conv1d_update(x.transpose(1, 2), conv_state, weight, b, activation).transpose(1, 2)
    out, tail, _ = causal_conv1d(x, weight, b, prior, activation=activation)
    atol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(out, expected, atol=atol, rtol=atol)
    assert torch.equal(tail, conv_state.transpose(1, 2))


def test_fp32_weight_with_bf16_input_computes_in_fp32_and_returns_bf16():
    x, weight, b, prior = make_inputs(1, 6, 8, 4, dtype=torch.bfloat16, seed=4)
    out, tail, _ = causal_conv1d(x, weight.float(), b.float(), prior)
    assert out.dtype == torch.bfloat16 and tail.dtype == torch.bfloat16
    expected = reference(x, weight.float(), b.float(), prior).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("cut", [0, 1, 2, 5, 12])
def test_prior_carried_across_calls_equals_one_call(cut):
    x, weight, b, prior = make_inputs(2, 12, 6, 4, seed=5)
    out_all, tail_all, _ = causal_conv1d(x, weight, b, prior, activation="silu")
    out1, tail1, _ = causal_conv1d(x[:, :cut], weight, b, prior, activation="silu")
    out2, tail2, _ = causal_conv1d(x[:, cut:], weight, b, tail1, activation="silu")
    torch.testing.assert_close(torch.cat((out1, out2), dim=1), out_all, atol=1e-6, rtol=1e-6)
    assert torch.equal(tail2, tail_all)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels", [6, 40])
def test_token_by_token_decode_equals_one_call(channels, dtype, isa):
    """Bit for bit at every ISA level: with AVX-512 a decode row reads the [C, K] taps in place and a
    call of 7 rows transposes them first (`LONG_ROWS`); 40 channels take vectors and a scalar tail;
    float32 outputs show every bit of the sums."""
    x, weight, b, prior = make_inputs(2, 7, channels, 4, dtype=dtype, seed=6)
    out_all, tail_all, _ = causal_conv1d(x, weight, b, prior, activation="silu")
    tail, outs = prior, []
    for t in range(x.shape[1]):
        out_t, tail, _ = causal_conv1d(x[:, t : t + 1], weight, b, tail, activation="silu")
        outs.append(out_t)
    torch.testing.assert_close(torch.cat(outs, dim=1), out_all, atol=0.0, rtol=0.0)
    assert torch.equal(tail, tail_all)


def test_ragged_tails_exclude_padded_inputs():
    K, L = 4, 10
    lens = [10, 6, 2, 0]  # 2 and 0 are shorter than K-1: part of their tail is still the prior
    x, weight, b, prior = make_inputs(len(lens), L, 5, K, seed=7)
    splits = [0, 1, 4, 8, L]
    out, tail, bounds = causal_conv1d(x, weight, b, prior, query_lens=torch.tensor(lens), splits=splits)
    for i, n in enumerate(lens):
        out_i, tail_i, bounds_i = causal_conv1d(
            x[i : i + 1, :n], weight, b, prior[i : i + 1], splits=[min(t, n) for t in splits]
        )
        assert torch.equal(out[i : i + 1, :n], out_i)
        assert torch.equal(tail[i : i + 1], tail_i)
        assert torch.equal(tail[i], torch.cat((prior[i], x[i, :n]))[-(K - 1) :])
        for bound, bound_i in zip(bounds, bounds_i, strict=True):
            assert torch.equal(bound[i : i + 1], bound_i)


def test_query_lens_as_list_equals_tensor():
    x, weight, b, prior = make_inputs(2, 6, 4, 3, seed=8)
    a = causal_conv1d(x, weight, b, prior, query_lens=[6, 2], splits=[3])
    t = causal_conv1d(x, weight, b, prior, query_lens=torch.tensor([6, 2]), splits=[3])
    assert all(torch.equal(u, w) for u, w in zip([a[0], a[1], *a[2]], [t[0], t[1], *t[2]], strict=True))


@pytest.mark.parametrize("query_lens", [None, [9, 4]])
def test_boundary_tails_equal_tails_of_prefix_runs(query_lens):
    x, weight, b, prior = make_inputs(2, 9, 4, 4, seed=9)
    splits = [0, 1, 2, 5, 9]
    _, tail, bounds = causal_conv1d(x, weight, b, prior, query_lens=query_lens, splits=splits)
    lens = query_lens or [9, 9]
    for t, bound in zip(splits, bounds, strict=True):
        for i, n in enumerate(lens):
            expected = causal_conv1d(x[i : i + 1, : min(t, n)], weight, b, prior[i : i + 1])[1]
            assert torch.equal(bound[i : i + 1], expected)
    assert torch.equal(bounds[-1], tail)


@pytest.mark.parametrize("L", [1, 2, 8])
@pytest.mark.parametrize("query_lens", [None, [1, 1]])
def test_tails_are_compact_copies_not_views_of_x(L, query_lens):
    x, weight, b, prior = make_inputs(2, L, 4, 4, seed=10)
    _, tail, bounds = causal_conv1d(x, weight, b, prior, query_lens=query_lens, splits=[0, L])
    for t in (tail, *bounds):
        assert t.is_contiguous() and is_compact(t)
    before = [t.clone() for t in (tail, *bounds)]
    x.add_(1.0)
    prior.add_(1.0)
    assert all(torch.equal(t, u) for t, u in zip((tail, *bounds), before, strict=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"splits": [2, 1]}, "splits"), ({"splits": [5]}, "splits"), ({"activation": "gelu"}, "activation")],
)
def test_invalid_arguments_are_rejected(kwargs, match):
    x, weight, b, prior = make_inputs(1, 4, 2, 3)
    with pytest.raises(ValueError, match=match):
        causal_conv1d(x, weight, b, prior, **kwargs)


@settings(deadline=None, max_examples=30)
@given(B=st.integers(1, 3), L=st.integers(0, 12), K=st.integers(1, 5), data=st.data())
def test_property_split_calls_equal_one_call(B, L, K, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, L), max_size=3), label="cuts"))
    x, weight, b, prior = make_inputs(B, L, 3, K, seed=L)
    out_all, tail_all, bounds = causal_conv1d(x, weight, b, prior, activation="silu", splits=cuts)
    outs, tail, start = [], prior, 0
    for cut, bound in zip(cuts, bounds, strict=True):
        out, tail, _ = causal_conv1d(x[:, start:cut], weight, b, tail, activation="silu")
        assert torch.equal(tail, bound)
        outs.append(out)
        start = cut
    out, tail, _ = causal_conv1d(x[:, start:], weight, b, tail, activation="silu")
    torch.testing.assert_close(torch.cat((*outs, out), dim=1), out_all, atol=1e-6, rtol=1e-6)
    assert torch.equal(tail, tail_all)


@pytest.mark.skipif(conv_mod.CONV_KERNEL.get() is None, reason="conv kernel could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [1, 4, conv_mod.FUSED_MAX_LEN])
def test_fused_short_conv_equals_the_torch_path(monkeypatch, dtype, L, isa):
    """Few-token inputs run the C kernel; outputs, tails and boundary tails equal the torch path's
    (bf16: the same rounding points, up to one ulp from the summation order)."""
    x, w, b, prior = make_inputs(3, L, 40, 4, dtype=dtype, seed=L)
    kw = dict(activation="silu", query_lens=[L, max(L - 2, 0), 1], splits=[0, 1, L])
    got = causal_conv1d(x, w, b, prior, **kw)
    monkeypatch.setattr(conv_mod, "CONV_KERNEL", types.SimpleNamespace(get=lambda: None))
    want = causal_conv1d(x, w, b, prior, **kw)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype is torch.float32 else dict(atol=2**-6, rtol=2**-7)
    torch.testing.assert_close(got[0], want[0], **tol)
    assert torch.equal(got[1], want[1])
    assert len(got[2]) == 3 and all(torch.equal(g, e) for g, e in zip(got[2], want[2], strict=True))


@pytest.mark.skipif(conv_mod.CONV_PACKED_KERNEL.get() is None, reason="conv kernel could not be built")
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=30)
@given(
    lens=st.lists(st.integers(1, conv_mod.FUSED_MAX_LEN), min_size=1, max_size=5),
    K=st.integers(2, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    bias=st.booleans(),
    activation=st.sampled_from([None, "silu"]),
    data=st.data(),
)
def test_property_packed_conv_equals_each_sequence_alone_bitwise(lens, K, dtype, bias, activation, data, isa):
    """Ragged sequences (1 to FUSED_MAX_LEN tokens, their own priors and split points, unused rows
    between them) convolved in one packed call: each sequence's outputs, tail and boundary tails
    equal, bit for bit, those of its own `causal_conv1d` call."""
    C = 40
    starts, end, splits = packed_layout(data, lens)
    x, w, b, _ = make_inputs(1, end, C, K, dtype=dtype, bias=bias, seed=end)
    priors = [make_inputs(1, 1, C, K, dtype=dtype, seed=100 + i)[3] for i in range(len(lens))]
    out, tails, bounds = conv_mod.causal_conv1d_packed(
        x, w, b, priors, starts, lens, splits, activation=activation
    )
    assert out.shape == x.shape
    for i, (lo, n) in enumerate(zip(starts, lens, strict=True)):
        want, want_tail, want_bounds = causal_conv1d(
            x[:, lo : lo + n], w, b, priors[i], activation=activation, splits=splits[i]
        )
        assert torch.equal(out[:, lo : lo + n], want)
        assert torch.equal(tails[i], want_tail)
        assert all(torch.equal(g, e) for g, e in zip(bounds[i], want_bounds, strict=True))


def test_packed_conv_declines_what_its_kernel_cannot_run():
    x, w, b, prior = make_inputs(1, conv_mod.FUSED_MAX_LEN + 1, 8, 4)
    assert conv_mod.causal_conv1d_packed(x, w, b, [prior], [0], [x.shape[1]], [[]]) is None
    assert conv_mod.causal_conv1d_packed(x, w, b, [prior.double()], [0], [1], [[]]) is None
