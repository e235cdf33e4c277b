"""kda_rule (per-channel decay) against a float64 step-by-step reference, transformers' torch KDA
kernels, and itself (chunked vs step, split vs unsplit, one call vs two, batch rows vs alone)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.ops.kda import kda_rule
from tests.ops.delta_reference import reference

torch.set_flush_denormal(True)

STEP = 1
ALGORITHMS = [STEP, 4, 16, None]


def make_inputs(B, L, H, Dk, Dv, *, gate="kimi", dtype=torch.float32, seed=0):
    """L2-normalised q / k, per-channel log decays of Kimi's form (-A·softplus(x + dt_bias), A per head
    log-uniform in [1, 16]: unbounded, some channels forgetting fast) or Ling's safe gate
    (-5·sigmoid(A·(x + dt_bias))), beta = sigmoid(b), and a random state."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, L, H, Dk, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, L, H, Dk, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, L, H, Dv, generator=gen).to(dtype)
    A = torch.empty(H, 1).uniform_(0.0, math.log(16.0), generator=gen).exp()
    x = torch.randn(B, L, H, Dk, generator=gen) + torch.rand(H, Dk, generator=gen)
    g = -A * F.softplus(x) if gate == "kimi" else -5.0 * torch.sigmoid(A * x)
    beta = torch.sigmoid(torch.randn(B, L, H, generator=gen))
    state = 0.5 * torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, g, beta, state


def assert_close(actual, expected, atol=3e-6, rtol=1e-5):
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


SHAPES = [(2, 37, 3, 16, 24), (1, 70, 2, 32, 16), (3, 5, 4, 8, 12), (1, 1, 2, 16, 8)]


@pytest.mark.parametrize("gate", ["kimi", "safe"])
@pytest.mark.parametrize("chunk_size", ALGORITHMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_float64_reference(shape, chunk_size, gate):
    inputs = make_inputs(*shape, gate=gate)
    o, state, _ = kda_rule(*inputs, chunk_size=chunk_size)
    ref_o, ref_state = reference(*inputs)
    assert o.dtype == torch.float32 and state.dtype == torch.float32
    assert_close(o, ref_o)
    assert_close(state, ref_state)


def test_per_channel_decay_differs_from_its_per_head_mean():
    """The decay really is per channel: replacing it by its per-head mean changes the result."""
    q, k, v, g, beta, state = make_inputs(1, 20, 2, 8, 8)
    o, _, _ = kda_rule(q, k, v, g, beta, state)
    o_mean, _, _ = kda_rule(q, k, v, g.mean(-1, keepdim=True).expand_as(g), beta, state)
    assert (o - o_mean).abs().max() > 1e-2


def test_long_strongly_decaying_chunks_stay_finite_and_exact():
    """Decays summing far below exp's float32 range inside one chunk (Kimi's unbounded gate)."""
    q, k, v, g, beta, state = make_inputs(1, 48, 2, 8, 8)
    g = g * 40
    o, final, _ = kda_rule(q, k, v, g, beta, state, chunk_size=16)
    ref_o, ref_state = reference(q, k, v, g, beta, state)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert_close(o, ref_o)
    assert_close(final, ref_state)


@pytest.mark.parametrize("chunk_size", [STEP, 16])
def test_bf16_inputs_give_bf16_output_and_fp32_state_close_to_reference(chunk_size):
    inputs = make_inputs(2, 33, 2, 16, 16, dtype=torch.bfloat16)
    o, state, _ = kda_rule(*inputs, chunk_size=chunk_size)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    ref_o, ref_state = reference(*inputs)
    assert_close(o, ref_o, atol=2e-2, rtol=2e-2)
    assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


def test_in_kernel_normalisation_equals_normalising_first():
    q, k, v, g, beta, state = make_inputs(1, 21, 2, 8, 8)
    q, k = 3 * q, 0.5 * k
    got, _, _ = kda_rule(q, k, v, g, beta, state, normalize_qk=True)
    norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731 - FLA's l2norm
    expected, _, _ = kda_rule(norm(q), norm(k), v, g, beta, state)
    assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("first, second", [(1, 30), (17, 16), (3, 2), (40, 1)])
def test_state_carried_across_two_calls_equals_one_call(first, second):
    q, k, v, g, beta, state = make_inputs(2, first + second, 2, 8, 12, seed=3)
    o, final, _ = kda_rule(q, k, v, g, beta, state)
    cut = lambda x, a, b: x[:, a:b]  # noqa: E731
    o1, s1, _ = kda_rule(*(cut(x, 0, first) for x in (q, k, v, g, beta)), state)
    o2, s2, _ = kda_rule(*(cut(x, first, None) for x in (q, k, v, g, beta)), s1)
    assert_close(torch.cat([o1, o2], dim=1), o)
    assert_close(s2, final)


@pytest.mark.parametrize("chunk_size", [STEP, 16])
def test_ragged_batch_rows_equal_each_row_run_alone_bitwise(chunk_size):
    """Row independence: a padded row gives its own numbers, bit for bit, and padding is identity."""
    q, k, v, g, beta, state = make_inputs(3, 29, 2, 8, 8, seed=5)
    lens = [29, 11, 20]
    o, final, _ = kda_rule(q, k, v, g, beta, state, query_lens=lens, chunk_size=chunk_size)
    for b, n in enumerate(lens):
        row = [x[b : b + 1, :n] for x in (q, k, v, g, beta)]
        o_b, s_b, _ = kda_rule(*row, state[b : b + 1], chunk_size=chunk_size)
        assert torch.equal(o[b : b + 1, :n], o_b)
        assert torch.equal(final[b : b + 1], s_b)
        assert not o[b, n:].any()


@pytest.mark.parametrize("L", [1, 3, 40, 100])
def test_matches_transformers_torch_kernels(L):
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    q, k, v, g, beta, state = make_inputs(2, L, 3, 16, 8, seed=8)
    q, k = 2 * q, 3 * k  # the kernels normalise
    o, final, _ = kda_rule(q, k, v, g, beta, state, normalize_qk=True)
    for oracle in (chunk_kimi_delta_attention, recurrent_kimi_delta_attention):
        ref_o, ref_state = oracle(
            q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert_close(o, ref_o)
        assert_close(final, ref_state)


@pytest.mark.parametrize("chunk_size", [STEP, 16])
def test_inplace_advances_the_given_state_and_otherwise_leaves_it(chunk_size):
    q, k, v, g, beta, state = make_inputs(1, 9, 2, 8, 8)
    before = state.clone()
    _, final, _ = kda_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert torch.equal(state, before) and final is not state
    _, final_in, _ = kda_rule(q, k, v, g, beta, state, chunk_size=chunk_size, inplace=True)
    assert final_in is state and torch.equal(state, final)


def test_invalid_inputs_are_rejected():
    q, k, v, g, beta, state = make_inputs(1, 6, 2, 8, 8)
    with pytest.raises(ValueError, match="shape"):
        kda_rule(q, k, v, g[..., 0], beta, state)
    with pytest.raises(ValueError, match="splits"):
        kda_rule(q, k, v, g, beta, state, splits=[7])
    with pytest.raises(ValueError, match="chunk_size"):
        kda_rule(q, k, v, g, beta, state, chunk_size=0)


@settings(deadline=None, max_examples=20)
@given(L=st.integers(1, 40), chunk_size=st.sampled_from(ALGORITHMS), data=st.data())
def test_property_splitting_changes_neither_output_nor_final_state(L, chunk_size, data):
    splits = sorted(data.draw(st.lists(st.integers(0, L), max_size=4), label="splits"))
    inputs = make_inputs(2, L, 2, 8, 4, seed=L)
    o, final, bounds = kda_rule(*inputs, chunk_size=chunk_size, splits=splits)
    o_unsplit, final_unsplit, _ = kda_rule(*inputs, chunk_size=chunk_size)
    assert torch.equal(o, o_unsplit) and torch.equal(final, final_unsplit)
    q, k, v, g, beta, state = inputs
    for t, bound in zip(splits, bounds, strict=True):
        _, ref_state = reference(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], state)
        assert_close(bound, ref_state)
