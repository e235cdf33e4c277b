"""Linear layer with a fast bf16 matrix-vector path for CPU decode.

Decode on CPU is bound by how fast the weights stream from memory. ``F.linear`` with a single
bf16 row goes through oneDNN and moves ~18-23 GB/s of weights on 2 cores where a plain read
reaches ~30 GB/s; this kernel moves ~28-29 GB/s (benchmarks/matvec.py). For inputs with at most
``kernel_rows()`` rows (``MAX_FAST_ROWS`` with AVX512-BF16, else 4) and bf16 CPU tensors,
``linear`` instead calls a small C kernel (compiled with the system C compiler on first use and
cached on disk) that reads every weight row exactly once for all input rows, accumulates in fp32
and rounds the result to bf16 once, like ``F.linear``. Everything else -- CUDA, fp32 weights
(MKL's sgemv already runs at memory speed), prefill-sized inputs, autograd, tracing under
``torch.compile`` -- uses ``F.linear`` unchanged.

Set ``HYBRIDLM_COMPILE=0`` to disable the kernel; if it cannot be built (no compiler, build
error) the fallback is ``F.linear`` with one logged warning.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops.native import BF16_HELPERS, FEW_TOKENS, NativeKernel

__all__ = [
    "MAX_FAST_ROWS", "Int8Linear", "Linear", "fast_path_available", "kernel_rows", "linear", "quantize_int8_",
    "rowwise",
]

# Most input rows the kernel takes: decode (1 row) and speculative verify (up to FEW_TOKENS). Where
# the CPU has bf16 dot-product instructions (AVX512-BF16) a row costs one instruction per 32
# weights: on one thread, 6144 x 1024 takes 0.91 ms for 1 row, 1.14 for 4, 1.58 for 9 (oneDNN: 1.27,
# 1.38, 1.47). Without them each row costs two fp32 FMAs per weight pair and from 5 rows on the
# kernel is compute-bound, so it stops at 4 rows. One kernel for every row count makes a row's
# result independent of the rows beside it: a verify pass computes each position exactly as a
# one-token decode step does.
MAX_FAST_ROWS = FEW_TOKENS

# y[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]) with x, w, bias, y bf16 and fp32 accumulation.
# Weight rows are processed in blocks of RB rows against up to MC input rows at a time, so each
# weight byte is loaded from memory once and reused from registers for every input row. bf16 is
# the upper half of fp32: a 32-bit load of two packed bf16 gives the even element as `u << 16`
# and the odd one as `u & 0xffff0000`, so x is pre-converted to fp32 with each 32-block split
# into its 16 even then 16 odd elements, and the inner loop needs no shuffles. GCC vector
# extensions keep this portable; -march=native picks AVX-512/AVX2/NEON widths.
_KERNEL_SOURCE = BF16_HELPERS + r"""
#include <stdlib.h>
#define RB 4
#define MC 4  /* input rows per pass; more rows take several passes over a block held in L1 */
#define PREFETCH_BYTES 16384

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define MAX_ROWS 17  /* FEW_TOKENS */
/* The same tile with vdpbf16ps: x stays bf16, each instruction multiplies 32 bf16 pairs and adds
   them (exactly: products of bf16 fit an fp32) into 16 fp32 sums, odd element then even. */
static inline __attribute__((always_inline)) void tile_dp(const uint16_t* x, int64_t K, int mc,
                                                          const uint16_t* w, int rb, float out[RB][MC]) {
    __m512 acc[RB][MC];
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) acc[r][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[RB];
        for (int r = 0; r < rb; r++) {
            __builtin_prefetch((const char*)(w + r * K + k) + PREFETCH_BYTES, 0, 1);
            wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
        }
        for (int c = 0; c < mc; c++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c * K + k);
            for (int r = 0; r < rb; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[r], xv);
        }
    }
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        float s = _mm512_reduce_add_ps(acc[r][c]);
        for (int64_t t = k; t < K; t++) s += bf16_to_f32(w[r * K + t]) * bf16_to_f32(x[c * K + t]);
        out[r][c] = s;
    }
}
#define TILE_DP(rows, cols) tile_dp(x, K, cols, w, rows, out)
static void tile_dp_any(const uint16_t* x, int64_t K, int mc, const uint16_t* w, int rb, float out[RB][MC]) {
    if (rb == RB) {
        switch (mc) { case 1: TILE_DP(RB, 1); break; case 2: TILE_DP(RB, 2); break;
                      case 3: TILE_DP(RB, 3); break; default: TILE_DP(RB, MC); }
        return;
    }
    for (int r = 0; r < rb; r++) {
        float row[RB][MC];
        const uint16_t* wr = w + r * K;
        switch (mc) { case 1: tile_dp(x, K, 1, wr, 1, row); break;
                      case 2: tile_dp(x, K, 2, wr, 1, row); break;
                      case 3: tile_dp(x, K, 3, wr, 1, row); break;
                      default: tile_dp(x, K, MC, wr, 1, row); }
        for (int c = 0; c < mc; c++) out[r][c] = row[0][c];
    }
}
#define TILE_ANY(x, xf, K, mc, w, rb, out) tile_dp_any(x, K, mc, w, rb, out)
#define X_AS_F32 0
#else
#define MAX_ROWS 4
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
#define RB 4
#define MC 4  /* input rows per pass; more rows take several passes over a block held in L1 */
#define PREFETCH_BYTES 16384

static inline u32x16 load_u32x16(const void* p) { u32x16 v; memcpy(&v, p, sizeof v); return v; }
static inline f32x16 load_f32x16(const float* p) { f32x16 v; memcpy(&v, p, sizeof v); return v; }
static inline float hsum(f32x16 v) {
    f32x8 a, b; memcpy(&a, &v, 32); memcpy(&b, (char*)&v + 32, 32); a += b;
    f32x4 c, d; memcpy(&c, &a, 16); memcpy(&d, (char*)&a + 16, 16); c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* out[r][c] = dot(w row r, x row c) for r < rb, c < mc; inlined with constant rb, mc so the
   accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const float* xf, int64_t K, int mc,
                                                       const uint16_t* w, int rb, float out[RB][MC]) {
    f32x16 acc[RB][MC];
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) acc[r][c] = (f32x16){0};
    const u32x16 hi = (u32x16){0} + 0xffff0000u;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        f32x16 even[RB], odd[RB];
        for (int r = 0; r < rb; r++) {
            /* RB interleaved rows are RB short streams that the hardware prefetcher ramps up too
               late; fetching 16 KiB ahead lifts DRAM reads from ~22 to ~29 GB/s on 2 cores. */
            __builtin_prefetch((const char*)(w + r * K + k) + PREFETCH_BYTES, 0, 1);
            const u32x16 u = load_u32x16(w + r * K + k);
            even[r] = (f32x16)(u << 16);
            odd[r] = (f32x16)(u & hi);
        }
        for (int c = 0; c < mc; c++) {
            const f32x16 xe = load_f32x16(xf + c * K + k), xo = load_f32x16(xf + c * K + k + 16);
            for (int r = 0; r < rb; r++) {
                acc[r][c] += even[r] * xe;
                acc[r][c] += odd[r] * xo;
            }
        }
    }
    for (int r = 0; r < rb; r++) for (int c = 0; c < mc; c++) {
        float s = hsum(acc[r][c]);
        for (int64_t t = k; t < K; t++) s += bf16_to_f32(w[r * K + t]) * xf[c * K + t];
        out[r][c] = s;
    }
}

#define TILE(rows, cols) tile(xf, K, cols, w, rows, out)
static void tile_any(const float* xf, int64_t K, int mc, const uint16_t* w, int rb, float out[RB][MC]) {
    if (rb == RB) {
        switch (mc) { case 1: TILE(RB, 1); break; case 2: TILE(RB, 2); break;
                      case 3: TILE(RB, 3); break; default: TILE(RB, MC); }
        return;
    }
    for (int r = 0; r < rb; r++) {  /* the last N % RB rows, one at a time */
        float row[RB][MC];
        const uint16_t* wr = w + r * K;
        switch (mc) { case 1: tile(xf, K, 1, wr, 1, row); break; case 2: tile(xf, K, 2, wr, 1, row); break;
                      case 3: tile(xf, K, 3, wr, 1, row); break; default: tile(xf, K, MC, wr, 1, row); }
        for (int c = 0; c < mc; c++) out[r][c] = row[0][c];
    }
}
#define TILE_ANY(x, xf, K, mc, w, rb, out) tile_any(xf, K, mc, w, rb, out)
#define X_AS_F32 1
#endif

int64_t hybridlm_linear_max_rows(void) { return MAX_ROWS; }

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all bf16 and contiguous. Returns 0 or -1
   (out of memory). */
int hybridlm_linear_bf16(const uint16_t* x, int64_t M, const uint16_t* w, const uint16_t* bias,
                         uint16_t* y, int64_t N, int64_t K, int nthreads) {
    float* xf = NULL;
    if (X_AS_F32) {
        xf = malloc((size_t)(M * K) * sizeof(float));
        if (!xf) return -1;
        const int64_t K32 = K / 32 * 32;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t* src = x + m * K;
            float* dst = xf + m * K;
            for (int64_t k = 0; k < K32; k += 32)
                for (int i = 0; i < 16; i++) {
                    dst[k + i] = bf16_to_f32(src[k + 2 * i]);
                    dst[k + 16 + i] = bf16_to_f32(src[k + 2 * i + 1]);
                }
            for (int64_t k = K32; k < K; k++) dst[k] = bf16_to_f32(src[k]);
        }
    }
    const int64_t nblocks = (N + RB - 1) / RB;
    /* Below ~128 KiB of weights a second thread costs more to wake than it saves. */
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (N * K >= 65536)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * RB;
        const int rb = N - n0 < RB ? (int)(N - n0) : RB;
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int mc = M - m0 < MC ? (int)(M - m0) : MC;
            float out[RB][MC];
            TILE_ANY(x + m0 * K, xf ? xf + m0 * K : NULL, K, mc, w + n0 * K, rb, out);
            for (int r = 0; r < rb; r++) {
                const float bv = bias ? bf16_to_f32(bias[n0 + r]) : 0.f;
                for (int c = 0; c < mc; c++) y[(m0 + c) * N + n0 + r] = f32_to_bf16(out[r][c] + bv);
            }
        }
    }
    free(xf);
    return 0;
}
"""

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
KERNEL = NativeKernel(
    "linear_bf16",
    _KERNEL_SOURCE,
    "hybridlm_linear_bf16",
    [_p, _i64, _p, _p, _p, _i64, _i64, ctypes.c_int],
    ctypes.c_int,
    fallback="F.linear",
)
# The same library's answer to "how many rows do you take" (MAX_FAST_ROWS or 4, see above).
ROWS = NativeKernel("linear_bf16", _KERNEL_SOURCE, "hybridlm_linear_max_rows", [], ctypes.c_int64, "F.linear")


@functools.cache
def kernel_rows() -> int:
    """Most input rows the built kernel takes (0 without a kernel)."""
    fn = ROWS.get()
    return fn() if fn is not None and KERNEL.get() is not None else 0


def fast_path_available() -> bool:
    """Whether few-row bf16 CPU inputs use the kernel (building it now if needed)."""
    return KERNEL.get() is not None


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 CPU tensors, 1..kernel_rows() rows, no autograd, not being traced by torch.compile.

    Ordered cheapest-first: this runs on every call, and each check costs ~0.06 us.
    """
    k = weight.shape[-1]
    return (
        x.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
        and x.shape[-1] == k
        and 0 < x.numel() <= kernel_rows() * k
        and weight.shape[0] > 0
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is torch.bfloat16 and bias.is_cpu and bias.is_contiguous()))
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
        # A ctypes call cannot be traced; under torch.compile inductor generates its own code.
        and not torch.compiler.is_compiling()
    )


_ROWWISE = threading.local()


@contextmanager
def rowwise() -> Iterator[None]:
    """Inside, (on this thread) CPU inputs of any row count compute each row exactly as a one-row call
    would: the kernel in groups of `kernel_rows()` rows (one weight read per group), or one row per
    `F.linear` call where the kernel does not apply. A forward packing the decode / verify rows of
    many sequences runs under it, so a row's result never depends on how many rows share the step."""
    before = getattr(_ROWWISE, "on", False)
    _ROWWISE.on = True
    try:
        yield
    finally:
        _ROWWISE.on = before


def _rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` over [..., in] as groups of rows that each take the path a one-row call takes."""
    rows = x.reshape(-1, x.shape[-1])
    group = kernel_rows() if _kernel_applies(rows[:1], weight, bias) else 1
    out = torch.cat([linear(rows[i : i + group], weight, bias) for i in range(0, rows.shape[0], group)])
    return out.reshape(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, using the bf16 kernel for few-row CPU inputs (any row count
    under `rowwise`).

    Args:
        x: [..., in] input.
        weight: [out, in].
        bias: [out] or None.

    Returns:
        [..., out] in x's dtype; on the kernel path fp32-accumulated and rounded to bf16 once.
    """
    fn = KERNEL.get() if _kernel_applies(x, weight, bias) else None
    if fn is None:
        if getattr(_ROWWISE, "on", False) and x.is_cpu and x.numel() > x.shape[-1]:
            return _rowwise_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    n, k = weight.shape
    # The kernel only needs x's rows contiguous; writing y in place of the [..., out] result
    # saves the reshape/view round trip (~1.3 us of a ~4 us call).
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=torch.bfloat16)
    fn(
        x.data_ptr(),
        x.numel() // k,
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
        k,
        torch.get_num_threads(),
    )
    return y


class Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (same ``weight`` [out, in] and ``bias`` [out]) whose forward is
    ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """Weight-only int8 linear: ``weight_int8`` [out, in] int8 times per-output-channel
    ``weight_scale`` [out], plus optional ``bias`` [out]; made by ``quantize_int8_``.

    On CPU it runs ``torch._weight_int8pack_mm``, which reads half a bf16 weight's bytes. That
    kernel gives wrong bf16 results when ``in % 16 != 0`` (torch 2.13), so such shapes, and other
    devices, dequantize the weight instead.
    """

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, layer: nn.Linear) -> Int8Linear:
        """Symmetric per-row quantization: ``scale = max|w_row| / 127``, ``q = round(w / scale)``;
        the scale keeps the weight's dtype."""
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        bias = None if layer.bias is None else layer.bias.detach()
        return cls(q, scale.to(layer.weight.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        x2 = x.reshape(-1, self.in_features)
        scale = self.weight_scale.to(x.dtype)
        if x2.is_cpu and self.in_features % 32 == 0:
            y = torch._weight_int8pack_mm(x2.contiguous(), self.weight_int8, scale)
        else:
            y = F.linear(x2, self.weight_int8.to(x.dtype)) * scale
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def quantize_int8_(module: nn.Module) -> nn.Module:
    """Replace every ``Linear`` inside ``module`` by its ``Int8Linear``, in place; returns
    ``module``, or the new ``Int8Linear`` if ``module`` itself is a ``Linear``."""
    if isinstance(module, Linear):
        return Int8Linear.from_linear(module)
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, Linear):
                setattr(child, attr, Int8Linear.from_linear(sub))
    return module
