"""Scaled dot-product attention over a cache history with composed masks.

The logical mask of a layer (causal, optionally a sliding window) is composed with where the
cache keeps its keys (`key_start`: absolute position of key row 0) and dispatched to SDPA's
no-mask or causal fast paths when the composed mask allows.

Few-query CPU inputs (decode, speculative verify) run a C kernel instead, whose result for a query
depends only on the keys it sees: it reads only those, in blocks aligned to absolute positions,
with an online softmax. SDPA's result for a query row also depends on how many rows share the
call (in bf16 ~20% of rows differed between a 9-row masked call and one-row calls), so a verify
pass would not compute what decoding computes, and speculative greedy output would drift.

Keys / values may come in pieces, read-only `prefix` segments shared between sequences (copy-on-
write, `cache/kv.py`) then the sequence's own rows: the kernel walks them as one buffer (same keys,
same order, same bits); every other path attends over their concatenation.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hybridlm.batch import Batch
from hybridlm.ops.native import FEW_TOKENS, NativeKernel, int64_array

# The few-query kernel: csrc/attention.c.
_i64 = ctypes.c_int64
KERNEL = NativeKernel(
    "attention",
    "attention.c",
    "hybridlm_attention",
    [ctypes.c_void_p, ctypes.c_void_p, _i64, ctypes.c_void_p, ctypes.c_void_p]
    + [_i64] * 12
    + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int],
    ctypes.c_int,
    fallback="scaled_dot_product_attention",
)
PACKED_KERNEL = NativeKernel(
    "attention",
    "attention.c",
    "hybridlm_attention_packed",
    [ctypes.c_void_p, _i64, _i64, ctypes.c_void_p, _i64] + [ctypes.c_void_p] * 5 + [_i64] * 5
    + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int],
    ctypes.c_int,
    fallback="one call per sequence",
)
KERNEL_MAX_QUERIES = FEW_TOKENS
SEG_FIELDS = 9  # int64 fields per segment of the kernel's table (csrc/attention.c SEG_FIELDS)
# Keys per block of the kernel (csrc/attention.c `KB`); blocks are aligned to absolute positions.
KEY_BLOCK = 64


class KeySegment(tuple):
    """A (keys, values) pair that is passed unchanged call after call (a shared copy-on-write segment,
    `cache/kv.py: SharedRows`): the kernel's table fields for it are computed once."""

    def __new__(cls, k: torch.Tensor, v: torch.Tensor) -> KeySegment:
        pair = super().__new__(cls, (k, v))
        pair.fields = _fields(k, v)
        return pair


def _fields(k: torch.Tensor, v: torch.Tensor) -> list[int]:
    return [k.data_ptr(), v.data_ptr(), k.shape[2], *k.stride()[:3], *v.stride()[:3]]


def _segment_table(segments) -> list[int]:
    """The kernel's segment table (csrc/attention.c): per (keys, values) segment, their addresses, the
    end of its key rows counted across the segments, and their (batch, head, row) strides."""
    table, end = [], 0
    for pair in segments:
        f = pair.fields if isinstance(pair, KeySegment) else _fields(*pair)
        end += f[2]
        table += [f[0], f[1], end, *f[3:]]
    return table


def _kernel_attention(q, k, v, batch, key_start, scale, window, softcap, prefix) -> torch.Tensor | None:
    """`attention` by the C kernel, or None where it does not apply."""
    B, Hq, L, D = q.shape
    segments = [*prefix, (k, v)]
    if not (
        L <= KERNEL_MAX_QUERIES
        and q.is_cpu
        and q.dtype in (torch.bfloat16, torch.float32)
        and all(sk.dtype is sv.dtype is q.dtype for sk, sv in segments)
        and q.stride(-1) == 1
        and all(sk.stride(-1) == sv.stride(-1) == 1 for sk, sv in segments)
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and q.requires_grad)
    ):
        return None
    fn = KERNEL.get()
    if fn is None:
        return None
    Hkv, Dv = k.shape[1], v.shape[-1]
    table = _segment_table(segments)
    end = table[-SEG_FIELDS + 2]
    out = torch.empty(B, Hq, L, Dv, dtype=q.dtype)
    qpos = batch.positions().to(torch.int64).contiguous()
    fn(q.data_ptr(), int64_array(table), len(segments), out.data_ptr(), qpos.data_ptr(), B, Hq, Hkv, L, end,
       D, Dv, *q.stride()[:3], key_start, window or 0, scale, softcap or 0.0, int(q.dtype is torch.bfloat16),
       torch.get_num_threads())
    return out


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
    prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
) -> torch.Tensor:
    """Causal (optionally windowed) GQA attention.

    q: [B, Hq, L, D] at positions `batch.positions()`; k, v: [B, Hkv, T, D] holding absolute
    positions [key_start, key_start + T), or, with `prefix` segments (keys, values) [B, Hkv, P_i, D]
    (in order, P = ΣP_i), positions [key_start + P, key_start + P + T) after the segments'
    [key_start, key_start + P).
    Returns [B, Hq, L, Dv] in q's dtype. Padded query rows produce finite values that callers
    discard; padded keys are never visible to real queries because they lie after every real query
    of their row.
    """
    out = _kernel_attention(q, k, v, batch, key_start, scale, window, softcap, prefix)
    if out is not None:
        return out
    if prefix:  # SDPA and the soft-cap path read one buffer: a transient concatenation
        k = torch.cat([pk for pk, _ in prefix] + [k], dim=2)
        v = torch.cat([pv for _, pv in prefix] + [v], dim=2)
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


def attention_packed(
    q: torch.Tensor,
    histories: list,
    starts: list[int],
    lens: list[int],
    positions: torch.Tensor,
    *,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """``attention`` of several sequences' queries packed end to end, in one C call, each over its
    own keys / values.

    q: [1, Hq, N, D]; sequence i's queries are rows [starts[i], starts[i] + lens[i]) (each
    lens[i] in [1, KERNEL_MAX_QUERIES]) at `positions` [1, N]; histories[i]: its
    `cache.kv.AttentionHistory` (keys / values [1, Hkv, T_i, D], key_start, window, prefix).
    Returns [1, Hq, N, Dv] with each sequence's outputs at its rows (other rows are unset), bit for
    bit what `attention` computes for it alone (the kernel runs each sequence's loop unchanged);
    None where the C kernel does not apply (callers then attend per sequence).
    """
    _, Hq, N, D = q.shape
    dtype = q.dtype
    segments = [[*h.prefix, (h.keys, h.values)] for h in histories]
    tensors = [t for segs in segments for pair in segs for t in pair]
    if not (
        q.shape[0] == 1
        and all(0 < n <= KERNEL_MAX_QUERIES for n in lens)
        and q.is_cpu
        and dtype in (torch.bfloat16, torch.float32)
        and q.stride(-1) == 1
        and all(t.dtype is dtype and t.stride(-1) == 1 and t.shape[0] == 1 for t in tensors)
        and len({(h.keys.shape[1], h.values.shape[-1]) for h in histories}) == 1
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and q.requires_grad)
    ):
        return None
    fn = PACKED_KERNEL.get()
    if fn is None:
        return None
    Hkv, Dv = histories[0].keys.shape[1], histories[0].values.shape[-1]
    out = torch.empty(1, Hq, N, Dv, dtype=dtype)
    table, views = [], []  # views: [sequences, 5] row-major, (first segment, segments, T, key_start, window)
    for h, segs in zip(histories, segments, strict=True):
        first = len(table) // SEG_FIELDS
        table += _segment_table(segs)
        views += [first, len(segs), table[-SEG_FIELDS + 2], h.key_start, h.window or 0]  # T: the last end
    qpos = positions.to(torch.int64).contiguous()
    fn(q.data_ptr(), q.stride(1), q.stride(2), out.data_ptr(), N, qpos.data_ptr(), int64_array(starts),
       int64_array(lens), int64_array(table), int64_array(views), len(histories), Hq, Hkv, D, Dv, scale,
       softcap or 0.0, int(dtype is torch.bfloat16), torch.get_num_threads())
    return out
