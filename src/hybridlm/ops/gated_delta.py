"""The gated delta rule (Gated DeltaNet's recurrence), step by step and chunked.

Per batch row and head, with a float32 state ``S`` of shape ``[Dk, Dv]`` and for each token ``t``::

    S   = S * exp(g_t)
    kv  = k_tᵀ S
    S   = S + k_t ⊗ (beta_t * (v_t - kv))
    o_t = (scale * q_t)ᵀ S

(transformers' ``torch_recurrent_gated_delta_rule``, state layout ``[B, H, Dk, Dv]``).

Two algorithms give the same result within float32 rounding: a step recurrence, cheapest for a few
tokens (decode, speculative verification), and the chunked WY / UT form, which turns the scan into
a few matrix products per chunk of tokens. ``gated_delta_rule`` picks one by length.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridlm.ops.native import NativeKernel, checked_splits, packed_args, split_args
from hybridlm.ops.norms import l2_normalize

# Measured on 2 CPU cores, 16 heads x 128 x 128, batch 1, bf16 inputs:
# - the step recurrence costs ~90 µs per token (1 thread), a chunked call on a chunk fitted to the
#   input ~0.5 ms up to 8 tokens; they cross at 4-6 tokens, so up to STEP_MAX_LEN tokens run the step.
STEP_MAX_LEN = 4
# - 2048 tokens on 2 threads: chunk 16 -> 35.5 ms, 32 -> 34.6-36.5 ms, 64 -> 45 ms. Inputs shorter
#   than a chunk use the next power of two >= L instead (a longer chunk would be padding).
DEFAULT_CHUNK = 32
# - blocks of 128 or 256 tokens ran equally fast, 512 slower, the whole input at once ~2x slower.
BLOCK_TOKENS = 256


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    *,
    scale: float | None = None,
    query_lens: Tensor | Sequence[int] | None = None,
    splits: Sequence[int] = (),
    chunk_size: int | None = None,
    inplace: bool = False,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Run the gated delta rule over ``L`` tokens from ``state``.

    Args:
        q, k: ``[B, L, H, Dk]``, already L2-normalised and repeated to ``H`` heads; any float dtype.
        v: ``[B, L, H, Dv]``; the output takes its dtype.
        g: ``[B, L, H]`` log of the per-token state decay (≤ 0).
        beta: ``[B, L, H]`` write strength of each token (usually in (0, 1)).
        state: ``[B, H, Dk, Dv]`` state before the first token; only written when ``inplace``.
        scale: factor applied to q; ``Dk ** -0.5`` by default.
        query_lens: real tokens per row (``[B]`` int tensor or ints, each ≤ L) of a right-padded
            batch; later positions are identity steps (no decay, no write) and their outputs are
            zero. Padded q / k / v must still be finite. None means every row has ``L`` tokens.
        splits: sorted token counts in ``[0, L]``, the same for every row, at which to report the
            state. They do not change ``o``.
        chunk_size: None picks the algorithm by ``L``; 1 forces the step recurrence; a larger value
            forces the chunked form with chunks of that many tokens.
        inplace: advance ``state`` (then a contiguous float32 tensor) in place and return it as the
            final state. Saves writing a new state, a large part of a decode step.

    Returns:
        ``(o, final_state, boundary_states)``: ``o`` is ``[B, L, H, Dv]`` in v's dtype;
        ``final_state`` is a float32 ``[B, H, Dk, Dv]`` tensor, the state after each row's real
        tokens (a new tensor unless ``inplace``); ``boundary_states[i]`` is a compact float32
        ``[B, H, Dk, Dv]`` state after ``splits[i]`` tokens.
    """
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    splits, valid, g, beta = _checked_inputs(q, k, v, g, (B, L, H), beta, state, splits, chunk_size,
                                             query_lens)
    scale = Dk**-0.5 if scale is None else scale

    if chunk_size is None:
        chunk_size = 1 if L <= STEP_MAX_LEN else min(DEFAULT_CHUNK, 1 << (L - 1).bit_length())
    step = chunk_size == 1 and L > 0
    if inplace:
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError("inplace needs a contiguous float32 state")
        s = state.view(B * H, Dk, Dv)
    elif step:
        s = state.reshape(B * H, Dk, Dv).float()  # may alias state: the first step writes a new tensor
    else:
        s = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True).view(B * H, Dk, Dv)
    if step:
        o, s, bounds = _step_scan(q, k, v, g, beta, s, scale, splits, own_state=inplace)
    else:
        o, bounds = _chunked_scan(q, k, v, g[..., None], beta, s, scale, splits, chunk_size, BLOCK_TOKENS)
    if valid is not None:
        o = o.masked_fill(~valid[..., None, None], 0.0)
    final = state if inplace else s.view(B, H, Dk, Dv)
    return o, final, [b.view(B, H, Dk, Dv) for b in bounds]


def _checked_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    g_shape: tuple[int, ...],
    beta: Tensor,
    state: Tensor,
    splits: Sequence[int],
    chunk_size: int | None,
    query_lens: Tensor | Sequence[int] | None,
) -> tuple[list[int], Tensor | None, Tensor, Tensor]:
    """Check a delta-rule call's arguments (shapes as in ``gated_delta_rule``, ``g`` of ``g_shape``).

    Returns ``(splits, valid, g, beta)``: the checked splits, the ``[B, L]`` mask of real tokens (None
    without ``query_lens``) and g / beta with padded positions made identity steps.
    """
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (B, L, H) or g.shape != g_shape or beta.shape != (B, L, H):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if state.shape != (B, H, Dk, Dv):
        raise ValueError(f"state must be {(B, H, Dk, Dv)}, got {tuple(state.shape)}")
    splits = checked_splits(splits, L)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be None or >= 1, got {chunk_size}")
    valid = None
    if query_lens is not None:
        lens = torch.as_tensor(query_lens, device=q.device).view(B, 1)
        valid = torch.arange(L, device=q.device) < lens  # [B, L]
        # Identity steps: decay exp(0) = 1 and beta = 0 leave the state as it is.
        g = g.masked_fill(~valid.view(B, L, *(1,) * (g.dim() - 2)), 0.0)
        beta = beta.masked_fill(~valid[..., None], 0.0)
    return splits, valid, g, beta


def _step_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    s: Tensor,
    scale: float,
    splits: list[int],
    own_state: bool,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Token-by-token recurrence (shapes as in ``gated_delta_rule``) on ``s`` ``[B*H, Dk, Dv]``.

    Per token the state is touched three times (read ``kᵀS``, decay, rank-1 write) plus one read for
    the output; five kernel launches in all. ``s`` is updated in place when ``own_state``, otherwise
    the first step writes a new tensor (cheaper than copying the state first). Returns ``o``, the
    final state and the boundary states, all states ``[B*H, Dk, Dv]``.
    """
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    BH = B * H

    def per_step(x: Tensor, *shape: int) -> Tensor:
        # [B, L, H, *] -> float32 [L, B*H, *]: a view when B == 1 or L == 1.
        return x.transpose(0, 1).reshape(L, BH, *shape).float()

    qs, ks = per_step(q, 1, Dk), per_step(k, 1, Dk)
    decay = per_step(g, 1).exp()
    bt = per_step(beta, 1)
    vb = per_step(v, Dv) * bt  # beta·v
    db = decay * bt  # beta·exp(g): delta = beta·v - beta·exp(g)·kᵀS_old
    out = torch.empty(L, BH, 1, Dv, dtype=torch.float32, device=v.device)

    bounds = [s.clone() for t in splits if t == 0]
    for t in range(L):
        kt = ks[t]
        delta = torch.addcmul(vb[t], torch.bmm(kt, s).squeeze(1), db[t], value=-1.0)
        s = s.mul_(decay[t, :, :, None]) if own_state or t else s * decay[t, :, :, None]
        s.baddbmm_(kt.transpose(1, 2), delta.unsqueeze(1))
        torch.baddbmm(out[t], qs[t], s, beta=0.0, alpha=scale, out=out[t])
        bounds.extend(s.clone() for u in splits if u == t + 1)
    o = out.view(L, B, H, Dv).transpose(0, 1).to(v.dtype, memory_format=torch.contiguous_format)
    return o, s, bounds


def _chunked_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    s: Tensor,
    scale: float,
    splits: list[int],
    C: int,
    block_tokens: int,
) -> tuple[Tensor, list[Tensor]]:
    """Chunked WY / UT form over chunks of ``C`` tokens, shared by Gated DeltaNet and KDA (shapes as in
    ``gated_delta_rule``, but ``g`` ``[B, L, H, G]``: ``G = 1``, one log decay per head, or ``G = Dk``,
    one per key channel as in ``ops.kda``).

    Advances ``s`` ``[B*H, Dk, Dv]`` in place; returns ``o`` and the boundary states ``[B*H, Dk, Dv]``.

    Within a chunk, with ``c_i`` the cumulative log decay up to token ``i`` and ``S₀`` the state at
    the chunk start, the delta rule's writes ``u_i = beta_i (v_i - (e^{c_i} ⊙ k_i)ᵀ S₀ - Σ_{j<i} A_ij u_j)``
    solve the unit lower-triangular system ``(I + A) u = beta·v - (beta·e^c ⊙ k) S₀`` with
    ``A_ij = beta_i Σ_d k_id k_jd exp(c_id - c_jd)`` for ``j < i``. Everything except the ``S₀`` terms
    is independent of the state and computed for many chunks at once; the sequential loop over chunks
    keeps two batched products and a decay::

        u   = T·beta·v - (T·(beta·e^c ⊙ k)) S₀        with T = (I + A)⁻¹
        o_i = scale (e^{c_i} ⊙ q_i)ᵀ S₀ + Σ_{j≤i} P_ij u_j     P_ij = scale Σ_d q_id k_jd exp(c_id - c_jd)
        S₁  = diag(e^{c_last}) S₀ + Σ_j (e^{c_last - c_j} ⊙ k_j) u_jᵀ

    Tokens are processed in blocks of ``block_tokens`` so that the precomputed tensors stay
    in cache and no large temporaries are allocated (fresh large allocations page-fault on CPU).
    """
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    per_channel = g.shape[-1] > 1
    dev = q.device
    o = torch.empty(B, L, H, Dv, dtype=v.dtype, device=dev)
    upper = torch.ones(C, C, dtype=torch.bool, device=dev).triu_(1)
    eye = torch.eye(C, dtype=torch.float32, device=dev)
    bounds = []
    pending = [t for t in splits if t < L]
    block = -(-block_tokens // C) * C

    def decayed(a: Tensor, b: Tensor, pair: Tensor) -> Tensor:
        """``Σ_d a_id b_jd pair_ijd``: a per-channel decay does not factor out of the dot product."""
        if per_channel:
            return torch.einsum("nbid,nbjd,nbijd->nbij", a, b, pair)
        return torch.matmul(a, b.transpose(-1, -2)).mul_(pair.squeeze(-1))

    for b0 in range(0, L, block):
        n_tok = min(block, L - b0)
        qc, kc, vc, gc, bc = (_load_chunks(x, b0, n_tok, C) for x in (q, k, v, g, beta))
        N = gc.shape[0]
        gc = gc.cumsum_(2)  # [N, BH, C, G]: log decay from the chunk start through token i
        g_last = gc[:, :, -1:]
        # exp(c_i - c_j) for j ≤ i, zero above the diagonal (masked after exp, never exp(-inf)):
        # [N, BH, C, C, G].
        pair = _exp(gc[:, :, :, None] - gc[:, :, None, :]).masked_fill_(upper[..., None], 0.0)
        kb = kc * bc[..., None]
        # solve_triangular with unitriangular=True ignores the diagonal of the decayed kb kᵀ, so this
        # is I + A as far as the solve is concerned. One solve against the identity, then plain
        # products, is much cheaper than solving for the Dk + Dv right-hand sides directly.
        T = torch.linalg.solve_triangular(decayed(kb, kc, pair), eye, upper=False, unitriangular=True)
        exp_c = _exp(gc)
        w = torch.matmul(T, kb.mul_(exp_c)).neg_()  # -(T·(beta·e^c ⊙ k))  [N, BH, C, Dk]
        u = torch.matmul(T, vc.mul_(bc[..., None]))  # T·beta·v, becomes u in the loop  [N, BH, C, Dv]
        # A per-head decay is a [C, 1] column: scaling it first saves a pass over q.
        q_read = qc * exp_c * scale if per_channel else qc * (scale * exp_c)
        inter = torch.empty_like(u)  # (scale·e^c ⊙ q) S₀
        k_write = kc * _exp(g_last - gc)  # e^{c_last - c} ⊙ k
        chunk_decay = _exp(g_last).transpose(-1, -2)  # [N, BH, G, 1]

        for n in range(N):
            start = b0 + n * C
            u[n].baddbmm_(w[n], s)
            torch.bmm(q_read[n], s, out=inter[n])
            while pending and pending[0] < start + C:
                m = pending.pop(0) - start
                bounds.append(s.clone() if m == 0 else _mid_chunk_state(s, kc[n], gc[n], u[n], m))
            s.mul_(chunk_decay[n]).baddbmm_(k_write[n].transpose(-1, -2), u[n])

        P = decayed(qc, kc, pair).mul_(scale)
        inter.view(-1, C, Dv).baddbmm_(P.view(-1, C, C), u.view(-1, C, Dv))
        _store_chunks(o, inter, b0, n_tok)
    # Padding tokens are identity steps, so the state after the last chunk is the state at L.
    bounds.extend(s.clone() for t in splits if t == L)
    return o, bounds


def _exp(x: Tensor) -> Tensor:
    """exp of log decays (≤ 0; positive entries only occur where the result is masked), clamped to
    [-80, 0] first: torch's CPU exp takes a slow path, 60-200x slower, on inputs whose result
    underflows or overflows (flush-to-zero does not help), and exp(-80) ≈ 2e-35 is as good as zero."""
    return x.clamp(-80.0, 0.0).exp_()


def _load_chunks(x: Tensor, b0: int, n: int, C: int) -> Tensor:
    """Tokens ``b0 .. b0+n`` of ``x`` ``[B, L, H, *]`` as float32 ``[N, B*H, C, *]``, zero-padded to
    ``N = ceil(n / C)`` chunks (zero beta and g make the padding identity steps)."""
    B, _, H, *tail = x.shape
    full, rem = divmod(n, C)
    out = torch.empty(full + (rem > 0), B, H, C, *tail, dtype=torch.float32, device=x.device)
    rest = range(4, 4 + len(tail))
    if full:
        out[:full].copy_(x[:, b0 : b0 + full * C].unflatten(1, (full, C)).permute(1, 0, 3, 2, *rest))
    if rem:
        out[full, :, :, :rem].copy_(x[:, b0 + full * C : b0 + n].transpose(1, 2))
        out[full, :, :, rem:].zero_()
    return out.view(-1, B * H, C, *tail)


def _store_chunks(o: Tensor, y: Tensor, b0: int, n: int) -> None:
    """Write tokens ``b0 .. b0+n`` of ``o`` ``[B, L, H, D]`` from chunked ``y`` ``[N, B*H, C, D]``."""
    B, _, H, D = o.shape
    C = y.shape[2]
    full, rem = divmod(n, C)
    y = y.view(-1, B, H, C, D)
    if full:
        o[:, b0 : b0 + full * C].unflatten(1, (full, C)).copy_(y[:full].permute(1, 0, 3, 2, 4))
    if rem:
        o[:, b0 + full * C : b0 + n].copy_(y[full, :, :, :rem].transpose(1, 2))


def _mid_chunk_state(s0: Tensor, k: Tensor, c: Tensor, u: Tensor, m: int) -> Tensor:
    """State after the first ``m`` tokens of a chunk, built from the chunk's own writes so that a split
    inside a chunk leaves the chunking, and the output, unchanged::

        S_m = diag(e^{c_{m-1}}) S₀ + Σ_{j<m} (e^{c_{m-1} - c_j} ⊙ k_j) u_jᵀ

    ``s0`` ``[B*H, Dk, Dv]`` is the state at the chunk start, ``k`` ``[B*H, C, Dk]``, ``c`` ``[B*H, C, G]``
    the cumulative log decay and ``u`` ``[B*H, C, Dv]`` the chunk's writes (already solved).
    """
    c_m = c[:, m - 1 : m]  # [BH, 1, G]
    k_m = (k[:, :m] * _exp(c_m - c[:, :m])).transpose(1, 2)
    return torch.baddbmm(s0 * _exp(c_m).transpose(1, 2), k_m, u[:, :m])


# A Gated DeltaNet layer from its conv output to the scan output, fused in C (csrc/gated_delta.c).
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
GDN_KERNEL = NativeKernel(
    "gdn_scan",
    "gated_delta.c",
    "hybridlm_gdn_scan",
    [_p, _p, _p, _p, _p, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float,
     ctypes.c_int, ctypes.c_int, ctypes.c_int],
    ctypes.c_int,
    fallback="the composed torch ops",
)
GDN_PACKED_KERNEL = NativeKernel(
    "gdn_scan",
    "gated_delta.c",
    "hybridlm_gdn_scan_packed",
    [_p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, ctypes.c_float,
     ctypes.c_int, ctypes.c_int, ctypes.c_int],
    ctypes.c_int,
    fallback="one call per sequence",
)

# Measured (16 heads of 128 x 128, bf16, 2 threads): the fused scan costs ~93 µs for one token,
# 18 µs per token at 32 tokens and 15 µs per token from 128 on; the composed ops 216, 33 and 26-39 µs
# (step recurrence below 5 tokens, chunked form above). Model inputs longer than FUSED_MAX_LEN still
# take the chunked form: its rounding follows transformers' own chunked kernel, and on random MoE
# checkpoints in bf16 the fused scan's (equally accurate, differently rounded) outputs flipped 1.5%
# of argmaxes against transformers where the chunked form flipped none. Replay, which has no such
# reference, runs the fused scan at any length (`fused_max_len=None`).
FUSED_MAX_LEN = 64


def gated_delta_net_scan(
    x: Tensor,
    ab: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    *,
    k_heads: int,
    k_dim: int,
    v_heads: int,
    v_dim: int,
    query_lens: Tensor | Sequence[int] | None = None,
    splits: Sequence[int] = (),
    inplace: bool = False,
    fused_max_len: int | None = FUSED_MAX_LEN,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """A Gated DeltaNet layer's scan from its projections: q / k L2-normalised and repeated to the
    value heads, ``g = -exp(A_log) · softplus(a + dt_bias)``, ``beta = sigmoid(b)``, then
    ``gated_delta_rule``.

    Args:
        x: ``[B, L, 2·Hk·Dk + Hv·Dv]`` the conv output, q ‖ k ‖ v.
        ab: ``[B, L, 2·Hv]`` the raw gate projections a ‖ b, in x's dtype.
        A_log, dt_bias: ``[Hv]`` the layer's parameters.
        state, query_lens, splits, inplace: as in ``gated_delta_rule``.
        fused_max_len: longest input the fused CPU kernel runs (None: any).

    Returns:
        ``(o [B, L, Hv, Dv] in x's dtype, final_state, boundary_states)`` as ``gated_delta_rule``.
    """
    B, L, _ = x.shape
    fits = fused_max_len is None or fused_max_len >= L
    fn = GDN_KERNEL.get() if fits and _fused_applies(x, ab, A_log, dt_bias, state, L, inplace) else None
    if fn is None:
        return _composed_scan(x, ab, A_log, dt_bias, state, k_heads, k_dim, v_heads, v_dim,
                              query_lens, splits, inplace)
    splits = checked_splits(splits, L)
    if not inplace:
        state = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    x, ab = x.contiguous(), ab.contiguous()
    o = torch.empty(B, L, v_heads, v_dim, dtype=x.dtype)
    bounds = [torch.empty(state.shape, dtype=torch.float32) for _ in splits]
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    fn(x.data_ptr(), ab.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(), state.data_ptr(),
                o.data_ptr(), *split_args(splits, bounds, query_lens), B, L, k_heads, v_heads, k_dim, v_dim,
                k_dim**-0.5, int(x.dtype is torch.bfloat16), int(A_log.dtype is torch.bfloat16),
                torch.get_num_threads())
    return o, state, bounds


def _fused_applies(x: Tensor, ab: Tensor, A_log: Tensor, dt_bias: Tensor, state: Tensor, L: int,
                   inplace: bool) -> bool:
    return (
        L > 0
        and x.is_cpu
        and x.dtype in (torch.bfloat16, torch.float32)
        and ab.dtype is x.dtype
        and A_log.dtype in (torch.bfloat16, torch.float32)
        and dt_bias.dtype is A_log.dtype
        and state.dtype is torch.float32
        and (state.is_contiguous() or not inplace)
        and not torch.compiler.is_compiling()
    )


def _composed_scan(x, ab, A_log, dt_bias, state, k_heads, k_dim, v_heads, v_dim, query_lens, splits, inplace):
    """``gated_delta_net_scan`` from torch ops (any device, any length)."""
    B, L, _ = x.shape
    key_dim = k_heads * k_dim
    q, k, v = torch.split(x, [key_dim, key_dim, v_heads * v_dim], dim=-1)
    q = l2_normalize(q.reshape(B, L, k_heads, k_dim).float())
    k = l2_normalize(k.reshape(B, L, k_heads, k_dim).float())
    v = v.reshape(B, L, v_heads, v_dim)
    if v_heads != k_heads:
        rep = v_heads // k_heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    a, b = ab.split(v_heads, dim=-1)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return gated_delta_rule(q, k, v, g, beta, state, query_lens=query_lens, splits=splits, inplace=inplace)


def gated_delta_net_scan_packed(
    x: Tensor,
    ab: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    states: Sequence[Tensor],
    starts: Sequence[int],
    lens: Sequence[int],
    splits: Sequence[Sequence[int]],
    *,
    k_heads: int,
    k_dim: int,
    v_heads: int,
    v_dim: int,
) -> tuple[Tensor, list[list[Tensor]]] | None:
    """``gated_delta_net_scan(..., inplace=True)`` of several sequences packed end to end, in one C
    call parallel over sequences x heads.

    Args:
        x: ``[1, T, 2·Hk·Dk + Hv·Dv]`` packed conv outputs, ab ``[1, T, 2·Hv]``; sequence i's rows are
            ``[starts[i], starts[i] + lens[i])``, each ``lens[i]`` in ``[1, FUSED_MAX_LEN]``.
        states: sequence i's own ``[1, Hv, Dk, Dv]`` contiguous float32 state, advanced in place.
        splits: sequence i's split offsets.

    Returns:
        ``(o, boundary_states)``: ``o`` ``[1, T, Hv, Dv]`` holds each sequence's outputs at its rows
        (other rows are unset), ``boundary_states[i][j]`` the state after ``splits[i][j]`` tokens; each
        sequence's numbers are bit for bit those of ``gated_delta_net_scan`` on it alone (the kernel
        runs the same per-head loop). None where the C kernel does not apply (callers then run one
        call per sequence).
    """
    _, T, _ = x.shape
    shape = (1, v_heads, k_dim, v_dim)
    if not (
        x.shape[0] == 1
        and all(0 < n <= FUSED_MAX_LEN for n in lens)
        and all(s.shape == shape and s.dtype is torch.float32 and s.is_contiguous() for s in states)
        and _fused_applies(x, ab, A_log, dt_bias, states[0], T, True)
    ):
        return None
    fn = GDN_PACKED_KERNEL.get()
    if fn is None:
        return None
    splits = [checked_splits(s, n) for s, n in zip(splits, lens, strict=True)]
    x, ab = x.contiguous(), ab.contiguous()
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    o = torch.empty(1, T, v_heads, v_dim, dtype=x.dtype)
    bounds = [[torch.empty(shape, dtype=torch.float32) for _ in s] for s in splits]
    n = len(states)
    state_ptrs = (ctypes.c_void_p * n)(*(s.data_ptr() for s in states))
    fn(x.data_ptr(), ab.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(), state_ptrs, o.data_ptr(),
       *packed_args(starts, lens, splits, bounds), n, k_heads, v_heads, k_dim, v_dim, k_dim**-0.5,
       int(x.dtype is torch.bfloat16), int(A_log.dtype is torch.bfloat16), torch.get_num_threads())
    return o, bounds
