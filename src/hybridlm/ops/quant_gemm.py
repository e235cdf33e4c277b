"""Integer prefill for `QuantLinear`: int8 activations × int8 / int4 weights, exact int32 sums.

On a CPU without AMX the bf16 GEMM runs at ≈ 0.2 TFLOP/s (AVX-512) or ≈ 0.1 (AVX2) while integer dot
products run several times faster — AVX-512 VNNI's vpdpbusd ≈ 1.3 TOP/s, AVX2's vpmaddubsw + vpmaddwd
(what llama.cpp's AVX2 prompts use) — so prefill (more than ``FEW_TOKENS`` rows) quantizes its
activations, as llama.cpp does for its integer dot products:

- each activation row is quantized symmetrically to int8 per block of inputs — `ACT_BLOCK` against
  int8 weights, the weight group against int4 weights: ``xs = max|x| / 127``, ``xq = round(x / xs)``;
- the C kernels of ``csrc/quant_prefill.c`` read the weights in their decode layout; each block's
  sum is exact in int32, the blocks are summed in float32 in order, times the scales, rounded to
  bf16 once.

Integer sums do not depend on blocking, so a row's output never depends on the other rows of the
call (prefill is row independent too). Decode-shaped calls (up to ``FEW_TOKENS`` rows) keep bf16
activations (``csrc/quant.c``) for int8 weights; int4 decode rows take the integer kernels too
(`integer_int4_decode`). Elsewhere — CUDA, other dtypes, neither AVX-512 VNNI nor AVX2,
``HYBRIDLM_COMPILE=0``,
or ``HYBRIDLM_INT8_PREFILL=0`` (prefill numerics as close to decode's as bf16 allows, at the bf16
GEMM's speed) — `QuantLinear` keeps its dequantized bf16 path.

The price, measured by ``hybridlm bench quality`` (see `ACT_BLOCK`): with int8 weights the KL to
bf16 grows by about half (per row it would nearly quadruple), beside int4 weights' own error it is
negligible.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import AbstractContextManager

import torch

from hybridlm.ops.native import NativeKernel, ThreadFlag, int64_array, row_pointers

__all__ = [
    "int4_prefill", "int4_prefill_grouped", "int8_prefill", "prefill_applies", "prompt_rows",
    "prompt_rows_on", "integer_int4_decode", "integer_prefill", "quantize_activations",
]

# Inputs per activation scale against int8 weights. Measured on the random Qwen3.5-0.8B preset (512
# positions, KL to bf16 / top-1): bf16 activations 0.0026 / 73 %; int8 per row 0.0098 / 56 %, per 256
# inputs 0.0056 / 64 %, per 64 0.0042 / 70 %. int4 weights use their own group size (their error
# dwarfs the activations': KL 0.1642 with bf16 activations, 0.1647 with int8 per group of 64).
ACT_BLOCK = 64

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
INT4_PREFILL = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_prefill_int4_bf16",
    [_p, _i64, _p, _p, _int, _p, _p, _i64, _i64, _i64, _int], _int,
    fallback="dequantized bf16 prefill",
)
INT4_GROUPED = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_prefill_int4_grouped",
    [_p, _p, _p, _p, _p, _int, _p, _i64, _i64, _i64, _i64, _int], _int,
    fallback="one int4 product at a time",
)
QUANTIZE_ROWS = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_quantize_rows", [_p, _i64, _i64, _i64, _p, _p, _int], None,
    fallback="torch activation quantization",
)
INT8_PREFILL = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_prefill_int8",
    [_p, _p, _i64, _p, _p, _p, _p, _i64, _i64, _i64, _int], _int,
    fallback="dequantized bf16 prefill",
)
AVAILABLE = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_prefill_available", [], _i64,  # not a status: 1 or 0
    fallback="dequantized bf16 prefill",
)


def integer_int4_decode() -> bool:
    """Whether int4 decode rows take the integer kernels as well: wherever they are built (AVX-512 VNNI,
    AVX2), unless ``HYBRIDLM_INT8_PREFILL=0``. They read every cold int4 product of a decode step
    faster than quant.c's float tiles (2 Xeon threads: 8224 x 1024 22.2 GB/s against 17.3, the 248k-row
    head 21.8 against 16.4; on Zen 3 about twice the 8-wide float tile), a Qwen3.5-MoE int4 step ran
    49.1 ms against 54.0, and the activations' int8 rounding adds nothing to int4's own error (see
    `ACT_BLOCK`); a decode row then has the bits of the same row prefilled."""
    return integer_prefill() and os.environ.get("HYBRIDLM_INT8_PREFILL", "1") != "0"


def integer_prefill() -> bool:
    """Whether the integer prefill kernels are built for this CPU (AVX-512 VNNI or AVX2), i.e. pay."""
    fn = AVAILABLE.get()
    return fn is not None and bool(fn())


_PROMPT = ThreadFlag()


def prompt_rows() -> AbstractContextManager[None]:
    """Inside, (on this thread) every row is a prompt row: `QuantLinear` takes the integer path however
    few rows a call has, so a prompt suffix after a cached prefix (or any prefill chunk) computes each
    row exactly as a one-piece prefill does. The engine runs its prefill chunks under it; decode and
    verify rows stay outside, on the bf16-activation decode kernels."""
    return _PROMPT.raised()


def prompt_rows_on() -> bool:
    """Whether this thread runs inside `prompt_rows`."""
    return bool(_PROMPT)


def prefill_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 CPU input, CPU weights, integer prefill kernels, not traced by torch.compile, not turned off by
    ``HYBRIDLM_INT8_PREFILL=0`` (callers check the row count)."""
    return (
        x.dtype is torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and not torch.compiler.is_compiling()
        and os.environ.get("HYBRIDLM_INT8_PREFILL", "1") != "0"
        and integer_prefill()
    )


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq int8 [M, K], xs float32 [M, K / block]): symmetric int8 per row and block of
    `block` consecutive inputs, ``xs = max|x| / 127`` (the smallest normal float for an all-zero
    block), ``xq = round(x / xs)`` (half to even), so x ≈ xq · xs."""
    m, k = x.shape
    xf = x.float().view(m, k // block, block)
    xs = (xf.abs().amax(dim=2) / 127.0).clamp_min_(torch.finfo(torch.float32).tiny)
    xq = torch.round(xf / xs[..., None]).clamp_(-127, 127).to(torch.int8)
    return xq.view(m, k), xs


def _quantized(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` of a bf16 CPU x, by the C kernel (the same numbers, one pass)."""
    fn = QUANTIZE_ROWS.get()
    if fn is None:
        return quantize_activations(x, block)
    m, k = x.shape
    x = x.contiguous()
    xq = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, k // block, dtype=torch.float32)
    fn(x.data_ptr(), m, k, block, xq.data_ptr(), xs.data_ptr(), torch.get_num_threads())
    return xq, xs


def int8_prefill(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] bf16, qweight [N, K] int8, scales [N] float32, bias [N] bf16 or None -> [M, N] bf16:
    ``bf16(scales[n] · Σ_b xs[m, b] · Σ_{k ∈ b} xq[m, k] q[n, k] + bias[n])`` over blocks b of
    `ACT_BLOCK` inputs (the whole row where K is not a multiple), the inner sums exact in int32;
    None when the kernel is not built or K % 4 != 0."""
    fn = INT8_PREFILL.get()
    m, k = x.shape
    block = ACT_BLOCK if k % ACT_BLOCK == 0 else k
    if fn is None or block % 4:
        return None
    xq, xs = _quantized(x, block)
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    bias_ptr = None if bias is None else bias.data_ptr()
    fn(xq.data_ptr(), xs.data_ptr(), m, qweight.data_ptr(), scales.data_ptr(), bias_ptr, y.data_ptr(),
       n, k, block, torch.get_num_threads())
    return y


def int4_prefill(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] bf16, qweight [N, K / 2] packed int4 panels, scales [N, K / group_size] bf16 / fp16 in
    panel order, bias [N] bf16 or None -> [M, N] bf16: ``bf16(Σ_g xs[m, g] · scales[n, g] ·
    Σ_{k ∈ g} xq[m, k] q[n, k] + bias[n])``; None when the kernel is not built."""
    fn = INT4_PREFILL.get()
    if fn is None:
        return None
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    bias_ptr = None if bias is None else bias.data_ptr()
    fp16 = int(scales.dtype is torch.float16)
    # the kernel quantizes the rows itself (`_quantized`'s numbers): one call, where a decode row's
    # microseconds count
    fn(x.data_ptr(), m, qweight.data_ptr(), scales.data_ptr(), fp16, bias_ptr, y.data_ptr(), n, k, group_size,
       torch.get_num_threads())
    return y


def int4_prefill_grouped(xs: list[torch.Tensor], qweights: list[torch.Tensor], scales: list[torch.Tensor],
                         group_size: int) -> torch.Tensor | None:
    """``torch.cat([int4_prefill(x, q, s, group_size, None) ...])`` over products of one shape (every
    qweight [N, K / 2], every scales of one dtype) in one kernel call: [Σ M_i, N], product i's rows
    after product i - 1's, each with the bits `int4_prefill` gives it; None when the kernel is not
    built."""
    fn = INT4_GROUPED.get()
    if fn is None:
        return None
    quantized = [_quantized(x, group_size) for x in xs]
    n, k = qweights[0].shape[0], xs[0].shape[1]
    y = torch.empty(sum(x.shape[0] for x in xs), n, dtype=torch.bfloat16)
    fn(int64_array([xq.data_ptr() for xq, _ in quantized]),
       int64_array([sc.data_ptr() for _, sc in quantized]), int64_array([x.shape[0] for x in xs]),
       int64_array([q.data_ptr() for q in qweights]),
       int64_array([s.data_ptr() for s in scales]), int(scales[0].dtype is torch.float16),
       row_pointers(y, [x.shape[0] for x in xs]), len(xs), n, k, group_size, torch.get_num_threads())
    return y
