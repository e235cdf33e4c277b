"""Rotary position embeddings: full or partial rotary dims, rotate-half layout, per-layer bases."""

from __future__ import annotations

import ctypes

import torch

from hybridlm.ops.native import NativeKernel

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
ROTARY_KERNEL = NativeKernel(
    "rope", "rope.c", "hybridlm_rotary",
    [_p, _i64, _i64, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, ctypes.c_int], None,
    fallback="torch ops",
)


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
    """Rotate the first `cos.shape[-1]` dims of x [B, H, L, D] by cos, sin [B, 1, L, rot]; the rest
    pass through. bf16 CPU inputs take the C kernel (the composed ops' bits in one call: in a decode
    step those ~9 small ops took ~40 µs a call) and return a contiguous result."""
    rot = cos.shape[-1]
    if _kernel_applies(x, cos, sin):
        fn = ROTARY_KERNEL.get()
        if fn is not None:
            b, h, length, d = x.shape
            cos, sin = cos.contiguous(), sin.contiguous()
            out = torch.empty(x.shape, dtype=x.dtype)
            fn(x.data_ptr(), *x.stride()[:3], cos.data_ptr(), sin.data_ptr(), out.data_ptr(), b, h, length, d,
               rot, torch.get_num_threads())
            return out
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def _kernel_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (
        x.dtype is torch.bfloat16
        and cos.dtype is torch.bfloat16
        and sin.dtype is torch.bfloat16
        and x.is_cpu
        and cos.is_cpu
        and sin.is_cpu
        and x.dim() == 4
        and x.stride(-1) == 1
        and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2], cos.shape[-1])
        and 0 < cos.shape[-1] <= x.shape[-1]
        and cos.shape[-1] % 2 == 0
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
    )
