"""Integer prefill for `QuantLinear`: int8 activations × int8 / int4 weights, exact int32 sums.

On a CPU without AMX the bf16 GEMM runs at ≈ 0.2 TFLOP/s while AVX-512 VNNI integer dot products
(vpdpbusd) run ≈ 1.3 TOP/s, so prefill (more than ``FEW_TOKENS`` rows) quantizes its activations,
as llama.cpp does for its integer dot products:

- each activation row is quantized symmetrically to int8 — per row against int8 weights, per row
  and weight group against int4 weights (free there: every group is rescaled anyway):
  ``xs = max|x| / 127``, ``xq = round(x / xs)``;
- int8 weights: ``torch._int_mm(xq, qweight.T)`` (int32), then ``acc · xs[m] · scale[n] + bias``
  in float32, rounded to bf16 once;
- int4 weights: the C kernel of ``csrc/quant_prefill.c`` reads the packed panels directly; each
  group's sum is exact in int32 and the groups are summed in float32 in order.

Integer sums do not depend on blocking, so a row's output never depends on the other rows of the
call (prefill is row independent too). Decode-shaped calls (up to ``FEW_TOKENS`` rows) keep bf16
activations (``csrc/quant.c``). Elsewhere — CUDA, other dtypes, no VNNI, ``HYBRIDLM_COMPILE=0``,
or ``HYBRIDLM_INT8_PREFILL=0`` (prefill numerics as close to decode's as bf16 allows, at the bf16
GEMM's speed) — `QuantLinear` keeps its dequantized bf16 path.

The price, measured by ``hybridlm bench quality``: int8 activations add about as much error as
int8 weights do (the small test models' KL to bf16 roughly doubles with int8 weights), and little
beside int4 weights' own error.
"""

from __future__ import annotations

import ctypes
import os

import torch

from hybridlm.ops.native import NativeKernel

__all__ = ["int4_prefill", "int8_prefill", "prefill_applies", "quantize_activations", "vnni"]

# Most int32 elements an int8 prefill GEMM produces at once: a 248k-vocabulary LM head over a long
# prompt runs in column slabs instead of one [M, N] int32 and one float32 temporary.
OUT_ELEMENTS = 1 << 22

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
INT4_PREFILL = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_prefill_int4",
    [_p, _p, _i64, _p, _p, _int, _p, _p, _i64, _i64, _i64, _int], _int,
    fallback="dequantized bf16 prefill",
)
QUANTIZE_ROWS = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_quantize_rows", [_p, _i64, _i64, _i64, _p, _p, _int], None,
    fallback="torch activation quantization",
)
RESCALE_INT8 = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_rescale_int8", [_p, _p, _p, _p, _p, _i64, _i64, _i64, _int],
    None, fallback="torch rescaling",
)
AVAILABLE = NativeKernel(
    "quant_prefill", "quant_prefill.c", "hybridlm_prefill_available", [], _i64,  # not a status: 1 or 0
    fallback="dequantized bf16 prefill",
)


def vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (the int4 kernel built for it), i.e. integer prefill pays."""
    fn = AVAILABLE.get()
    return fn is not None and bool(fn())


def prefill_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 CPU input, CPU weights, a VNNI CPU, not traced by torch.compile, not turned off by
    ``HYBRIDLM_INT8_PREFILL=0`` (callers check the row count)."""
    return (
        x.dtype is torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and not torch.compiler.is_compiling()
        and os.environ.get("HYBRIDLM_INT8_PREFILL", "1") != "0"
        and vnni()
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
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] bf16, qweight [N, K] int8, scales [N] float32, bias [N] or None -> [M, N] bf16:
    ``bf16(Σ_k xq[m, k] q[n, k] · xs[m] · scales[n] + bias[n])``, the sum exact in int32."""
    xq, xs = _quantized(x, x.shape[1])
    m, n = x.shape[0], qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    rescale = RESCALE_INT8.get()
    step = max(1, OUT_ELEMENTS // m)
    for n0 in range(0, n, step):
        n1 = min(n0 + step, n)
        acc = torch._int_mm(xq, qweight[n0:n1].t())
        b = None if bias is None else bias[n0:n1]
        if rescale is not None and (b is None or b.dtype is torch.bfloat16):
            bias_ptr = None if b is None else b.data_ptr()
            rescale(acc.data_ptr(), xs.data_ptr(), scales[n0:].data_ptr(), bias_ptr, y[:, n0:].data_ptr(),
                    m, n1 - n0, n, torch.get_num_threads())
            continue
        out = acc.float().mul_(xs).mul_(scales[n0:n1])
        y[:, n0:n1] = out if b is None else out.add_(b.float())
    return y


def int4_prefill(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [M, K] bf16, qweight [N, K / 2] packed int4 panels, scales [N, K / group_size] bf16 / fp16 in
    panel order, bias [N] bf16 or None -> [M, N] bf16: ``bf16(Σ_g xs[m, g] · scales[n, g] ·
    Σ_{k ∈ g} xq[m, k] q[n, k] + bias[n])``; None when the kernel is not built."""
    fn = INT4_PREFILL.get()
    if fn is None:
        return None
    xq, xs = _quantized(x, group_size)
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    bias_ptr = None if bias is None else bias.data_ptr()
    fp16 = int(scales.dtype is torch.float16)
    fn(xq.data_ptr(), xs.data_ptr(), m, qweight.data_ptr(), scales.data_ptr(), fp16, bias_ptr, y.data_ptr(),
       n, k, group_size, torch.get_num_threads())
    return y
