"""What this machine can do at best: memory read bandwidth and matmul rate.

Decode streams every weight once per token, so its ceiling is bandwidth / weight bytes per
token; prefill is matmul-bound, so its ceiling is matmul rate / FLOPs per token. Measurements
take ~0.5 s each, use torch's current thread count, and are cached per process (keyed by
device, dtype and thread count).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from torch import nn

from hybridlm.ops.linear import float32_min_rows
from hybridlm.ops.quant import QuantLinear
from hybridlm.ops.quant_gemm import integer_prefill

__all__ = [
    "best_seconds", "decode_limit_tok_s", "matmul_tflops", "memory_bandwidth_gbs", "prefill_limit_tok_s"
]

_BUDGET_S = 0.5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, budget_s: float = _BUDGET_S) -> float:
    """Fastest of repeated ``fn()`` calls (after one warm-up) within ``budget_s``; at least 3 runs."""
    fn()
    _sync(device)
    best, start, runs = float("inf"), time.perf_counter(), 0
    while runs < 3 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


@functools.cache
def _bandwidth(device: torch.device, threads: int) -> float:
    # Far larger than any last-level cache, so reads come from DRAM/HBM as decode's do.
    nbytes = (1 << 30) if device.type == "cuda" else (512 << 20)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # ones(): pages resident now
    return nbytes / best_seconds(lambda: torch.dot(x, x), device) / 1e9


@functools.cache
def _tflops(dtype: torch.dtype, device: torch.device, threads: int) -> float:
    n = 4096 if device.type == "cuda" else 2048
    if dtype is torch.int8:  # int32 sums, by the kernels quantized prefill runs (ops.quant_gemm)
        if device.type == "cpu" and integer_prefill():
            layer = QuantLinear.from_linear(nn.Linear(n, n, bias=False).to(torch.bfloat16), "int8")
            x = torch.randn(n, n).to(torch.bfloat16)
            return 2 * n**3 / best_seconds(lambda: layer._forward_integer(x), device) / 1e12
        a = torch.randint(-127, 128, (n, n), dtype=dtype, device=device)
        b = torch.randint(-127, 128, (n, n), dtype=dtype, device=device)
        return 2 * n**3 / best_seconds(lambda: torch._int_mm(a, b), device) / 1e12
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    float32_rate = None
    if dtype is torch.bfloat16 and device.type == "cpu":
        # bf16 operands multiply exactly in float32, and `ops.linear` takes that path where it is faster
        a32, b32 = a.float(), b.float()
        float32_rate = 2 * n**3 / best_seconds(lambda: a32 @ b32, device) / 1e12
        least = float32_min_rows()
        if least is not None and least <= n:
            # prompts never reach torch's bf16 GEMM here: on a CPU without bf16 instructions it can be
            # torch's scalar fallback, minutes for one n³ product
            return float32_rate
    rate = 2 * n**3 / best_seconds(lambda: a @ b, device) / 1e12
    return rate if float32_rate is None else max(rate, float32_rate)


def memory_bandwidth_gbs(device: torch.device | str = "cpu") -> float:
    """Read bandwidth in GB/s (1e9 bytes/s): best ``torch.dot`` of a 512 MiB (CUDA: 1 GiB)
    fp32 vector with itself, which reads each byte once."""
    return _bandwidth(torch.device(device), torch.get_num_threads())


def matmul_tflops(dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> float:
    """Square GEMM rate in TFLOP/s (2·n³ FLOPs, n = 2048 on CPU, 4096 on CUDA) for ``dtype`` (int8:
    the integer prefill kernels on a CPU that has them, else ``torch._int_mm``, TOP/s; bf16 on a CPU:
    the float32 GEMM of the same values where `ops.linear` converts an n-row product to float32, else
    the faster of that and the bf16 GEMM)."""
    return _tflops(dtype, torch.device(device), torch.get_num_threads())


def decode_limit_tok_s(weight_bytes_per_token: float, device: torch.device | str = "cpu") -> float:
    """Decode ceiling in tokens/s when every token reads ``weight_bytes_per_token`` bytes."""
    return memory_bandwidth_gbs(device) * 1e9 / weight_bytes_per_token


def prefill_limit_tok_s(
    flops_per_token: float, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> float:
    """Prefill ceiling in tokens/s when every token costs ``flops_per_token`` FLOPs of matmul."""
    return matmul_tflops(dtype, device) * 1e12 / flops_per_token
