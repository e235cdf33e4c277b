"""Weight-only int8 / int4 linear layers: quantized weights, bf16 activations, float32 accumulation.

Decode reads every weight once per token, so its speed is bandwidth ÷ weight bytes: int8 halves a
bf16 weight's bytes, int4 (with one bf16 scale per group of 64) reads 4.25 bits a weight.

- int8: symmetric per output channel, ``scale[n] = max|w[n]| / 127``, ``q = round(w / scale)``.
- int4: symmetric per group of ``group_size`` weights of a row, with the sign of the group's
  largest-magnitude weight mapped to -8 (as llama.cpp's Q4_0 does, so all 16 levels are used):
  ``scale = w_max / -8`` rounded to bf16, ``q = clamp(round(w / scale), -8, 7)``. Stored in panels of
  16 rows (`pack_int4`), the order the decode kernel reads; GPTQ checkpoints load into the same
  layout with their fp16 scales (`models.gptq`).

Few-row bf16 CPU inputs (decode, speculative verify: up to ``FEW_TOKENS`` rows) run the C kernels of
``csrc/quant.c``, which read the packed weights directly and compute each row as they would alone;
int4 rows take the integer kernel instead where it is built (AVX-512 VNNI, AVX2), with int8 activations
as prefill's, which reads cold weights 1.2-1.4x faster on the Xeon and twice as fast on Zen 3
(`quant_gemm.integer_int4_decode`).
Larger bf16 CPU inputs (prefill) on a CPU with AVX-512 VNNI or AVX2 quantize their activations to int8 per
row and multiply in integers (`quant_gemm`: about 4× the bf16 GEMM's speed without AMX), and so do
prompt rows of any number inside `quant_gemm.prompt_rows` (the engine's prefill chunks). Elsewhere
they dequantize the weight to bf16 in slabs of rows and use the bf16 GEMM (``F.linear``); so do
other devices and dtypes (where the whole weight is dequantized by torch).
"""

from __future__ import annotations

import ctypes
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.ops import QUANTIZATIONS
from hybridlm.ops.linear import in_row_groups, rowwise_applies
from hybridlm.ops.native import FEW_TOKENS, NativeKernel, int64_array, row_pointers
from hybridlm.ops.quant_gemm import (
    int4_prefill,
    int4_prefill_grouped,
    int8_prefill,
    integer_int4_decode,
    prefill_applies,
    prompt_rows_on,
)

__all__ = [
    "QUANTIZATIONS", "QuantLinear", "from_panels", "grouped_quantized", "pack_int4", "quantize_", "to_panels",
    "unpack_int4",
]

# int4 group size, measured: the decode kernel runs 32 / 64 / 128 equally fast (20.0 / 20.9 / 20.6 G
# weights/s on one core, in L2: its cost is the unpacking and vdpbf16ps, not the per-group scaling);
# they read 4.5 / 4.25 / 4.125 bits a weight. On the random Qwen3.5-0.8B preset 32 left KL 0.144
# (2048 positions) and 64 left 0.164 (4096): 64 takes 6% fewer bytes for a 14% larger KL.
INT4_GROUP = 64
# int4 weights are stored in panels of this many rows (one output per lane of a 16-float vector),
# eight weights of a row to a 32-bit word.
PANEL = 16
NIBBLES = 8
# Prefill dequantizes this many weight elements at a time (a bf16 slab of 16 MiB): the LM head of a
# 248k vocabulary never exists as a whole bf16 copy.
SLAB_ELEMENTS = 1 << 23

_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
INT8_KERNEL = NativeKernel(
    "quant", "quant.c", "hybridlm_linear_int8", [_p, _i64, _p, _p, _p, _p, _i64, _i64, _int], _int,
    fallback="dequantized F.linear",
)
INT4_KERNEL = NativeKernel(
    "quant", "quant.c", "hybridlm_linear_int4",
    [_p, _i64, _p, _p, _int, _p, _p, _i64, _i64, _i64, _int], _int,
    fallback="dequantized F.linear",
)
INT8_GROUPED_KERNEL = NativeKernel(
    "quant", "quant.c", "hybridlm_linear_int8_grouped",
    [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _int], _int,
    fallback="one call per product",
)
INT4_GROUPED_KERNEL = NativeKernel(
    "quant", "quant.c", "hybridlm_linear_int4_grouped",
    [_p, _p, _p, _p, _int, _p, _p, _i64, _i64, _i64, _i64, _int], _int,
    fallback="one call per product",
)
DEQUANT_INT8 = NativeKernel(
    "quant", "quant.c", "hybridlm_dequant_int8", [_p, _p, _p, _i64, _i64, _i64, _int], None,
    fallback="torch dequantization",
)
DEQUANT_INT4 = NativeKernel(
    "quant", "quant.c", "hybridlm_dequant_int4", [_p, _p, _int, _p, _i64, _i64, _i64, _i64, _i64, _int], None,
    fallback="torch dequantization",
)


def to_panels(t: torch.Tensor) -> torch.Tensor:
    """t [N, C] -> [N, C] in panel order: each slab of `PANEL` rows (the last one the N % 16 rows left)
    stored column by column, so rows 16p .. 16p + 15 of the result hold slab p transposed."""
    n, c = t.shape
    full = n // PANEL * PANEL
    parts = [t[:full].reshape(-1, PANEL, c).transpose(1, 2).reshape(-1)]
    if full < n:
        parts.append(t[full:].T.reshape(-1))
    return torch.cat(parts).view(n, c)


def from_panels(t: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_panels`."""
    n, c = t.shape
    full = n // PANEL * PANEL
    flat = t.reshape(-1)
    parts = [flat[: full * c].view(-1, c, PANEL).transpose(1, 2).reshape(full, c)]
    if full < n:
        parts.append(flat[full * c :].view(c, n - full).T)
    return torch.cat(parts)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 in [-8, 7], K % 8 == 0 -> [N, K / 2] uint8: 32-bit words (n, b) holding
    ``q[n, 8b + s] + 8`` in bits 4s .. 4s + 3 (little-endian), in panel order (`to_panels`)."""
    n, k = q.shape
    u = (q.to(torch.int32) + 8).view(n, k // NIBBLES, NIBBLES)
    shifts = torch.arange(0, 4 * NIBBLES, 4, dtype=torch.int32, device=q.device)
    words = (u << shifts).sum(dim=2, dtype=torch.int32)  # disjoint bits: the sum is an OR
    return to_panels(words).contiguous().view(torch.uint8).view(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: [N, K / 2] uint8 -> [N, K] int8 in [-8, 7]."""
    n, half = packed.shape
    words = from_panels(packed.contiguous().view(torch.int32).view(n, half // 4))
    shifts = torch.arange(0, 4 * NIBBLES, 4, dtype=torch.int32, device=packed.device)
    return (((words[..., None] >> shifts) & 15) - 8).to(torch.int8).view(n, half * 2)


def _rows_joined(qweights: list[torch.Tensor], scales: list[torch.Tensor], bits: int):
    """(qweight, scales) of the layers' output rows one after another (int4: out of and back into panels)."""
    if bits == 8:
        return torch.cat(qweights), torch.cat(scales)
    words = [from_panels(q.contiguous().view(torch.int32)) for q in qweights]
    n, k = sum(w.shape[0] for w in words), qweights[0].shape[1]
    q = to_panels(torch.cat(words)).contiguous().view(torch.uint8).view(n, k)
    return q, to_panels(torch.cat([from_panels(s) for s in scales])).contiguous()


def _rows_of(qweight: torch.Tensor, scales: torch.Tensor, bits: int, lo: int, hi: int):
    """(qweight, scales) of output rows [lo, hi) as a layer of their own (int4: in its own panels)."""
    if bits == 8:
        return qweight[lo:hi].clone(), scales[lo:hi].clone()
    words = from_panels(qweight.contiguous().view(torch.int32))[lo:hi]
    q = to_panels(words.contiguous()).contiguous().view(torch.uint8).view(hi - lo, qweight.shape[1])
    return q, to_panels(from_panels(scales)[lo:hi].contiguous()).contiguous()


class QuantLinear(nn.Module):
    """A weight-only quantized ``Linear`` (made by `from_linear`, or built empty to load into).

    Buffers: ``qweight`` — int8 [out, in] (bits 8) or packed int4 uint8 [out, in / 2] (bits 4, see
    `pack_int4`); ``scales`` — float32 [out] (int8) or [out, in / group_size] in panel order
    (`to_panels`; int4), bf16 (ours) or fp16 (a GPTQ checkpoint's, `scale_dtype`); ``bias`` [out] in
    the activation dtype, or None.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 device=None, dtype=torch.bfloat16, scale_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if bits == 4 and (group_size <= 0 or group_size % NIBBLES or in_features % group_size):
            raise ValueError(f"int4 needs in_features ({in_features}) divisible by group_size ({group_size}, "
                             f"a multiple of {NIBBLES})")
        if bits == 4 and scale_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"int4 scales are bf16 or fp16, not {scale_dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size if bits == 4 else in_features
        if bits == 8:
            q = torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
            s = torch.ones(out_features, dtype=torch.float32, device=device)
        else:
            q = torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
            s = torch.ones(out_features, in_features // group_size, dtype=scale_dtype, device=device)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", s)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, layer: nn.Linear, scheme: str, group_size: int = INT4_GROUP) -> QuantLinear:
        """Quantize `layer` (any dtype, any device) by `scheme` ("int8" or "int4")."""
        w = layer.weight.detach().float()
        n, k = w.shape
        bits = {"int8": 8, "int4": 4}[scheme]
        out = cls(k, n, bits, group_size, layer.bias is not None, device=w.device, dtype=layer.weight.dtype)
        tiny = torch.finfo(torch.float32).tiny
        if bits == 8:
            scale = (w.abs().amax(dim=1) / 127.0).clamp_min(tiny)
            out.qweight.copy_(torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
            out.scales.copy_(scale)
        else:
            g = w.view(n, k // group_size, group_size)
            # the group's largest-magnitude weight, with its sign, becomes -8
            peak = g.gather(2, g.abs().argmax(dim=2, keepdim=True)).squeeze(2)
            scale = (peak / -8.0).to(torch.bfloat16)
            scale = torch.where(scale == 0, torch.ones_like(scale), scale)
            q = torch.round(g / scale.float()[..., None]).clamp_(-8, 7).to(torch.int8).view(n, k)
            out.qweight.copy_(pack_int4(q))
            out.scales.copy_(to_panels(scale))
        if layer.bias is not None:
            out.bias.copy_(layer.bias.detach())
        return out

    @classmethod
    @torch.no_grad()
    def concat(cls, layers: list[QuantLinear]) -> QuantLinear:
        """One layer whose output rows are `layers`' rows one after another, each stored as it was (int4
        panels re-cut at the new row offsets), so each output computes the same numbers. The layers
        share input width, bits, group size, scale dtype and having a bias (else ValueError)."""
        first = layers[0]
        def kind(q: QuantLinear) -> tuple:
            return q.in_features, q.bits, q.group_size, q.scales.dtype, q.bias is None

        if any(kind(q) != kind(first) for q in layers):
            raise ValueError("layers of different input widths, schemes, group sizes, scale dtypes or biases")
        qweight, scales = _rows_joined([q.qweight for q in layers], [q.scales for q in layers], first.bits)
        out = cls(first.in_features, qweight.shape[0], first.bits, first.group_size, False, device="meta",
                  scale_dtype=first.scales.dtype)
        out.qweight, out.scales = qweight, scales
        if first.bias is not None:
            out.bias = nn.Parameter(torch.cat([q.bias for q in layers]), requires_grad=False)
        return out

    @torch.no_grad()
    def split(self, sizes: list[int]) -> list[QuantLinear]:
        """Inverse of `concat`: the layers of `sizes` output rows each, one after another."""
        if sum(sizes) != self.out_features:
            raise ValueError(f"sizes {sizes} do not add up to {self.out_features} output rows")
        parts = []
        for lo, n in zip(itertools.accumulate([0, *sizes]), sizes, strict=False):
            q, s = _rows_of(self.qweight, self.scales, self.bits, lo, lo + n)
            part = QuantLinear(self.in_features, n, self.bits, self.group_size, False, device="meta",
                               scale_dtype=self.scales.dtype)
            part.qweight, part.scales = q, s
            if self.bias is not None:
                part.bias = nn.Parameter(self.bias[lo : lo + n].clone(), requires_grad=False)
            parts.append(part)
        return parts

    def dequantized(self, dtype: torch.dtype = torch.bfloat16, rows: slice | None = None) -> torch.Tensor:
        """The weight [out, in] (or `rows` of it) as `dtype`, by torch ops (any device)."""
        rows = rows or slice(None)
        if self.bits == 8:
            q, s = self.qweight[rows], self.scales[rows]
            return (q.float() * s[:, None]).to(dtype)
        n0, n1, _ = rows.indices(self.out_features)
        # whole panels: rows [p0, p1) of the packed arrays hold panels p0 / 16 .. (p1 - 1) / 16
        p0, p1 = n0 // PANEL * PANEL, min(-(-n1 // PANEL) * PANEL, self.out_features)
        q, s = unpack_int4(self.qweight[p0:p1]), from_panels(self.scales[p0:p1])
        w = q.float().view(p1 - p0, -1, self.group_size) * s.float()[..., None]
        return w.view(p1 - p0, self.in_features)[n0 - p0 : n1 - p0].to(dtype)

    def _apply(self, fn, recurse: bool = True):
        # `module.to(dtype)` must not convert the scales: the kernels read them by pointer as float32
        # (int8) or bf16 / fp16 (int4), and a round trip through another dtype would lose bits. Only their
        # device follows.
        scales = self.scales
        super()._apply(fn, recurse)
        self.scales = scales.to(self.qweight.device)
        return self

    def _dequantized_slab(self, n0: int, n1: int) -> torch.Tensor:
        """Rows [n0, n1) as bf16 [n1 - n0, in] (int4: n0 a multiple of `PANEL`, n1 too or the last
        row), by the C kernel when it is built; int4 as the transposed view of an [in, n1 - n0]
        tensor (the panels' order; F.linear reads either)."""
        fn = (DEQUANT_INT8 if self.bits == 8 else DEQUANT_INT4).get() if self.qweight.is_cpu else None
        if fn is None:
            return self.dequantized(torch.bfloat16, slice(n0, n1))
        q, s, threads = self.qweight.data_ptr(), self.scales.data_ptr(), torch.get_num_threads()
        if self.bits == 8:
            w = torch.empty(n1 - n0, self.in_features, dtype=torch.bfloat16)
            fn(q, s, w.data_ptr(), n0, n1, self.in_features, threads)
            return w
        wt = torch.empty(self.in_features, n1 - n0, dtype=torch.bfloat16)
        fp16 = int(self.scales.dtype is torch.float16)
        fn(q, s, fp16, wt.data_ptr(), n0, n1, self.out_features, self.in_features, self.group_size, threads)
        return wt.T

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        """bf16 CPU input of 1..FEW_TOKENS rows, CPU weights, not traced by torch.compile.

        Runs on every call of every layer in decode: cheapest checks first, buffers read from
        ``_buffers`` (``nn.Module.__getattr__`` costs about a microsecond a name)."""
        bias = self._parameters.get("bias")
        return (
            x.dtype is torch.bfloat16
            and x.is_cpu
            and 0 < x.numel() <= FEW_TOKENS * self.in_features
            and self._buffers["qweight"].is_cpu
            and (bias is None or bias.dtype is torch.bfloat16)
            and not torch.compiler.is_compiling()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype; few-row bf16 CPU inputs accumulate in float32
        and round once."""
        if (prompt_rows_on() or self._decodes_in_integers()) and self._integer_applies(x):
            # prompt rows, however few: the numbers a one-piece prefill gives them (quant_gemm); int4
            # decode rows too where that kernel is the faster one
            y = self._forward_integer(x.reshape(-1, self.in_features))
            if y is not None:
                return y.view(*x.shape[:-1], self.out_features)
        fn = (INT8_KERNEL if self.bits == 8 else INT4_KERNEL).get() if self._kernel_applies(x) else None
        if fn is None:
            if rowwise_applies(x):
                # Packed decode rows of many sequences: each row as a one-row call computes it.
                group = FEW_TOKENS if self._kernel_applies(x.reshape(-1, self.in_features)[:1]) else 1
                return in_row_groups(x, group, self.forward, self.out_features)
            if self._integer_applies(x):
                y = self._forward_integer(x.reshape(-1, self.in_features))
                if y is not None:
                    return y.view(*x.shape[:-1], self.out_features)
            return self._forward_dequantized(x)
        if not x.is_contiguous():
            x = x.contiguous()
        n, k = self.out_features, self.in_features
        y = x.new_empty((*x.shape[:-1], n))
        bias = self._parameters.get("bias")
        bias = None if bias is None else bias.data_ptr()
        q, scales = self._buffers["qweight"].data_ptr(), self._buffers["scales"]
        rows, s, threads = x.numel() // k, scales.data_ptr(), torch.get_num_threads()
        if self.bits == 8:
            fn(x.data_ptr(), rows, q, s, bias, y.data_ptr(), n, k, threads)
        else:
            fp16 = int(scales.dtype is torch.float16)
            fn(x.data_ptr(), rows, q, s, fp16, bias, y.data_ptr(), n, k, self.group_size, threads)
        return y

    def _decodes_in_integers(self) -> bool:
        """int4 on a CPU whose integer kernel beats its float decode tile (`integer_int4_decode`): every
        row, however few, quantizes its activations as prefill does, so a decode row equals the
        same row prefilled, bit for bit."""
        return self.bits == 4 and integer_int4_decode()

    def _integer_applies(self, x: torch.Tensor) -> bool:
        return prefill_applies(x, self.qweight) and (self.bias is None or self.bias.dtype is torch.bfloat16)

    def _forward_integer(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, in] bf16 -> [M, out] bf16 by int8 activations (`quant_gemm`); None where the
        kernel does not apply."""
        if self.bits == 8:
            return int8_prefill(x, self.qweight, self.scales, self.bias)
        return int4_prefill(x, self.qweight, self.scales, self.group_size, self.bias)

    def _forward_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if not (x.is_cpu and x.dtype is torch.bfloat16):
            return F.linear(x, self.dequantized(x.dtype), bias)
        step = max(PANEL, SLAB_ELEMENTS // self.in_features // PANEL * PANEL)
        if step >= self.out_features:
            return F.linear(x, self._dequantized_slab(0, self.out_features), bias)
        parts = []
        for n0 in range(0, self.out_features, step):
            n1 = min(n0 + step, self.out_features)
            parts.append(F.linear(x, self._dequantized_slab(n0, n1), None if bias is None else bias[n0:n1]))
        return torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"
                f"{group}, bias={self.bias is not None}")


def quantize_(
    module: nn.Module, scheme: str, group_size: int = INT4_GROUP, skip: tuple[str, ...] = ()
) -> nn.Module:
    """Replace every ``nn.Linear`` inside `module` (but those named in `skip`, module paths) by its
    `QuantLinear` (scheme "int8" or "int4"), in place; returns `module`, or the new layer if `module`
    itself is a Linear. int4 layers whose input width is not a multiple of `group_size` get int8
    instead."""
    if scheme not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {scheme!r}; known: {', '.join(QUANTIZATIONS)}")

    def convert(layer: nn.Linear) -> QuantLinear:
        k = layer.in_features
        fits = k % group_size == 0
        return QuantLinear.from_linear(layer, scheme if scheme == "int8" or fits else "int8", group_size)

    if isinstance(module, nn.Linear):
        return convert(module)
    for path, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear) and f"{path}.{attr}".lstrip(".") not in skip:
                setattr(child, attr, convert(sub))
    return module


def kind_addresses(layers: list[QuantLinear]) -> tuple[ctypes.Array, ctypes.Array] | None:
    """The layers' weight and scale addresses as C arrays (what the grouped kernels take per product),
    where they are of one kind (`one_kind`), as a grouped call of them needs; else None."""
    if not one_kind(layers):
        return None
    buffers = [layer._buffers for layer in layers]
    q = int64_array([b["qweight"].data_ptr() for b in buffers])
    return q, int64_array([b["scales"].data_ptr() for b in buffers])


def one_kind(layers: list[QuantLinear]) -> bool:
    """Whether the layers are of one kind and shape (bits, group size, weight shape, scales' dtype, on
    the CPU) without bias. Reads ``_buffers``: it runs on every MoE layer of a decode step, where
    ``nn.Module.__getattr__`` would cost a microsecond a name."""
    first = layers[0]
    bits, group, shape = first.bits, first.group_size, first._buffers["qweight"].shape
    scale_dtype = first._buffers["scales"].dtype
    for layer in layers:
        q, scales = layer._buffers["qweight"], layer._buffers["scales"]
        if (
            layer.bits != bits
            or layer.group_size != group
            or q.shape != shape
            or scales.dtype is not scale_dtype
            or not q.is_cpu
            or layer._parameters.get("bias") is not None
        ):
            return False
    return True


def grouped_quantized(layers: list[QuantLinear], xs: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat([layer(x) for layer, x in zip(layers, xs)])`` (every x [M_i, in]) in one kernel call
    (one parallel region instead of one per product: a token's routed experts): [Σ M_i, out] with each
    product's bits, where every layer is of one kind and shape without bias and every x takes one
    path of `QuantLinear.forward`: the decode kernels (few bf16 rows), or int4's integer kernel
    (prompt rows, or int4 decode rows on a CPU whose integer kernel is the faster); else None
    (callers run them one by one)."""
    first, arrays = layers[0], kind_addresses(layers)
    if arrays is None or any(x.dim() != 2 for x in xs):
        return None
    # Every layer is of the first's kind, so the first answers for each which path x takes.
    if prompt_rows_on() or first._decodes_in_integers():
        integer = [first._integer_applies(x) for x in xs]
        if all(integer):
            if first.bits == 8:
                return None
            return int4_prefill_grouped([x.contiguous() for x in xs], [q.qweight for q in layers],
                                        [q.scales for q in layers], first.group_size)
        if any(integer):
            return None
    fn = (INT8_GROUPED_KERNEL if first.bits == 8 else INT4_GROUPED_KERNEL).get()
    if fn is None or not all(first._kernel_applies(x) for x in xs):
        return None
    xs = [x if x.is_contiguous() else x.contiguous() for x in xs]
    rows = [x.shape[0] for x in xs]
    y = xs[0].new_empty((sum(rows), first.out_features))
    xp, yp, mp = int64_array([x.data_ptr() for x in xs]), row_pointers(y, rows), int64_array(rows)
    qp, sp = arrays
    n, k, threads = first.out_features, first.in_features, torch.get_num_threads()
    if first.bits == 8:
        status = fn(xp, mp, qp, sp, None, yp, len(xs), n, k, threads)
    else:
        fp16 = int(first._buffers["scales"].dtype is torch.float16)
        status = fn(xp, mp, qp, sp, fp16, None, yp, len(xs), n, k, first.group_size, threads)
    if status:
        raise MemoryError("the grouped quantized kernel could not allocate its float32 inputs")
    return y
