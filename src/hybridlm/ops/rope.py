"""Rotary position embeddings: full or partial rotary dims, rotate-half layout, per-layer bases."""

from __future__ import annotations

import torch


def default_inv_freq(head_dim: int, base: float, partial_rotary_factor: float = 1.0) -> torch.Tensor:
    """[rot_dim / 2] float32 inverse frequencies of standard RoPE over `head_dim * factor` dims."""
    dim = int(head_dim * partial_rotary_factor)
    # Explicitly on the CPU: models are built under a meta-device context, tables are not weights.
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths scaled down, short kept, smooth between."""
    factor = params["factor"]
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def inv_freq_from_params(head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for a transformers-style `rope_parameters` dict."""
    rope_type = params.get("rope_type", "default")
    inv = default_inv_freq(head_dim, params["rope_theta"], params.get("partial_rotary_factor", 1.0))
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "linear":
        return inv / params["factor"], 1.0
    if rope_type == "llama3":
        return llama3_inv_freq(inv, params), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r}")


class Rotary:
    """Cos/sin tables for one (head_dim, base) pair, computed per forward from absolute positions."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0):
        self.inv_freq = inv_freq
        self.scaling = scaling

    @property
    def rot_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, L] -> cos, sin [B, 1, L, rot_dim] in `dtype` (rotate-half layout)."""
        inv = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        return cos[:, None].to(dtype), sin[:, None].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` dims of x [B, H, L, D]; the rest pass through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)
