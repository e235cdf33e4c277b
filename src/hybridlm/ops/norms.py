"""RMSNorm variants used by the supported families.

All compute in float32 and cast back to the input dtype, in the order each family's reference
implementation uses (the order matters at bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """`(1 + weight) * norm(x)` with the scale applied in float32 (Qwen3.5 / Qwen3-Next / Gemma)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`weight * norm(x) * silu(gate)`: the output norm of Gated DeltaNet layers."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = self.weight * rms_normalize(x, self.eps).to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim (the flash-linear-attention convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
