"""attention: the few-query C kernel against a float64 reference (causal, sliding window, cache
offsets, ragged rows, GQA, soft-capping) and its independence of the rows sharing a call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlm.batch import Batch, Packed
from hybridlm.cache.kv import AttentionHistory
from hybridlm.ops import attention as attention_mod
from hybridlm.ops.attention import KERNEL_MAX_QUERIES, KEY_BLOCK, attention, attention_packed

needs_kernel = pytest.mark.skipif(attention_mod.KERNEL.get() is None, reason="attention kernel not built")


def reference(q, k, v, batch, key_start, scale, window=None, softcap=None):
    """Masked softmax attention in float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    qpos = batch.positions()[:, None, :, None]
    kpos = torch.arange(key_start, key_start + k.shape[2])[None, None, None, :]
    allowed = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    return s.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def inputs(B, Hq, Hkv, L, T, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    return q, k, v


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("L", "T", "key_start", "window", "softcap"),
    [(1, 150, 0, None, None), (9, 200, 0, None, 30.0), (5, 40, 100, 16, None), (16, 130, 7, 70, None)],
)
def test_kernel_matches_float64(dtype, L, T, key_start, window, softcap, isa):
    q, k, v = inputs(1, 8, 2, L, T, 64, dtype, seed=L)
    batch = Batch.single([0] * L, offset=key_start + T - L)
    got = attention(q, k, v, batch, key_start=key_start, scale=0.125, window=window, softcap=softcap)
    ref = reference(q, k, v, batch, key_start, 0.125, window, softcap)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)


@needs_kernel
def test_kernel_handles_ragged_rows_and_strided_caches(isa):
    q, k, v = inputs(2, 4, 4, 6, 30, 32, torch.float32, seed=3)
    big = torch.randn(2, 4, 50, 32)
    big[:, :, :30] = k  # a cache buffer with spare capacity: k is a strided view of it
    batch = Batch.ragged([[1] * 6, [2] * 3], offsets=[24, 10])
    got = attention(q, big[:, :, :30], v, batch, key_start=0, scale=0.2)
    ref = reference(q, k, v, batch, 0, 0.2)
    torch.testing.assert_close(got[0].double(), ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, :, :3].double(), ref[1, :, :3], atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [None, 20])
def test_a_query_gets_the_same_bits_alone_as_inside_a_verify_pass(window, isa):
    """The position after a verify pass's j-th token must be computed exactly as one decode step
    at that position computes it: bit for bit, in bf16."""
    L, T = KERNEL_MAX_QUERIES, 90
    q, k, v = inputs(1, 8, 2, L, T, 64, torch.bfloat16, seed=5)
    batch = Batch.single([0] * L, offset=T - L)
    together = attention(q, k, v, batch, key_start=0, scale=0.125, window=window)
    for j in range(L):
        pos = T - L + j
        # decode sees only keys up to its own position; a sliding cache may also start later
        start = 0 if window is None else 5
        alone = attention(q[:, :, j : j + 1], k[:, :, start : pos + 1], v[:, :, start : pos + 1],
                          Batch.single([0], offset=pos), key_start=start, scale=0.125, window=window)
        assert torch.equal(alone, together[:, :, j : j + 1]), j


def test_many_queries_use_sdpa(monkeypatch):
    monkeypatch.setattr(attention_mod, "KERNEL", None)  # any use of the kernel would fail
    L = KERNEL_MAX_QUERIES + 1
    q, k, v = inputs(1, 4, 2, L, L, 32, torch.float32)
    got = attention(q, k, v, Batch.single([0] * L), key_start=0, scale=0.2)
    ref = reference(q, k, v, Batch.single([0] * L), 0, 0.2)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def segmented(k, v, cuts, seed):
    """`k`, `v` [B, H, T, D] cut at key rows `cuts` into segments, each a strided view of a buffer of
    its own (as caches hold them: a trie snapshot, a frozen fork buffer, the own buffer with slack)."""
    gen = torch.Generator().manual_seed(seed)
    out, bounds = [], [0, *cuts, k.shape[2]]
    for a, b in zip(bounds, bounds[1:], strict=False):
        n, slack = b - a, int(torch.randint(0, 40, (1,), generator=gen))
        bk = torch.randn(k.shape[0], k.shape[1], n + slack, k.shape[3], generator=gen).to(k.dtype)
        bv = torch.randn(v.shape[0], v.shape[1], n + slack, v.shape[3], generator=gen).to(v.dtype)
        bk[:, :, :n], bv[:, :, :n] = k[:, :, a:b], v[:, :, a:b]
        out.append((bk[:, :, :n], bv[:, :, :n]))
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("L", "window", "softcap"), [(1, None, None), (9, None, 30.0), (4, 100, None)])
@pytest.mark.parametrize(
    "cuts", [(KEY_BLOCK,), (2 * KEY_BLOCK,), (90,), (54, 118, 182), (1, 2, 100, 101, 200, 229), (3, 3, 150)]
)
def test_segments_give_the_single_buffers_bits(dtype, L, window, softcap, cuts):
    """Shared segments then the sequence's own buffer (copy-on-write) read as one: the same bits as
    the single buffer, for cuts at key blocks and off them, one segment or many (empty ones too)."""
    T, key_start = 230, 10
    q, k, v = inputs(2, 8, 2, L, T, 64, dtype, seed=sum(cuts) + L)
    batch = Batch.ragged([[0] * L] * 2, [key_start + T - L, key_start + T - L - 7])
    kw = dict(key_start=key_start, scale=0.125, window=window, softcap=softcap)
    one = attention(q, k, v, batch, **kw)
    *prefix, (own_k, own_v) = segmented(k, v, list(cuts), seed=len(cuts))
    many = attention(q, own_k, own_v, batch, prefix=prefix, **kw)
    assert torch.equal(one, many)


def test_split_buffers_are_joined_where_the_kernel_does_not_run(monkeypatch):
    monkeypatch.setattr(attention_mod, "KERNEL", None)  # SDPA over the concatenation
    q, k, v = inputs(1, 4, 2, 30, 130, 32, torch.float32, seed=9)
    batch = Batch.single([0] * 30, offset=100)
    one = attention(q, k, v, batch, key_start=0, scale=0.2)
    prefix = [(k[:, :, :40], v[:, :, :40]), (k[:, :, 40:64], v[:, :, 40:64])]
    many = attention(q, k[:, :, 64:], v[:, :, 64:], batch, key_start=0, scale=0.2, prefix=prefix)
    assert torch.equal(one, many)


@needs_kernel
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None, max_examples=30)
@given(
    n_seq=st.integers(1, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    softcap=st.sampled_from([None, 20.0]),
    data=st.data(),
)
def test_property_packed_attention_equals_each_sequence_alone_bitwise(n_seq, dtype, softcap, data, isa):
    """Several sequences' queries (1 to KERNEL_MAX_QUERIES each) packed in one call, each over its own
    keys / values (a view into a larger buffer, at its own key_start, maybe after shared segments
    cut anywhere, maybe windowed): each sequence's output equals, bit for bit, its own `attention`
    call, and lies within float64-reference tolerance."""
    Hq, Hkv, D = 4, 2, 32
    g = torch.Generator().manual_seed(n_seq)
    hists, lens, positions, qs = [], [], [], []
    for _ in range(n_seq):
        L = data.draw(st.integers(1, KERNEL_MAX_QUERIES), label="queries")
        T = data.draw(st.integers(L, 150), label="keys")
        cuts = sorted(data.draw(st.lists(st.integers(0, T - L), max_size=3), label="segment cuts"))
        key_start = data.draw(st.integers(0, 70), label="key_start")
        window = data.draw(st.sampled_from([None, 8, 64]), label="window")
        keys = torch.randn(1, Hkv, T + 5, D, generator=g).to(dtype)
        values = torch.randn(1, Hkv, T + 5, D, generator=g).to(dtype)
        bounds = [0, *cuts, T]
        pieces = [(keys[:, :, a:b], values[:, :, a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        *prefix, (own_k, own_v) = pieces
        hists.append(AttentionHistory(own_k, own_v, key_start, window, tuple(prefix)))
        lens.append(L)
        positions.append(key_start + T - L)
        qs.append(torch.randn(1, Hq, L, D, generator=g).to(dtype))
    starts = [sum(lens[:i]) for i in range(n_seq)]
    batch = Packed([Batch.single([0] * n, offset=p) for n, p in zip(lens, positions, strict=True)])
    q = torch.cat(qs, dim=2)
    out = attention_packed(q, hists, starts, lens, batch.positions(), scale=D**-0.5, softcap=softcap)
    for i, (h, lo, n) in enumerate(zip(hists, starts, lens, strict=True)):
        alone = Batch.single([0] * n, offset=positions[i])
        want = attention(qs[i], h.keys, h.values, alone, key_start=h.key_start, scale=D**-0.5,
                         window=h.window, softcap=softcap, prefix=h.prefix)
        assert torch.equal(out[:, :, lo : lo + n], want)
        keys = torch.cat([k for k, _ in h.prefix] + [h.keys], dim=2)
        values = torch.cat([v for _, v in h.prefix] + [h.values], dim=2)
        ref = reference(qs[i], keys, values, alone, h.key_start, D**-0.5, h.window, softcap)
        tol = 1e-5 if dtype is torch.float32 else 2e-2
        torch.testing.assert_close(want.double(), ref, atol=tol, rtol=tol)


def test_packed_attention_declines_what_its_kernel_cannot_run():
    q, k, v = inputs(1, 4, 2, KERNEL_MAX_QUERIES + 1, 40, 32, torch.float32)
    batch = Packed([Batch.single([0] * q.shape[2], offset=39 - q.shape[2])])
    hist = AttentionHistory(k, v, 0, None)
    assert attention_packed(q, [hist], [0], [q.shape[2]], batch.positions(), scale=1.0) is None
