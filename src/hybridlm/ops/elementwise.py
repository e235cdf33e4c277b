"""Elementwise activations whose every row is computed as it is alone.

torch's CPU elementwise loops take two SIMD vectors at a time from the start of a call (or of a
thread's chunk, `GRAIN` elements) and hand the rest to a scalar loop, whose exp / tanh round
differently: in a [rows, width] tensor whose width is not a multiple of the vector span, a row's
numbers would depend on where it sits (measured, torch 2.13 on AVX-512: float32 silu / sigmoid / gelu
at widths 16 and 48, bf16 tanh-gelu at the widths up to 160 that are not multiples of 64, a float32
[rows, 1] sigmoid past 32 rows).
`elementwise_rows` lays the rows out so that each starts and ends on a vector boundary of its call,
so a decode row, a verify row and a packed row of several sequences get the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridlm.ops.linear import rowwise_applies
from hybridlm.ops.native import FEW_TOKENS

# Two AVX-512 vectors of bf16 / fp16; every narrower ISA's two-vector span (AVX2: 32 bf16, 16 float32;
# NEON: 16, 8) divides it, so the layout puts rows on vector boundaries on every CPU.
VECTOR_SPAN = 64
# at::internal::GRAIN_SIZE: a call over more elements is cut into per-thread chunks.
GRAIN = 32768


def elementwise_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn` (elementwise) over x [..., W], each row computed exactly as `fn` over that row alone in
    this layout: rows zero-padded to a multiple of `VECTOR_SPAN` elements, at most `GRAIN` elements
    per call (one row per call beyond). Inputs of more than `FEW_TOKENS` rows outside `rowwise()`
    (prefill) and non-CPU inputs take `fn` directly.

    Returns [..., W] in fn's dtype.
    """
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if not x.is_cpu or rows == 0 or (rows > FEW_TOKENS and not rowwise_applies(x)):
        return fn(x)
    span = -(-width // VECTOR_SPAN) * VECTOR_SPAN
    flat = x.reshape(rows, width)
    if span != width:
        flat = F.pad(flat, (0, span - width))
    per_call = max(1, GRAIN // span)
    if rows <= per_call:
        out = fn(flat)
    else:
        out = torch.cat([fn(flat[i : i + per_call]) for i in range(0, rows, per_call)])
    if span != width:
        out = out[:, :width]
    return out.reshape(x.shape)


def token_rows(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """`fn(*xs)` for tensors [B, L, ...] (the same B, L), each token computed by its own call where a
    token's numbers must not depend on the others (the rows `elementwise_rows` lays out: few-token
    steps, and any count under `rowwise()`): for functions that reduce within a token (a per-head norm)
    as well as map, whose vectorisation otherwise varies with the row count. Returns [B, L, ...]."""
    x = xs[0]
    b, length = x.shape[:2]
    rows = b * length
    if not x.is_cpu or rows <= 1 or (rows > FEW_TOKENS and not rowwise_applies(x)):
        return fn(*xs)
    flat = [t.reshape(rows, 1, *t.shape[2:]) for t in xs]
    out = torch.cat([fn(*(t[i : i + 1] for t in flat)) for i in range(rows)])
    return out.view(b, length, *out.shape[2:])
