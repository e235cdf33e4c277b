"""Scaled dot-product attention over a cache history with composed masks.

The logical mask of a layer (causal, optionally a sliding window) is composed with where the
cache keeps its keys (`key_start`: absolute position of key row 0) and dispatched to SDPA's
no-mask or causal fast paths when the composed mask allows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridlm.batch import Batch


def _mask(batch: Batch, key_start: int, n_keys: int, window: int | None) -> torch.Tensor | str | None:
    """None (every key visible), "causal" (SDPA's top-left causal) or a bool mask [B, 1, L, T]."""
    length = batch.length
    if len(set(batch.offsets)) == 1:
        q0 = batch.offsets[0]
        fits_window = window is None or n_keys <= window
        if length == 1 and key_start + n_keys == q0 + 1 and fits_window:
            return None
        if key_start == q0 and n_keys == length and (window is None or length <= window):
            return "causal"

    def build():
        qpos = batch.positions()[:, None, :, None]
        kpos = torch.arange(key_start, key_start + n_keys, device=batch.device)[None, None, None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        return allowed

    return batch.memoize(("attn_mask", key_start, n_keys, window), build)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Batch,
    *,
    key_start: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) GQA attention.

    q: [B, Hq, L, D] at positions `batch.positions()`; k, v: [B, Hkv, T, D] holding absolute
    positions [key_start, key_start + T). Returns [B, Hq, L, Dv] in q's dtype. Padded query rows
    produce finite values that callers discard; padded keys are never visible to real queries
    because they lie after every real query of their row.
    """
    mask = _mask(batch, key_start, k.shape[2], window)
    if softcap is None:
        gqa = q.shape[1] != k.shape[1]
        if mask is None or isinstance(mask, str):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=mask == "causal", scale=scale, enable_gqa=gqa
            )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask == "causal":
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)
