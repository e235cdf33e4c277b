"""Elementwise activations whose every row is computed as it is alone.

torch's CPU elementwise loops take two SIMD vectors at a time from the start of a call (or of a
thread's chunk, `GRAIN` elements) and hand the rest to a scalar loop, whose exp / tanh round
differently: in a [rows, width] tensor whose width is not a multiple of the vector span, a row's
numbers would depend on where it sits (measured, torch 2.13 on AVX-512: float32 silu / sigmoid / gelu
at widths 16 and 48, bf16 tanh-gelu at the widths up to 160 that are not multiples of 64, a float32
[rows, 1] sigmoid past 32 rows).
`elementwise_rows` lays the rows out so that each starts and ends on a vector boundary of its call,
so a decode row, a verify row and a packed row of several sequences get the same bits.
`gated_rows` is a gated MLP's silu(gate) · up on those rows, by the experts kernels' activation (a
C call), so a shared expert computed apart has the bits it has inside the experts kernels.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridlm.ops.linear import rowwise_applies
from hybridlm.ops.native import FEW_TOKENS, NativeKernel

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


_p, _i64 = ctypes.c_void_p, ctypes.c_int64
GATED_SILU_KERNEL = NativeKernel(
    "moe", "moe.c", "hybridlm_gated_silu", [_p, _i64, _p, _i64, _p, _i64, _i64], None,
    fallback="torch's silu and multiply",
)


def gated_rows(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor
               ) -> torch.Tensor:
    """act(gate) · up for gate, up [..., I] of one shape, each row as alone: on the rows `elementwise_rows`
    lays out (few, or any number inside `rowwise`) of bf16 CPU silu, one C call computing silu rounded
    to bf16 times up rounded to bf16 (torch's roundings; its exp is the kernels' `exp_fast`, so the bits
    are those the experts kernels give an expert's hidden rows); else `elementwise_rows(act, gate) * up`.
    Returns [..., I] in gate's dtype."""
    width = gate.shape[-1]
    rows = gate.numel() // width if width else 0
    fn = GATED_SILU_KERNEL.get() if act is F.silu else None
    if (
        fn is None
        or rows == 0
        or not (gate.dtype is up.dtype is torch.bfloat16 and gate.is_cpu and up.is_cpu)
        or gate.shape != up.shape
        or (rows > FEW_TOKENS and not rowwise_applies(gate))
        or (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
        or torch.compiler.is_compiling()
    ):
        return elementwise_rows(act, gate) * up
    # rows of equal stride (a fused product's halves are views of one [rows, 2·I] tensor)
    gate, up = gate.reshape(rows, width), up.reshape(rows, width)
    if gate.stride(1) != 1 or up.stride(1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(rows, width, dtype=torch.bfloat16)
    fn(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows, width)
    return out.view(*up.shape[:-1], width)


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
