"""mamba2_scan against a float64 token-by-token reference and itself: chunked vs step, split vs
unsplit, one call vs many (bit for bit for the step form), ragged rows vs single rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlm.ops.mamba2 import (
    GATED_NORM_KERNEL,
    grouped_gated_norm,
    grouped_gated_norm_reference,
    mamba2_scan,
    mamba2_step_fused,
    mamba2_step_packed,
)
from tests.ops.packed import packed_layout

torch.set_flush_denormal(True)

LIMIT = (0.01, 4.0)  # a clamp that binds on both sides for the inputs below


def make_inputs(Bt, L, H, P, G, N, *, dtype=torch.float32, seed=0):
    """x, raw dt (some far negative / positive so the clamp binds), A = -exp(A_log) with fast and slow
    heads, grouped B / C, D, dt_bias and a random state."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(Bt, L, H, P, generator=gen).to(dtype)
    dt = (torch.randn(Bt, L, H, generator=gen) * 3).to(dtype)
    A = -torch.empty(H).uniform_(math.log(0.05), math.log(8.0), generator=gen).exp()
    B = torch.randn(Bt, L, G, N, generator=gen).to(dtype)
    C = torch.randn(Bt, L, G, N, generator=gen).to(dtype)
    D = torch.randn(H, generator=gen)
    dt_bias = torch.rand(H, generator=gen)
    state = 0.5 * torch.randn(Bt, H, P, N, generator=gen)
    return x, dt, A, B, C, D, dt_bias, state


def reference(x, dt, A, B, C, D, dt_bias, state, dt_limit=LIMIT):
    """The recurrence token by token in float64: (y [Bt, L, H, P], final state [Bt, H, P, N])."""
    x, dt, A, B, C, D, dt_bias, S = (t.double() for t in (x, dt, A, B, C, D, dt_bias, state))
    rep = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        delta = F.softplus(dt[:, t] + dt_bias).clamp(*dt_limit)  # [Bt, H]
        write = (delta[..., None] * x[:, t])[..., None] * B[:, t, :, None]
        S = S * torch.exp(delta * A)[..., None, None] + write
        y[:, t] = torch.einsum("bhpn,bhn->bhp", S, C[:, t]) + D[:, None] * x[:, t]
    return y, S


def close_to_scale(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """max |got - want| within `rel` x the largest |want| (float32 accumulation over a chunk)."""
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"{err:.3e} vs scale {want.abs().max().item():.3f}"


def scan(inputs, **kw):
    x, dt, A, B, C, D, dt_bias, state = inputs
    return mamba2_scan(x, dt, A, B, C, D, state, dt_bias=dt_bias, dt_limit=LIMIT, **kw)


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("L", [1, 5, 37])
def test_both_forms_equal_the_float64_reference(chunk, L):
    """Odd sizes, 2 groups of 3 heads each: y and the final state within float32 rounding."""
    inputs = make_inputs(2, L, 6, 5, 2, 7, seed=L)
    y, state, _ = scan(inputs, chunk_size=chunk)
    ry, rs = reference(*inputs)
    close_to_scale(y, ry, 5e-6)
    close_to_scale(state, rs, 5e-6)


@pytest.mark.parametrize("chunk", [1, 8])
def test_bfloat16_inputs_keep_a_float32_state(chunk):
    inputs = make_inputs(1, 19, 4, 8, 1, 8, dtype=torch.bfloat16, seed=3)
    y, state, _ = scan(inputs, chunk_size=chunk)
    assert y.dtype == state.dtype == torch.float32
    ry, rs = reference(*inputs)
    close_to_scale(state, rs, 1e-5)
    close_to_scale(y, ry, 1e-5)


@pytest.mark.parametrize("chunk", [1, 8])
def test_boundary_states_are_the_states_after_each_split(chunk):
    inputs = make_inputs(1, 30, 4, 3, 2, 5, seed=4)
    splits = [0, 3, 8, 8, 17, 30]
    y, final, bounds = scan(inputs, chunk_size=chunk, splits=splits)
    whole, _, _ = scan(inputs, chunk_size=chunk)
    torch.testing.assert_close(y, whole, rtol=1e-5, atol=1e-5)
    assert len(bounds) == len(splits)
    for t, b in zip(splits, bounds, strict=True):
        _, rs = reference(*(v[:, :t] if v.dim() >= 3 and v.shape[1] == 30 else v for v in inputs))
        close_to_scale(b, rs, 5e-6)
        assert b.is_contiguous() and b.untyped_storage().nbytes() == b.numel() * 4
    assert final.equal(bounds[-1])


def cut(inputs, a, b):
    """Tokens [a, b) of the per-token inputs (x, dt, B, C); the rest as they are."""
    x, dt, A, B, C, D, dt_bias, state = inputs
    return x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], D, dt_bias, state


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(1, 23), min_size=1, max_size=4, unique=True), seed=st.integers(0, 99))
def test_step_form_gives_the_same_bits_however_the_tokens_are_cut(cuts, seed):
    """The step form's contract: the state and outputs after any token are the same bits whether the
    tokens run in one call, in pieces (decode steps, prefill chunks, a replay), or with splits."""
    inputs = make_inputs(1, 24, 4, 3, 2, 5, seed=seed)
    y, state, bounds = scan(inputs, splits=sorted(cuts))
    points = [0, *sorted(cuts), 24]
    s = inputs[-1]
    for a, b in zip(points, points[1:], strict=False):
        piece = cut(inputs, a, b)[:-1] + (s,)
        yp, s, _ = scan(piece)
        assert yp.equal(y[:, a:b])
        if b < 24:
            assert s.equal(bounds[points.index(b) - 1])
    assert s.equal(state)


def test_inplace_advances_the_given_state():
    inputs = make_inputs(1, 6, 2, 4, 1, 4, seed=5)
    live = inputs[-1].clone()
    _, final, _ = mamba2_scan(*inputs[:6], live, dt_bias=inputs[6], dt_limit=LIMIT, inplace=True)
    assert final is live
    assert live.equal(scan(inputs)[1])
    with pytest.raises(ValueError, match="inplace"):
        mamba2_scan(*inputs[:6], live.bfloat16(), dt_bias=inputs[6], inplace=True)


@pytest.mark.parametrize("chunk", [1, 8])
def test_ragged_rows_equal_their_own_runs_and_padding_is_identity(chunk):
    """Right-padded rows: each row's outputs and final state are those of its real tokens alone
    (step form: bit for bit); padded positions output zero."""
    lens = [11, 4, 0]
    inputs = make_inputs(3, 11, 4, 3, 2, 5, seed=6)
    y, state, bounds = scan(inputs, chunk_size=chunk, query_lens=lens, splits=[2, 6])
    for b, n in enumerate(lens):
        row = [v[b : b + 1, :n] if v.dim() >= 3 and v.shape[1] == 11 else v for v in inputs[:-1]]
        row.append(inputs[-1][b : b + 1])
        ya, sa, ba = scan(row, chunk_size=chunk, splits=[min(2, n), min(6, n)])
        if chunk == 1:
            assert y[b : b + 1, :n].equal(ya) and state[b : b + 1].equal(sa)
            assert all(bb[b : b + 1].equal(x) for bb, x in zip(bounds, ba, strict=True))
        else:
            torch.testing.assert_close(y[b : b + 1, :n], ya)
            torch.testing.assert_close(state[b : b + 1], sa)
        assert not y[b, n:].any()


def test_shape_errors_are_reported():
    inputs = make_inputs(1, 4, 4, 3, 2, 5)
    x, dt, A, B, C, D, dt_bias, state = inputs
    with pytest.raises(ValueError, match="shape mismatch"):
        mamba2_scan(x, dt[:, :3], A, B, C, D, state, dt_bias=dt_bias)
    with pytest.raises(ValueError, match="state must be"):
        mamba2_scan(x, dt, A, B, C, D, state[:, :2], dt_bias=dt_bias)
    with pytest.raises(ValueError, match="splits"):
        mamba2_scan(x, dt, A, B, C, D, state, dt_bias=dt_bias, splits=[5])


# ---- the C step kernel (csrc/mamba2.c) -------------------------------------------------------------
def fused_inputs(Bt, L, H, P, G, N, dtype=torch.float32, seed=0):
    """The same quantities as the kernel reads them: the conv output x ‖ B ‖ C [Bt, L, H·P + 2·G·N]."""
    x, dt, A, B, C, D, dt_bias, state = make_inputs(Bt, L, H, P, G, N, dtype=dtype, seed=seed)
    xbc = torch.cat([x.flatten(2), B.flatten(2), C.flatten(2)], dim=-1)
    return xbc, (x, dt, A, B, C, D, dt_bias, state)


def fused(xbc, inputs, **kw):
    x, dt, A, B, C, D, dt_bias, state = inputs
    H, P = x.shape[2:]
    G, N = B.shape[2:]
    out = mamba2_step_fused(xbc, dt, A, D, state, dt_bias=dt_bias, heads=H, head_dim=P, groups=G,
                            state_size=N, dt_limit=LIMIT, **kw)
    assert out is not None, "the kernel did not run"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L, N", [(13, 7), (37, 163)])
def test_step_kernel_equals_the_float64_reference_on_every_isa(isa, dtype, L, N):
    """N = 163: state rows held in registers a segment at a time, the vectors after the last whole
    segment and the scalar tail, at 8 and 16 lanes; L = 37: blocks of tokens reduced together."""
    xbc, inputs = fused_inputs(2, L, 6, 5, 2, N, dtype=dtype, seed=7)
    y, state, _ = fused(xbc, inputs)
    ry, rs = reference(*inputs)
    rel = 5e-6 if dtype == torch.float32 else 1e-5
    close_to_scale(y, ry, rel)
    close_to_scale(state, rs, rel)


@pytest.mark.parametrize("N", [5, 163])
def test_step_kernel_gives_the_same_bits_however_the_tokens_are_cut_and_batched(isa, N):
    """Cut into decode-, verify- and chunk-sized pieces, with splits, or beside other (ragged) rows:
    every token's output and state are the same bits (the kernel runs tokens in blocks of 16 that end
    at splits, their sums reduced a vector's width at a time: pieces of 1, 2, 6, 10, 7 and 14 tokens
    meet every way of cutting them)."""
    xbc, inputs = fused_inputs(3, 40, 4, 3, 2, N, seed=8)
    lens = [40, 7, 25]
    y, state, bounds = fused(xbc, inputs, query_lens=lens, splits=[3, 9, 26])
    x, dt, A, B, C, D, dt_bias, s0 = inputs
    for b, n in enumerate(lens):
        s = s0[b : b + 1]
        for a, e in ((0, 1), (1, 3), (3, 9), (9, 19), (19, 26), (26, n)):
            if a >= n:
                break
            e = min(e, n)
            row = (x, dt[b : b + 1, a:e], A, B, C, D, dt_bias, s)
            yp, s, _ = fused(xbc[b : b + 1, a:e], row)
            assert yp.equal(y[b : b + 1, a:e])
            if e in (3, 9, 26):
                assert s.equal(bounds[(3, 9, 26).index(e)][b : b + 1])
        assert s.equal(state[b : b + 1])
        assert not y[b, n:].any()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=25)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    data=st.data(),
)
def test_property_packed_step_kernel_equals_each_sequence_alone_bitwise(lens, dtype, data, isa):
    """Ragged sequences (1 to 40 tokens, their own states and split points) stepped in one packed call
    (with unused rows between them) give each sequence's outputs, final state and boundary states bit
    for bit as its own call does."""
    H, P, G, N = 4, 3, 2, 19  # N = 19: whole vectors and a scalar tail at 8 and 16 lanes
    starts, end, splits = packed_layout(data, lens)
    xbc, inputs = fused_inputs(1, end, H, P, G, N, dtype=dtype, seed=end)
    x, dt, A, B, C, D, dt_bias, _ = inputs
    states = [fused_inputs(1, 1, H, P, G, N, seed=100 + i)[1][-1] for i in range(len(lens))]
    packed_states = [s.clone() for s in states]
    ran = mamba2_step_packed(xbc, dt, A, D, packed_states, starts, lens, splits, dt_bias=dt_bias, heads=H,
                             head_dim=P, groups=G, state_size=N, dt_limit=LIMIT)
    assert ran is not None, "the kernel did not run"
    y, bounds = ran
    assert y.shape == (1, end, H, P)
    for i, (lo, n) in enumerate(zip(starts, lens, strict=True)):
        own = slice(lo, lo + n)
        rows = (x[:, own], dt[:, own], A, B[:, own], C[:, own], D, dt_bias, states[i].clone())
        want_y, want_state, want_bounds = fused(xbc[:, own], rows, splits=splits[i], inplace=True)
        assert torch.equal(y[:, own], want_y)
        assert torch.equal(packed_states[i], want_state)
        assert all(torch.equal(b, w) for b, w in zip(bounds[i], want_bounds, strict=True))


def test_packed_step_kernel_declines_what_it_cannot_run():
    """A state of another shape or dtype, or an empty sequence: None, and callers step one by one."""
    xbc, (_, dt, A, _, _, D, dt_bias, state) = fused_inputs(1, 4, 2, 3, 1, 5, seed=3)
    kw = dict(dt_bias=dt_bias, heads=2, head_dim=3, groups=1, state_size=5)
    assert mamba2_step_packed(xbc, dt, A, D, [state.double()], [0], [4], [[]], **kw) is None
    assert mamba2_step_packed(xbc, dt, A, D, [state[:, :1]], [0], [4], [[]], **kw) is None
    assert mamba2_step_packed(xbc, dt, A, D, [state, state.clone()], [0, 4], [4, 0], [[], []], **kw) is None


def test_step_kernel_agrees_with_the_torch_step_form():
    xbc, inputs = fused_inputs(1, 9, 4, 8, 2, 6, seed=9)
    y, state, _ = fused(xbc, inputs)
    ty, ts, _ = scan(inputs)
    torch.testing.assert_close(y, ty, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ts, rtol=1e-5, atol=1e-5)


needs_norm_kernel = pytest.mark.skipif(GATED_NORM_KERNEL.get() is None, reason="mamba2 kernel not built")


@needs_norm_kernel
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize(("rows", "channels", "groups"), [(1, 48, 3), (5, 40, 1), (300, 96, 2)])
def test_gated_norm_kernel_equals_the_float32_reference(isa, norm_before_gate, rows, channels, groups):
    """The C gated group norm against the torch composition: the same rounding points, so all but a
    few outputs (a sum order moving a value across a bf16 boundary) are the same bits; none is more
    than one bf16 step off. z is read as the view the mixer hands it (a slice of the projections)."""
    gen = torch.Generator().manual_seed(rows + groups)
    y = 3 * torch.randn(1, rows, channels, generator=gen)
    projected = torch.randn(1, rows, channels + 7, generator=gen).bfloat16()
    z = projected[..., 2 : 2 + channels]
    w = torch.randn(channels, generator=gen).bfloat16()
    got = grouped_gated_norm(y, z, w, groups, 1e-5, norm_before_gate, torch.bfloat16)
    want = grouped_gated_norm_reference(y, z, w, groups, 1e-5, norm_before_gate, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == y.shape
    steps = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
    assert (steps <= 2**-7).all() and (got == want).float().mean() > 0.95


@needs_norm_kernel
def test_gated_norm_kernel_gives_each_row_its_own_bits(isa):
    """A row's output does not depend on the rows beside it (decode rows, packed rows, prompts)."""
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(1, 70, 64, generator=gen)
    z = torch.randn(1, 70, 64, generator=gen).bfloat16()
    w = torch.randn(64, generator=gen).bfloat16()
    whole = grouped_gated_norm(y, z, w, 4, 1e-6, False, torch.bfloat16)
    for r in (0, 33, 69):
        alone = grouped_gated_norm(y[:, r : r + 1], z[:, r : r + 1], w, 4, 1e-6, False, torch.bfloat16)
        assert torch.equal(alone[0, 0], whole[0, r])
