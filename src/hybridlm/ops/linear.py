"""Linear layer with a fast bf16 matrix-vector path for CPU decode.

Decode on CPU is bound by how fast the weights stream from memory. ``F.linear`` with a single
bf16 row goes through oneDNN and moves ~18-23 GB/s of weights on 2 cores where a plain read
reaches ~30 GB/s; this kernel moves ~28-29 GB/s (benchmarks/matvec.py). For inputs with at most
``kernel_rows()`` rows (``MAX_FAST_ROWS``, every ISA) and bf16 CPU tensors,
``linear`` instead calls a small C kernel (compiled with the system C compiler on first use and
cached on disk) that reads every weight row exactly once for all input rows, accumulates in fp32
and rounds the result to bf16 once, like ``F.linear``. Prefill-sized bf16 CPU inputs multiply in
float32 where this CPU's float32 GEMM was measured faster than its bf16 one (see
``float32_min_rows``). Everything else -- CUDA, fp32 weights (MKL's sgemv already runs at memory
speed), autograd, tracing under ``torch.compile`` -- uses ``F.linear`` unchanged.

Set ``HYBRIDLM_COMPILE=0`` to disable the kernel; if it cannot be built (no compiler, build
error) the fallback is ``F.linear`` with one logged warning.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops.native import FEW_TOKENS, NativeKernel, ThreadFlag, int64_array, row_pointers

log = logging.getLogger(__name__)

__all__ = [
    "MAX_FAST_ROWS",
    "FusedLinear",
    "Linear",
    "fast_path_available",
    "in_row_groups",
    "kernel_rows",
    "linear",
    "linear_grouped",
    "rowwise",
    "rowwise_applies",
]

# Most input rows the kernel takes: decode (1 row) and speculative verify (up to FEW_TOKENS). Where
# the CPU has bf16 dot-product instructions (AVX512-BF16) a row costs one instruction per 32
# weights: on one thread, 6144 x 1024 takes 0.91 ms for 1 row, 1.14 for 4, 1.58 for 9 (oneDNN: 1.27,
# 1.38, 1.47). Without them (AVX2) each row costs two fp32 FMAs per weight pair and a few rows make
# the kernel compute-bound, but it still takes every decode-sized call: one kernel for every row
# count is what makes a row's result independent of the rows beside it on every ISA (a verify pass
# computes each position exactly as a one-token decode step does; a packed row as its own forward).
MAX_FAST_ROWS = FEW_TOKENS

# The kernel: csrc/linear.c.
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
KERNEL = NativeKernel(
    "linear_bf16",
    "linear.c",
    "hybridlm_linear_bf16",
    [_p, _i64, _p, _p, _p, _i64, _i64, ctypes.c_int],
    ctypes.c_int,
    fallback="F.linear",
)
GROUPED_KERNEL = NativeKernel(
    "linear_bf16",
    "linear.c",
    "hybridlm_linear_bf16_grouped",
    [_p, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int],
    ctypes.c_int,
    fallback="one kernel call per product",
)


def kernel_rows() -> int:
    """Most input rows the built kernel takes (0 without a kernel)."""
    return MAX_FAST_ROWS if KERNEL.get() is not None else 0


def fast_path_available() -> bool:
    """Whether few-row bf16 CPU inputs use the kernel (building it now if needed)."""
    return KERNEL.get() is not None


def _bf16_on_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Both operands bf16 on the CPU, the weight a matrix: what both CPU paths beside F.linear take."""
    return (
        x.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
        and x.is_cpu
        and weight.is_cpu
        and weight.dim() == 2
    )


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 CPU tensors, 1..kernel_rows() rows, no autograd, not being traced by torch.compile.

    Ordered cheapest-first: this runs on every call, and each check costs ~0.06 us.
    """
    k = weight.shape[-1]
    return (
        _bf16_on_cpu(x, weight)
        and x.shape[-1] == k
        and 0 < x.numel() <= kernel_rows() * k
        and weight.shape[0] > 0
        and weight.is_contiguous()
        and (bias is None or (bias.dtype is torch.bfloat16 and bias.is_cpu and bias.is_contiguous()))
        and _outside_autograd_and_tracing(x, weight, bias)
    )


def _outside_autograd_and_tracing(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """No operand needs a gradient, and torch.compile is not tracing: the paths that leave F.linear
    (a ctypes kernel, a float32 product) are neither differentiable nor traceable, and under
    torch.compile inductor generates its own code."""
    return (
        not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
        and not torch.compiler.is_compiling()
    )


_ROWWISE = ThreadFlag()


def rowwise() -> AbstractContextManager[None]:
    """Inside, (on this thread) CPU inputs of any row count compute each row exactly as a one-row call
    would: the kernel in groups of `kernel_rows()` rows (one weight read per group), or one row per
    `F.linear` call where the kernel does not apply. A forward packing the decode / verify rows of
    many sequences runs under it, so a row's result never depends on how many rows share the step."""
    return _ROWWISE.raised()


def rowwise_applies(x: torch.Tensor) -> bool:
    """Whether `x` [..., in] (more than one row, on the CPU) must be cut into row groups: inside
    `rowwise` on this thread."""
    return bool(_ROWWISE) and x.is_cpu and x.numel() > x.shape[-1]


def in_row_groups(x: torch.Tensor, group: int, fn, out_features: int) -> torch.Tensor:
    """`fn` over [..., in] applied to groups of `group` rows (each group takes the path a call with
    that many rows takes), joined back to [..., out_features]."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([fn(rows[i : i + group]) for i in range(0, rows.shape[0], group)])
    return out.reshape(*x.shape[:-1], out_features)


def linear_grouped(xs: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat([linear(x, w) for x, w in zip(xs, weights)])`` without bias, every x [M_i, in], every
    weight [out, in] of one shape, in one kernel call (one parallel region instead of one per product:
    a token's routed experts): [Σ M_i, out], each product's rows with the bits `linear` gives them;
    None where the kernel would not take every product (callers then run them one by one)."""
    fn = GROUPED_KERNEL.get()
    n, k = weights[0].shape
    if fn is None or not all(
        w.shape == (n, k) and _kernel_applies(x, w, None) for x, w in zip(xs, weights, strict=True)
    ):
        return None
    xs = [x if x.is_contiguous() else x.contiguous() for x in xs]
    rows = [x.numel() // k for x in xs]
    y = torch.empty((sum(rows), n), dtype=torch.bfloat16)
    fn(
        int64_array([x.data_ptr() for x in xs]),
        int64_array(rows),
        int64_array([w.data_ptr() for w in weights]),
        row_pointers(y, rows),
        len(xs),
        n,
        k,
        torch.get_num_threads(),
    )
    return y


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
        if rowwise_applies(x):
            group = kernel_rows() if _kernel_applies(x.reshape(-1, x.shape[-1])[:1], weight, bias) else 1
            return in_row_groups(x, group, lambda rows: linear(rows, weight, bias), weight.shape[0])
        if _float32_applies(x, weight, bias):
            return _linear_float32(x, weight, bias)
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


# Prefill-sized bf16 products on a CPU without bf16 matrix units. oneDNN's bf16 GEMM then runs on
# vdpbf16ps (AVX512-BF16), which does half the work a cycle of its float32 GEMM: 512 x 1024 @ 1024 x
# 6144 took 45 ms in bf16 and 24 ms with both operands converted to float32 (2 threads, no AMX); without
# AVX512-BF16 (AVX2) it emulates bf16 and runs ~50x slower than MKL's float32 GEMM (one Zen 3 thread,
# 512 x 1024 @ 1024 x 3584: 1.1 against 51 GFLOP/s). Products of bf16 values are exact in float32 and
# both accumulate in float32, so only the order of the sums differs. The weight is converted a slab of
# rows at a time (never a float32 copy of a whole LM head). Where the bf16 GEMM has vdpbf16ps the
# conversion pays from FLOAT32_MIN_ROWS rows on (7168 x 1024: 32 rows 3.3 ms in bf16 against 4.9, 64
# rows 6.5 against 6.1, 96 rows 9.1 against 8.0); without it, from the first row the kernel does not
# take. Both are measured once (`float32_min_rows`): with AMX bf16 wins and nothing is converted.
FLOAT32_MIN_ROWS = 64
FLOAT32_SLAB_ELEMENTS = 1 << 22


@functools.cache
def float32_min_rows() -> int | None:
    """Fewest rows from which bf16 products multiply in float32 on this CPU (None: never), measured on
    first use: oneDNN's bf16 GEMM against the float32 path on [rows, 512] @ [512, 1024] (best of 3):
    faster at 32 rows gives ``FEW_TOKENS + 1`` (every row count the kernel leaves), else faster at 256
    gives ``FLOAT32_MIN_ROWS``."""
    w = torch.randn(1024, 512).to(torch.bfloat16)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    for rows, answer in ((32, FEW_TOKENS + 1), (256, FLOAT32_MIN_ROWS)):
        x = torch.randn(rows, 512).to(torch.bfloat16)
        bf16, fp32 = best(lambda: F.linear(x, w)), best(lambda: _linear_float32(x, w, None))  # noqa: B023
        log.debug("GEMM %d x 512 x 1024: bf16 %.2f ms, float32 %.2f ms", rows, bf16 * 1e3, fp32 * 1e3)
        if fp32 < bf16:
            return answer
    return None


def _float32_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 CPU operands of at least `float32_min_rows()` rows, no autograd or tracing."""
    if not (
        _bf16_on_cpu(x, weight)
        and (bias is None or bias.dtype is torch.bfloat16)
        and _outside_autograd_and_tracing(x, weight, bias)
    ):
        return False
    least = float32_min_rows()
    return least is not None and x.numel() >= least * weight.shape[-1]


def _linear_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bf16 operands computed in float32 and rounded to bf16 once: x [..., in],
    weight [out, in], bias [out] or None -> [..., out] bf16."""
    n, k = weight.shape
    rows = x.reshape(-1, k).float()
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    slab = max(16, FLOAT32_SLAB_ELEMENTS // k)
    for n0 in range(0, n, slab):
        n1 = min(n, n0 + slab)
        w = weight[n0:n1].float()
        part = torch.mm(rows, w.T) if bias is None else torch.addmm(bias[n0:n1].float(), rows, w.T)
        out[:, n0:n1] = part
    return out.reshape(*x.shape[:-1], n)


class Linear(nn.Linear):
    """Drop-in ``nn.Linear`` (same ``weight`` [out, in] and ``bias`` [out]) whose forward is
    ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedLinear(nn.Module):
    """Linear layers that read the same input, run as one call (`models.fused` builds it at load).

    ``proj`` (a `Linear` or `ops.quant.QuantLinear`) holds the layers' output rows one after another;
    ``parts`` names each layer (its attribute on the owning module) and its output width. A decode row
    reads every weight exactly as the separate layers would and each output's dot product is computed
    by the same instructions (the kernels' sums are per output row), so the numbers are bit-identical
    to the separate calls; one call instead of several saves the per-call cost (~10 us each).
    """

    def __init__(self, proj: nn.Module, parts: tuple[tuple[str, int], ...]):
        super().__init__()
        self.proj = proj
        self.parts = tuple(parts)
        self.sizes = [size for _, size in self.parts]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> one view [..., size] per part, in `parts` order."""
        # not Tensor.split: its Python wrapper costs half again as much, on every layer of every step
        return torch.split_with_sizes(self.proj(x), self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return "parts=" + ", ".join(f"{name}[{size}]" for name, size in self.parts)
