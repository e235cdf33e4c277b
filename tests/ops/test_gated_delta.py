"""gated_delta_rule against a float64 step-by-step reference, transformers' torch kernels, and itself
(chunked vs step, split vs unsplit, one call vs two, ragged batch vs single rows)."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlm.ops import gated_delta as gated_delta_mod
from hybridlm.ops.gated_delta import (
    FUSED_MAX_LEN,
    GDN_KERNEL,
    _composed_scan,
    gated_delta_net_scan,
    gated_delta_net_scan_packed,
    gated_delta_rule,
)
from tests.ops.delta_reference import reference
from tests.ops.packed import packed_layout

# As the engine does: subnormal intermediates (from strongly decaying heads) take slow CPU paths.
torch.set_flush_denormal(True)

STEP = 1  # chunk_size that forces the step recurrence
ALGORITHMS = [STEP, 4, 16, 32, 64, None]


def make_inputs(B, L, H, Dk, Dv, *, dtype=torch.float32, seed=0):
    """L2-normalised q / k, Gated DeltaNet gates (g = -A·softplus(a + dt_bias), beta = sigmoid(b)) with
    A log-uniform in [0.01, 16] per head (fast- and slow-forgetting heads), and a random state."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, L, H, Dk, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, L, H, Dk, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, L, H, Dv, generator=gen).to(dtype)
    A = torch.empty(H).uniform_(math.log(0.01), math.log(16.0), generator=gen).exp()
    dt_bias = torch.rand(H, generator=gen)
    g = -A * F.softplus(torch.randn(B, L, H, generator=gen) + dt_bias)
    beta = torch.sigmoid(torch.randn(B, L, H, generator=gen))
    state = 0.5 * torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, g, beta, state


def run(inputs, **kw):
    return gated_delta_rule(*inputs, **kw)


def assert_close(actual, expected, atol=3e-6, rtol=1e-5):
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


SHAPES = [(2, 37, 3, 16, 24), (1, 70, 2, 32, 16), (3, 5, 4, 8, 12), (1, 1, 2, 16, 8)]


@pytest.mark.parametrize("chunk_size", ALGORITHMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_float64_reference(shape, chunk_size):
    inputs = make_inputs(*shape)
    o, state, _ = run(inputs, chunk_size=chunk_size)
    ref_o, ref_state = reference(*inputs)
    assert o.dtype == torch.float32 and state.dtype == torch.float32
    assert o.shape == ref_o.shape and state.shape == ref_state.shape
    assert_close(o, ref_o)
    assert_close(state, ref_state)


@pytest.mark.parametrize("chunk_size", [STEP, 16])
def test_custom_scale_is_applied_to_q(chunk_size):
    inputs = make_inputs(2, 20, 2, 16, 8, seed=1)
    o, _, _ = run(inputs, chunk_size=chunk_size, scale=0.37)
    assert_close(o, reference(*inputs, scale=0.37)[0])


@pytest.mark.parametrize("chunk_size", [STEP, 32])
def test_bf16_inputs_give_bf16_output_and_fp32_state_close_to_reference(chunk_size):
    q, k, v, g, beta, state = make_inputs(2, 45, 3, 32, 16, dtype=torch.bfloat16, seed=2)
    o, final, _ = gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    ref_o, ref_state = reference(q, k, v, g, beta, state)  # the same bf16-rounded inputs, in float64
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    # Accumulation is float32, so the only bf16 error left is the rounding of the output itself.
    assert_close(o, ref_o, atol=2e-2, rtol=1e-2)
    assert_close(final, ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [4, 16, 32, 64])
def test_chunked_form_agrees_with_step_recurrence(chunk_size):
    inputs = make_inputs(2, 150, 2, 32, 32, seed=3)
    o_step, s_step, _ = run(inputs, chunk_size=STEP)
    o_chunk, s_chunk, _ = run(inputs, chunk_size=chunk_size)
    assert_close(o_chunk, o_step)
    assert_close(s_chunk, s_step)


@pytest.mark.parametrize("chunk_size", [STEP, 16, 32])
def test_boundary_states_equal_prefix_runs_and_splits_leave_output_unchanged(chunk_size):
    L = 70
    inputs = make_inputs(2, L, 3, 16, 24, seed=4)
    # 0 and L, chunk boundaries (16, 32, 64) and mid-chunk points, two splits in one chunk.
    splits = [0, 5, 16, 21, 23, 32, 64, 69, L]
    o, final, bounds = run(inputs, chunk_size=chunk_size, splits=splits)
    o_unsplit, final_unsplit, none = run(inputs, chunk_size=chunk_size)
    assert none == []
    assert torch.equal(o, o_unsplit) and torch.equal(final, final_unsplit)
    assert len(bounds) == len(splits)
    q, k, v, g, beta, state = inputs
    for t, bound in zip(splits, bounds, strict=True):
        assert bound.shape == state.shape and bound.dtype == torch.float32 and bound.is_contiguous()
        prefix = (q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], state)
        assert_close(bound, reference(*prefix)[1])
    assert torch.equal(bounds[-1], final)


@pytest.mark.parametrize("first, second", [(STEP, STEP), (32, 32), (32, STEP), (STEP, 16), (None, None)])
def test_state_carried_across_two_calls_equals_one_call(first, second):
    q, k, v, g, beta, state = make_inputs(2, 60, 2, 16, 16, seed=5)
    o_all, s_all, _ = gated_delta_rule(q, k, v, g, beta, state)
    p = 27
    o1, s1, _ = gated_delta_rule(q[:, :p], k[:, :p], v[:, :p], g[:, :p], beta[:, :p], state, chunk_size=first)
    o2, s2, _ = gated_delta_rule(q[:, p:], k[:, p:], v[:, p:], g[:, p:], beta[:, p:], s1, chunk_size=second)
    assert_close(torch.cat((o1, o2), dim=1), o_all)
    assert_close(s2, s_all)


@pytest.mark.parametrize("chunk_size", [STEP, 16, None])
def test_ragged_batch_rows_equal_each_row_run_alone(chunk_size):
    L = 40
    lens = [40, 23, 0]
    q, k, v, g, beta, state = make_inputs(3, L, 2, 16, 8, seed=6)
    splits = [0, 10, 23, 30, L]
    o, final, bounds = gated_delta_rule(
        q, k, v, g, beta, state, query_lens=torch.tensor(lens), splits=splits, chunk_size=chunk_size
    )
    for b, n in enumerate(lens):
        row = (x[b : b + 1, :n] for x in (q, k, v, g, beta))
        o_b, final_b, bounds_b = gated_delta_rule(
            *row, state[b : b + 1], splits=[min(t, n) for t in splits], chunk_size=chunk_size
        )
        assert_close(o[b : b + 1, :n], o_b)
        assert torch.all(o[b, n:] == 0)
        assert_close(final[b : b + 1], final_b)
        for bound, bound_b in zip(bounds, bounds_b, strict=True):
            assert_close(bound[b : b + 1], bound_b)


@pytest.mark.parametrize("chunk_size", [STEP, 16])
def test_strided_views_of_one_projection_give_the_same_result_as_contiguous_inputs(chunk_size):
    q, k, v, g, beta, state = make_inputs(2, 21, 2, 8, 4, seed=11)
    # As a model passes them: q, k, v sliced from one [B, L, H, 2*Dk + Dv] projection, g and beta
    # from one [B, L, H, 2] tensor, the state as a transposed view.
    qkv = torch.cat((q, k, v), dim=-1)
    gb = torch.stack((g, beta), dim=-1)
    views = (qkv[..., :8], qkv[..., 8:16], qkv[..., 16:], gb[..., 0], gb[..., 1])
    o, final, _ = gated_delta_rule(*views, state.transpose(-1, -2).contiguous().transpose(-1, -2),
                                   chunk_size=chunk_size)
    o_ref, final_ref, _ = gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


def test_query_lens_as_list_equals_tensor():
    inputs = make_inputs(2, 9, 2, 8, 8, seed=7)
    o_list, s_list, _ = run(inputs, query_lens=[9, 4])
    o_tensor, s_tensor, _ = run(inputs, query_lens=torch.tensor([9, 4]))
    assert torch.equal(o_list, o_tensor) and torch.equal(s_list, s_tensor)


@pytest.mark.parametrize("L", [1, 3, 40, 100])
def test_matches_transformers_torch_kernels(L):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, state = make_inputs(2, L, 4, 32, 16, seed=8)
    o, final, _ = gated_delta_rule(q, k, v, g, beta, state)
    for oracle in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        # The inputs are already L2-normalised, as gated_delta_rule expects.
        ref_o, ref_state = oracle(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
            use_qk_l2norm_in_kernel=False,
        )
        assert_close(o, ref_o)
        assert_close(final, ref_state)


@pytest.mark.parametrize("chunk_size", [STEP, 16])
def test_input_state_is_not_modified_and_final_state_is_new(chunk_size):
    for L in (0, 1, 20):
        inputs = make_inputs(1, L, 2, 8, 8, seed=9)
        state = inputs[-1]
        before = state.clone()
        _, final, bounds = run(inputs, chunk_size=chunk_size, splits=[0, L])
        assert torch.equal(state, before)
        for out in (final, *bounds):
            assert out.untyped_storage().data_ptr() != state.untyped_storage().data_ptr()
        assert torch.equal(final, bounds[-1]) and torch.equal(bounds[0], state)


@pytest.mark.parametrize("chunk_size", [STEP, 16])
def test_inplace_advances_the_given_state(chunk_size):
    inputs = make_inputs(2, 20, 2, 8, 8, seed=10)
    o_ref, s_ref, _ = run(inputs, chunk_size=chunk_size)
    state = inputs[-1].clone()
    o, final, _ = gated_delta_rule(*inputs[:-1], state, chunk_size=chunk_size, inplace=True)
    assert final is state
    assert torch.equal(o, o_ref) and torch.equal(state, s_ref)


def test_zero_length_input_returns_a_copy_of_the_state():
    inputs = make_inputs(2, 0, 2, 8, 4)
    o, final, bounds = run(inputs, splits=[0])
    assert o.shape == (2, 0, 2, 4)
    assert torch.equal(final, inputs[-1]) and torch.equal(bounds[0], inputs[-1])


@pytest.mark.parametrize("splits", [[3, 1], [-1], [11]])
def test_invalid_splits_are_rejected(splits):
    with pytest.raises(ValueError, match="splits"):
        run(make_inputs(1, 10, 1, 4, 4), splits=splits)


def test_chunk_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="chunk_size"):
        run(make_inputs(1, 10, 1, 4, 4), chunk_size=0)


@settings(deadline=None, max_examples=25)
@given(
    B=st.integers(1, 2),
    L=st.integers(1, 40),
    H=st.integers(1, 3),
    chunk_size=st.sampled_from(ALGORITHMS),
    data=st.data(),
)
def test_property_splitting_changes_neither_output_nor_final_state(B, L, H, chunk_size, data):
    splits = sorted(data.draw(st.lists(st.integers(0, L), max_size=4), label="splits"))
    inputs = make_inputs(B, L, H, 8, 4, seed=L)
    o, final, bounds = run(inputs, chunk_size=chunk_size, splits=splits)
    o_unsplit, final_unsplit, _ = run(inputs, chunk_size=chunk_size)
    assert torch.equal(o, o_unsplit) and torch.equal(final, final_unsplit)
    q, k, v, g, beta, state = inputs
    for t, bound in zip(splits, bounds, strict=True):
        prefix_state = gated_delta_rule(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], state)[1]
        assert_close(bound, prefix_state)


# gated_delta_net_scan: a Gated DeltaNet layer's scan from its projections, fused in C for few tokens.

needs_fused = pytest.mark.skipif(GDN_KERNEL.get() is None, reason="fused GDN kernel could not be built")


def gdn_inputs(B, L, Hk, Hv, Dk, Dv, dtype, seed=0):
    """Conv output q‖k‖v, raw gates a‖b, A_log, dt_bias (bf16 parameters in a bf16 model) and a state."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, 2 * Hk * Dk + Hv * Dv, generator=gen).to(dtype)
    ab = (2 * torch.randn(B, L, 2 * Hv, generator=gen)).to(dtype)
    A_log = torch.empty(Hv).uniform_(math.log(0.01), math.log(16.0), generator=gen).to(dtype)
    dt_bias = torch.rand(Hv, generator=gen).to(dtype)
    state = 0.5 * torch.randn(B, Hv, Dk, Dv, generator=gen)
    return x, ab, A_log, dt_bias, state


def gdn_scan(inputs, heads, *, fused, **kw):
    x, ab, A_log, dt_bias, state = inputs
    Hk, Hv, Dk, Dv = heads
    args = (x, ab, A_log, dt_bias, state, Hk, Dk, Hv, Dv, kw.get("query_lens"), kw.get("splits", ()),
            kw.get("inplace", False))
    if not fused:
        return _composed_scan(*args)
    names = ("query_lens", "splits", "inplace")
    options = dict(zip(names, args[9:], strict=True), fused_max_len=kw.get("fused_max_len"))
    return gated_delta_net_scan(*args[:5], k_heads=Hk, k_dim=Dk, v_heads=Hv, v_dim=Dv, **options)


def gdn_reference(inputs, heads):
    """The composed math in float64: (o, final state)."""
    x, ab, A_log, dt_bias, state = (t.double() for t in inputs)
    Hk, Hv, Dk, Dv = heads
    B, L, _ = x.shape
    q, k, v = torch.split(x, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q = F.normalize(q.reshape(B, L, Hk, Dk), dim=-1, eps=0).repeat_interleave(Hv // Hk, dim=2)
    k = F.normalize(k.reshape(B, L, Hk, Dk), dim=-1, eps=0).repeat_interleave(Hv // Hk, dim=2)
    a, b = ab.split(Hv, dim=-1)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    return reference(q, k, v.reshape(B, L, Hv, Dv), g, b.sigmoid(), state)


GDN_HEADS = [(2, 4, 16, 8), (3, 3, 8, 24)]


@needs_fused
@pytest.mark.parametrize("heads", GDN_HEADS)
@pytest.mark.parametrize("L", [1, 3, 17, 70, 150])
def test_fused_scan_matches_float64_reference_and_composed_ops(heads, L, isa):
    inputs = gdn_inputs(2, L, *heads, torch.float32, seed=L)
    o, state, _ = gdn_scan(inputs, heads, fused=True)
    ref_o, ref_state = gdn_reference(inputs, heads)
    assert_close(o, ref_o, atol=2e-5, rtol=2e-5)
    assert_close(state, ref_state, atol=2e-5, rtol=2e-5)
    co, cstate, _ = gdn_scan(inputs, heads, fused=False)
    assert_close(o, co, atol=2e-5, rtol=2e-5)
    assert_close(state, cstate, atol=2e-5, rtol=2e-5)


@needs_fused
@pytest.mark.parametrize("L", [1, 5])
def test_fused_scan_in_bf16_rounds_like_the_composed_ops(L, isa):
    heads = GDN_HEADS[0]
    inputs = gdn_inputs(1, L, *heads, torch.bfloat16, seed=7)
    o, state, _ = gdn_scan(inputs, heads, fused=True)
    co, cstate, _ = gdn_scan(inputs, heads, fused=False)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    # Both round the same float32 values once; only summation order differs.
    assert (o.float() - co.float()).abs().max() <= 2**-7 * co.float().abs().max()
    assert_close(state, cstate, atol=1e-5, rtol=1e-5)


@needs_fused
def test_fused_scan_boundaries_ragged_rows_and_inplace_state(isa):
    heads = GDN_HEADS[0]
    inputs = gdn_inputs(3, 6, *heads, torch.float32, seed=3)
    kw = dict(query_lens=[6, 2, 4], splits=[0, 1, 3, 6])
    given_state = inputs[4].clone()
    o, state, bounds = gdn_scan(inputs, heads, fused=True, **kw)
    assert torch.equal(inputs[4], given_state), "not inplace: the given state is left alone"
    co, cstate, cbounds = gdn_scan(inputs, heads, fused=False, **kw)
    assert_close(o, co, atol=2e-5, rtol=2e-5)
    assert_close(state, cstate, atol=2e-5, rtol=2e-5)
    assert len(bounds) == len(cbounds) == 4
    for got, want in zip(bounds, cbounds, strict=True):
        assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (o[1, 2:] == 0).all() and (o[2, 4:] == 0).all(), "padded positions output zeros"
    live = inputs[4].clone()
    _, final, _ = gdn_scan((*inputs[:4], live), heads, fused=True, inplace=True, **kw)
    assert final is live and torch.equal(live, state)


@pytest.mark.parametrize(
    ("L", "limit", "get"),
    [(0, None, "refuse"), (FUSED_MAX_LEN + 1, FUSED_MAX_LEN, "refuse"), (3, None, "unavailable")],
)
def test_empty_or_too_long_inputs_and_a_missing_kernel_use_the_composed_ops(monkeypatch, L, limit, get):
    heads = GDN_HEADS[0]
    inputs = gdn_inputs(1, L, *heads, torch.float32, seed=5)
    kernel = types.SimpleNamespace(get=_no_kernel if get == "refuse" else lambda: None)
    monkeypatch.setattr(gated_delta_mod, "GDN_KERNEL", kernel)
    o, state, _ = gdn_scan(inputs, heads, fused=True, fused_max_len=limit)
    co, cstate, _ = gdn_scan(inputs, heads, fused=False)
    assert torch.equal(o, co) and torch.equal(state, cstate)


def _no_kernel():
    raise AssertionError("the fused kernel was asked for")


# gated_delta_net_scan_packed: the scans of several sequences packed end to end in one call.


@needs_fused
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=25)
@given(
    lens=st.lists(st.integers(1, FUSED_MAX_LEN), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    data=st.data(),
)
def test_property_packed_scan_equals_each_sequence_alone_bitwise(lens, dtype, data, isa):
    """Ragged sequences (1 to 64 tokens, their own states and split points) scanned in one packed call
    (with unused rows between them) give each sequence's output, final state and boundary states bit
    for bit as its own call does."""
    heads = Hk, Hv, Dk, Dv = 2, 4, 32, 48  # Dv = 48: a full column block and a partial one
    starts, end, splits = packed_layout(data, lens)
    x, ab, A_log, dt_bias, _ = gdn_inputs(1, end, Hk, Hv, Dk, Dv, dtype, seed=end)
    states = [gdn_inputs(1, 1, Hk, Hv, Dk, Dv, dtype, seed=100 + i)[4] for i in range(len(lens))]
    packed_states = [s.clone() for s in states]
    o, bounds = gated_delta_net_scan_packed(
        x, ab, A_log, dt_bias, packed_states, starts, lens, splits, k_heads=Hk, k_dim=Dk, v_heads=Hv, v_dim=Dv
    )
    assert o.shape == (1, end, Hv, Dv)
    for i, (lo, n) in enumerate(zip(starts, lens, strict=True)):
        rows = (x[:, lo : lo + n], ab[:, lo : lo + n], A_log, dt_bias, states[i])
        want_o, want_state, want_bounds = gdn_scan(rows, heads, fused=True, splits=splits[i], inplace=True)
        assert torch.equal(o[:, lo : lo + n], want_o)
        assert torch.equal(packed_states[i], want_state)
        assert all(torch.equal(b, w) for b, w in zip(bounds[i], want_bounds, strict=True))


def test_packed_scan_declines_what_its_kernel_cannot_run():
    x, ab, A_log, dt_bias, state = gdn_inputs(1, 3, 1, 2, 8, 8, torch.bfloat16)
    kw = dict(k_heads=1, k_dim=8, v_heads=2, v_dim=8)
    too_long = gdn_inputs(1, FUSED_MAX_LEN + 1, 1, 2, 8, 8, torch.bfloat16)
    assert gated_delta_net_scan_packed(*too_long[:4], [state], [0], [FUSED_MAX_LEN + 1], [[]], **kw) is None
    strided = torch.zeros(1, 2, 8, 16)[..., ::2]
    assert gated_delta_net_scan_packed(x, ab, A_log, dt_bias, [strided], [0], [3], [[]], **kw) is None
