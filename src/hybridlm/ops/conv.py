"""Depthwise causal 1-D convolution with a carried input tail (Gated DeltaNet's qkv conv, LFM2's
short conv).

The layer's state is the last ``K-1`` inputs (the tail); prepending it to a new block of inputs makes
the convolution of the block equal to the convolution of the whole sequence.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridlm.ops.native import FEW_TOKENS, NativeKernel, checked_splits, packed_args, split_args

# Few-token inputs run one C loop (csrc/conv.c), rounding where the torch path does.
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
CONV_KERNEL = NativeKernel(
    "conv_short",
    "conv.c",
    "hybridlm_conv_short",
    [_p, _p, _p, _p, _p, _p, _p, _p, _i64, _p, _i64, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int,
     ctypes.c_int],
    ctypes.c_int,
    fallback="torch ops",
)
CONV_PACKED_KERNEL = NativeKernel(
    "conv_short",
    "conv.c",
    "hybridlm_conv_short_packed",
    [_p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    ctypes.c_int,
    fallback="one call per sequence",
)
# Most tokens a sequence of a packed call has (decode and verify rows; prefill chunks run alone).
FUSED_MAX_LEN = FEW_TOKENS


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    prior: Tensor,
    *,
    activation: str | None = None,
    query_lens: Tensor | Sequence[int] | None = None,
    splits: Sequence[int] = (),
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Convolve ``x`` causally, continuing from the inputs in ``prior``.

    ``out[b, t, c] = act(bias[c] + Σ_j weight[c, j] · xp[b, t + j, c])`` with
    ``xp = cat(prior, x)`` along time: transformers' ``F.conv1d(..., padding=K-1, groups=C)[..., :L]``
    when ``prior`` is zero, and its ``causal_conv1d_update`` with a conv state otherwise. As there,
    the inputs are cast to the weight's dtype and the result back to x's dtype.

    Args:
        x: ``[B, L, C]`` inputs.
        weight: ``[C, K]`` depthwise kernel; ``bias``: ``[C]`` or None.
        prior: ``[B, K-1, C]`` the last ``K-1`` inputs before ``x`` (zeros at the sequence start).
        activation: None or ``"silu"``.
        query_lens: real tokens per row (``[B]`` int tensor or ints, each ≤ L) of a right-padded
            batch; padded inputs never enter a tail (their outputs are computed but meaningless).
        splits: sorted token counts in ``[0, L]``, the same for every row, at which to report tails.

    Returns:
        ``(out, tail, boundary_tails)``: ``out`` ``[B, L, C]`` in x's dtype; ``tail`` ``[B, K-1, C]``
        the last ``K-1`` rows of ``cat(prior, x[b, :query_lens[b]])``; ``boundary_tails[i]`` the
        tail after ``splits[i]`` tokens. Tails are compact tensors in x's dtype, never views of x.
    """
    B, L, C = x.shape
    K = weight.shape[-1]
    if weight.shape != (C, K) or prior.shape != (B, K - 1, C):
        raise ValueError(f"expected weight {(C, K)} and prior {(B, K - 1, C)}, "
                         f"got {tuple(weight.shape)} and {tuple(prior.shape)}")
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    splits = checked_splits(splits, L)

    fused = _fused_conv(x, weight, bias, prior, activation, query_lens, splits)
    if fused is not None:
        return fused
    xp = torch.cat((prior.to(x.dtype), x), dim=1)  # [B, K-1+L, C]
    xw = xp.to(weight.dtype)
    if L == 0:
        y = xw.new_empty(B, 0, C)
    elif L == 1:
        # Decode: a weighted sum over K rows, accumulated in float32 and rounded once like the
        # convolution; 31 µs instead of 47 µs for the convolution (6144 channels, 1 CPU thread).
        y = (xw.float() * weight.t().float()).sum(1, keepdim=True)
        if bias is not None:
            y = y + bias.float()
        y = y.to(weight.dtype)
    else:
        # Viewed as [B, C, 1, K-1+L], xw is a channels-last image, which oneDNN's depthwise
        # convolution reads as it is; conv1d on the [B, C, T] transpose took 136 ms instead of
        # 2.2 ms (2048 x 6144 bf16, 1 CPU thread). The output is [B, L, C]-contiguous.
        y = F.conv2d(xw.transpose(1, 2).unsqueeze(2), weight[:, None, None, :], bias, groups=C)
        y = y.squeeze(2).transpose(1, 2)
    if activation == "silu":
        y = F.silu(y, inplace=True)  # y is ours: skip a second output buffer
    out = y.to(x.dtype)

    if query_lens is None:
        tail = xp[:, L:].clone()
        bounds = [xp[:, s : s + K - 1].clone() for s in splits]
    else:
        lens = torch.as_tensor(query_lens, device=x.device)
        tail = _gather_tails(xp, lens, K)
        bounds = [_gather_tails(xp, lens.clamp(max=s), K) for s in splits]
    return out, tail, bounds


def _fused_conv(x, weight, bias, prior, activation, query_lens, splits):
    """``causal_conv1d`` by the C kernel (any length: for long inputs it beat oneDNN's bf16 depthwise
    convolution ~200x without AVX-512, 512 x 6144, K = 4), or None where it does not apply."""
    B, L, C = x.shape
    K = weight.shape[-1]
    dtype = x.dtype
    if not (
        L > 0
        and K > 1
        and x.is_cpu
        and dtype in (torch.bfloat16, torch.float32)
        and weight.dtype is dtype
        and prior.dtype is dtype
        and (bias is None or bias.dtype is dtype)
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return None
    fn = CONV_KERNEL.get()
    if fn is None:
        return None
    x, prior, weight = x.contiguous(), prior.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    tail = torch.empty(B, K - 1, C, dtype=dtype)
    bounds = [torch.empty(B, K - 1, C, dtype=dtype) for _ in splits]
    bias = None if bias is None else bias.contiguous().data_ptr()
    fn(x.data_ptr(), prior.data_ptr(), weight.data_ptr(), bias, out.data_ptr(), tail.data_ptr(),
                *split_args(splits, bounds, query_lens), B, L, C, K, int(activation == "silu"),
                int(dtype is torch.bfloat16), torch.get_num_threads())
    return out, tail, bounds


def causal_conv1d_packed(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    priors: Sequence[Tensor],
    starts: Sequence[int],
    lens: Sequence[int],
    splits: Sequence[Sequence[int]],
    *,
    activation: str | None = None,
) -> tuple[Tensor, list[Tensor], list[list[Tensor]]] | None:
    """``causal_conv1d`` of several sequences packed end to end, in one C call.

    Args:
        x: ``[1, T, C]`` packed inputs; sequence i's are rows ``[starts[i], starts[i] + lens[i])``,
            each ``lens[i]`` in ``[1, FUSED_MAX_LEN]``.
        priors: sequence i's ``[1, K-1, C]`` tail before them; ``splits[i]`` its split offsets.
        weight, bias, activation: as in ``causal_conv1d``.

    Returns:
        ``(out, tails, boundary_tails)``: ``out`` ``[1, T, C]`` holds each sequence's outputs at its
        rows (other rows are unset); ``tails[i]`` ``[1, K-1, C]`` and ``boundary_tails[i][j]`` as
        ``causal_conv1d`` returns them for sequence i alone, bit for bit (the kernel runs each
        sequence's loop unchanged). None where the C kernel does not apply (callers then run
        ``causal_conv1d`` per sequence).
    """
    _, T, C = x.shape
    K = weight.shape[-1]
    dtype = x.dtype
    if not (
        x.shape[0] == 1
        and all(0 < n <= FUSED_MAX_LEN for n in lens)
        and K > 1
        and x.is_cpu
        and dtype in (torch.bfloat16, torch.float32)
        and weight.dtype is dtype
        and all(p.dtype is dtype and p.shape == (1, K - 1, C) for p in priors)
        and (bias is None or bias.dtype is dtype)
        and activation in (None, "silu")
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return None
    fn = CONV_PACKED_KERNEL.get()
    if fn is None:
        return None
    splits = [checked_splits(s, n) for s, n in zip(splits, lens, strict=True)]
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    priors = [p.contiguous() for p in priors]
    out = torch.empty_like(x)
    tails = [torch.empty(1, K - 1, C, dtype=dtype) for _ in priors]
    bounds = [[torch.empty(1, K - 1, C, dtype=dtype) for _ in s] for s in splits]
    n = len(priors)
    prior_ptrs = (ctypes.c_void_p * n)(*(p.data_ptr() for p in priors))
    tail_ptrs = (ctypes.c_void_p * n)(*(t.data_ptr() for t in tails))
    bound_ptrs, at, firsts, starts_, lens_ = packed_args(starts, lens, splits, bounds)
    fn(x.data_ptr(), prior_ptrs, weight.data_ptr(), None if bias is None else bias.data_ptr(),
       out.data_ptr(), tail_ptrs, bound_ptrs, at, firsts, starts_, lens_, n, C, K,
       int(activation == "silu"), int(dtype is torch.bfloat16), torch.get_num_threads())
    return out, tails, bounds


def _gather_tails(xp: Tensor, ends: Tensor, K: int) -> Tensor:
    """The tail after ``ends[b]`` tokens of each row, ``[B, K-1, C]``: rows ``ends[b] .. ends[b]+K-2`` of
    ``xp``, as a new tensor."""
    rows = ends.view(-1, 1) + torch.arange(K - 1, device=xp.device)
    return xp[torch.arange(xp.shape[0], device=xp.device).view(-1, 1), rows]
