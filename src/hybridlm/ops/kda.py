"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay, step by step and chunked.

Per batch row and head, with a float32 state ``S`` of shape ``[Dk, Dv]`` and for each token ``t``
(``g_t`` now a ``[Dk]`` vector of log decays, one per key channel)::

    S   = diag(exp(g_t)) S
    kv  = k_tᵀ S
    S   = S + k_t ⊗ (beta_t * (v_t - kv))
    o_t = (scale * q_t)ᵀ S

(transformers' ``recurrent_kimi_delta_attention``, state layout ``[B, H, Dk, Dv]``). With ``g_t``
the same in every channel this is Gated DeltaNet's rule (`ops.gated_delta`), whose chunked form
(run here with a decay per channel) and split checking this module shares.

Two algorithms: the step recurrence for a few tokens (decode, speculative verification, and never a
chunked call for one token) and a chunked form for prompts. A per-channel decay does not factor out
of ``k_i · k_j`` as a scalar one does (``exp(c_i - c_j)`` differs per channel), and the factored
form ``(k_i e^{c_i}) · (k_j e^{-c_j})`` overflows float32 once a chunk's decays sum below about -88
(Kimi's gate is unbounded, Ling's bounded at -5 a token). The chunked form therefore forms the
pairwise decays ``exp(c_i - c_j)`` (≤ 1 where they are used) explicitly, ``[C, C, Dk]`` per chunk,
on short chunks (``DEFAULT_CHUNK``) and a block of chunks at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hybridlm.ops.gated_delta import _checked_inputs, _chunked_scan
from hybridlm.ops.norms import l2_normalize

# Up to this many tokens the step recurrence runs (it costs one state pass per token; a chunked call
# pays the pairwise decays of a whole chunk even for a few tokens).
STEP_MAX_LEN = 4
# The pairwise decays cost C·Dk per token: 16 keeps them small next to the state products.
DEFAULT_CHUNK = 16
# Tokens whose chunk tensors are built at once (the [C, C, Dk] decays of 8 chunks of 16, 16 heads
# of 128 channels: 32 MiB in float32).
BLOCK_TOKENS = 128


def kda_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    *,
    scale: float | None = None,
    normalize_qk: bool = False,
    query_lens: Tensor | Sequence[int] | None = None,
    splits: Sequence[int] = (),
    chunk_size: int | None = None,
    inplace: bool = False,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Run KDA over ``L`` tokens from ``state``.

    Args:
        q, k: ``[B, L, H, Dk]``, any float dtype; L2-normalised in float32 here when
            ``normalize_qk`` (transformers' ``use_qk_l2norm_in_kernel``: x / sqrt(Σx² + 1e-6)).
        v: ``[B, L, H, Dv]``; the output takes its dtype.
        g: ``[B, L, H, Dk]`` log of the per-token, per-channel state decay (≤ 0), float32 ideally.
        beta: ``[B, L, H]`` write strength of each token.
        state: ``[B, H, Dk, Dv]`` state before the first token; only written when ``inplace``.
        scale: factor applied to q; ``Dk ** -0.5`` by default.
        query_lens: real tokens per row (each ≤ L) of a right-padded batch; later positions are
            identity steps (no decay, no write) with zero output. Padded inputs must be finite.
        splits: sorted token counts in ``[0, L]``, the same for every row, at which to report the
            state; they do not change ``o``.
        chunk_size: None picks the algorithm by ``L``; 1 forces the step recurrence; larger forces
            the chunked form with chunks of that many tokens.
        inplace: advance ``state`` (then a contiguous float32 tensor) in place, return it as final.

    Returns:
        ``(o, final_state, boundary_states)``: ``o`` ``[B, L, H, Dv]`` in v's dtype; ``final_state``
        float32 ``[B, H, Dk, Dv]``; ``boundary_states[i]`` a compact float32 state after
        ``splits[i]`` tokens.
    """
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    splits, valid, g, beta = _checked_inputs(q, k, v, g, q.shape, beta, state, splits, chunk_size, query_lens)
    scale = Dk**-0.5 if scale is None else scale
    if normalize_qk:
        q, k = l2_normalize(q.float()), l2_normalize(k.float())

    if chunk_size is None:
        chunk_size = 1 if L <= STEP_MAX_LEN else DEFAULT_CHUNK
    if inplace:
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError("inplace needs a contiguous float32 state")
        s = state.view(B * H, Dk, Dv)
    else:
        s = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True).view(B * H, Dk, Dv)
    if chunk_size == 1:
        o, bounds = _step_scan(q, k, v, g, beta, s, scale, splits)
    else:
        o, bounds = _chunked_scan(q, k, v, g, beta, s, scale, splits, chunk_size, BLOCK_TOKENS)
    if valid is not None:
        o = o.masked_fill(~valid[..., None, None], 0.0)
    final = state if inplace else s.view(B, H, Dk, Dv)
    return o, final, [b.view(B, H, Dk, Dv) for b in bounds]


def _step_scan(q, k, v, g, beta, s, scale, splits) -> tuple[Tensor, list[Tensor]]:
    """Token-by-token recurrence (shapes as in ``kda_rule``), advancing ``s`` ``[B*H, Dk, Dv]`` in
    place. Per token: decay the state's rows, read ``kᵀS``, write ``k ⊗ delta``, read the output."""
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    BH = B * H

    def per_step(x: Tensor, *shape: int) -> Tensor:
        # [B, L, H, *] -> float32 [L, B*H, *]
        return x.transpose(0, 1).reshape(L, BH, *shape).float()

    qs, ks = per_step(q, 1, Dk), per_step(k, 1, Dk)
    decay = per_step(g, Dk, 1).exp()
    bt = per_step(beta, 1)
    vs = per_step(v, Dv)
    out = torch.empty(L, BH, 1, Dv, dtype=torch.float32, device=v.device)
    bounds = [s.clone() for t in splits if t == 0]
    for t in range(L):
        s.mul_(decay[t])
        delta = (vs[t] - torch.bmm(ks[t], s).squeeze(1)).mul_(bt[t])
        s.baddbmm_(ks[t].transpose(1, 2), delta.unsqueeze(1))
        torch.baddbmm(out[t], qs[t], s, beta=0.0, alpha=scale, out=out[t])
        bounds.extend(s.clone() for u in splits if u == t + 1)
    o = out.view(L, B, H, Dv).transpose(0, 1).to(v.dtype, memory_format=torch.contiguous_format)
    return o, bounds
