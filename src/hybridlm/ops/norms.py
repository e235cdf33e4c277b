"""RMSNorm variants used by the supported families.

All compute in float32 and cast back to the input dtype, in the order each family's reference
implementation uses (the order matters at bf16). CPU inputs of bf16 or float32 run one fused
C loop per call instead of ~7 ATen ops, rounding at the same points.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops.native import NativeKernel

# The fused norms: csrc/norms.c; mode 0 RMSNorm, 1 OffsetRMSNorm, 2 GatedRMSNorm, 3 Float32RMSNorm.
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
NORM_KERNEL = NativeKernel(
    "rms_norm",
    "norms.c",
    "hybridlm_rms_norm",
    [_p, _p, _p, _p, _i64, _i64, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int],
    None,
    fallback="torch ops",
)
RMS, OFFSET, GATED, FLOAT32 = 0, 1, 2, 3


def fused_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mode: int, gate: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The norm of ``mode`` over the last dim of x ``[..., D]`` by the C kernel, or None where it
    does not apply (the caller then runs the torch ops). Every size takes it, each row computed as
    alone: a prompt chunk's rows get a decode row's numbers, and the kernel beat torch's ~7 passes
    (a Nemotron-H-shaped Float32RMSNorm of 512 x 1536 bf16 rows, 2 Xeon threads: 0.76-1.0 ms in
    torch, 0.16-0.22 ms in the kernel; 2048 rows 3.3-3.6 against 0.77-0.79 ms)."""
    if not (
        x.is_cpu
        and x.dtype in (torch.bfloat16, torch.float32)
        and weight.dtype is x.dtype
        and (gate is None or gate.dtype is x.dtype)
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and weight.requires_grad)
    ):
        return None
    fn = NORM_KERNEL.get()
    if fn is None:
        return None
    x = x.contiguous()
    gate = None if gate is None else gate.contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    fn(x.data_ptr(), weight.data_ptr(), None if gate is None else gate.data_ptr(), out.data_ptr(),
       x.numel() // d if d else 0, d, eps, mode, int(x.dtype is torch.bfloat16), torch.get_num_threads())
    return out


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """`weight * norm(x)`, cast to the input dtype before the scale (Llama / Qwen3 / LFM2 order)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fused_rms_norm(x, self.weight, self.eps, RMS)
        return y if y is not None else self.weight * rms_normalize(x, self.eps).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """`(1 + weight) * norm(x)` with the scale applied in float32 (Qwen3.5 / Qwen3-Next / Gemma)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fused_rms_norm(x, self.weight, self.eps, OFFSET)
        return y if y is not None else (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class Float32RMSNorm(RMSNorm):
    """`weight * norm(x)` with the scale applied in float32 and one cast back (Nemotron-H)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fused_rms_norm(x, self.weight, self.eps, FLOAT32)
        return y if y is not None else (rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`weight * norm(x) * silu(gate)`: the output norm of Gated DeltaNet layers."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = fused_rms_norm(x, self.weight, self.eps, GATED, gate)
        if y is not None:
            return y
        dtype = x.dtype
        y = self.weight * rms_normalize(x, self.eps).to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim (the flash-linear-attention convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class SigmoidGatedRMSNorm(nn.Module):
    """`weight * norm(x) * sigmoid(gate)`, all in float32 and rounded once: the output norm of Kimi
    Delta Attention layers (flash-linear-attention's `FusedRMSNormGated` with a sigmoid gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., dim] -> [..., dim] in x's dtype."""
        y = self.weight.float() * rms_normalize(x, self.eps)
        return (y * torch.sigmoid(gate.float())).to(x.dtype)
