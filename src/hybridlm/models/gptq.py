"""Loading published GPTQ int4 checkpoints (AutoGPTQ / GPTQModel / optimum layout) into `QuantLinear`s.

A GPTQ checkpoint's config.json carries ``quantization_config = {"quant_method": "gptq", "bits",
"group_size", "sym", "desc_act", "checkpoint_format" ("gptq" or "gptq_v2"; newer writers say
"format")}``, and each quantized linear layer ``X`` (weight [out, in]) is stored as:

- ``X.qweight`` int32 [in / 8, out]: word (r, n) holds the unsigned 4-bit ``q[8r + j, n]`` in bits
  4j .. 4j + 3;
- ``X.qzeros`` int32 [in / G, out / 8]: word (g, c) holds the zero point of group g, column
  8c + j in bits 4j .. 4j + 3 — minus one in the "gptq" (v1) format, as is in "gptq_v2";
- ``X.scales`` fp16 [in / G, out]; ``X.g_idx`` int32 [in] (the group of each input; optional);
  ``X.bias`` when the layer has one.

``W[n, k] = scales[g, n] · (q[k, n] − zero[g, n])`` with ``g = g_idx[k]`` (AutoGPTQ's
``qlinear_cuda_old.QuantLinear``: ``pack`` stores ``zeros - 1``, the torch path adds the 1 back).
Symmetric 4-bit checkpoints have every zero point 8, so ``q − 8`` is the signed value our int4
layout stores as ``q − 8 + 8``, in the very same word format: loading only re-tiles the words into
16-row panels and keeps the fp16 scales, so the loaded layer computes ``W`` exactly. Asymmetric
zero points, act-order (``desc_act``, or a ``g_idx`` that is not ``k // G``), other bit widths and
per-module overrides (GPTQModel's ``dynamic``) are refused with a `CheckpointError`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hybridlm.models.base import CausalLM
from hybridlm.models.checkpoint import (
    CheckpointError,
    default_device,
    read_tensors,
    weight_files,
)
from hybridlm.models.quantized import assign_state
from hybridlm.ops.quant import QuantLinear, to_panels

__all__ = ["dequantize_gptq", "is_gptq", "load_gptq"]

PARTS = ("qweight", "qzeros", "scales", "g_idx")
NIBBLES = 8  # 4-bit values per int32 word


def is_gptq(raw: dict) -> bool:
    """Whether config.json's contents `raw` describe a GPTQ checkpoint."""
    return (raw.get("quantization_config") or {}).get("quant_method") == "gptq"


def _settings(raw: dict, where: Path) -> tuple[int, bool]:
    """(group size or -1, v1 zero points) of a GPTQ config we can load; CheckpointError otherwise."""
    q = raw["quantization_config"]
    fmt = q.get("checkpoint_format") or q.get("format") or "gptq"
    problems = []
    if q.get("bits") != 4:
        problems.append(f"bits {q.get('bits')} (only 4)")
    if q.get("sym") is False:
        problems.append("sym=false (asymmetric zero points)")
    if q.get("desc_act"):
        problems.append("desc_act=true (act-order groups)")
    if q.get("dynamic"):
        problems.append("per-module 'dynamic' overrides")
    if fmt not in ("gptq", "gptq_v2"):
        problems.append(f"checkpoint format {fmt!r}")
    if q.get("pack_dtype", "int32") != "int32":
        problems.append(f"pack_dtype {q.get('pack_dtype')!r}")
    group = q.get("group_size", -1)
    if not isinstance(group, int) or (group != -1 and group <= 0):
        problems.append(f"group_size {group!r}")
    if problems:
        raise CheckpointError(f"{where}: GPTQ checkpoint not supported: {'; '.join(problems)} "
                              "(hybridlm loads symmetric 4-bit GPTQ without act-order)")
    return group, fmt == "gptq"


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., c] -> int32 [..., c, 8]: the 4-bit fields, field j from bits 4j .. 4j + 3."""
    shifts = torch.arange(0, 4 * NIBBLES, 4, dtype=torch.int32)
    return (words[..., None] >> shifts) & 15


def dequantize_gptq(parts: dict[str, torch.Tensor], v1: bool) -> torch.Tensor:
    """A GPTQ layer's weight [out, in] in float64 by the published formula (for tests and checks)."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, n = qweight.shape[0] * NIBBLES, qweight.shape[1]
    q = _nibbles(qweight).permute(0, 2, 1).reshape(k, n)
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], n) + (1 if v1 else 0)
    g = parts["g_idx"].long() if "g_idx" in parts else torch.arange(k) // (k // qzeros.shape[0])
    return (scales.double()[g] * (q - zeros[g]).double()).T


def _layer(parts: dict[str, torch.Tensor], layer: nn.Linear, v1: bool, group: int, what: str) -> QuantLinear:
    """The `QuantLinear` equal to GPTQ tensors `parts` of `layer` (CPU tensors); CheckpointError if
    they are not a symmetric int4 layer of the expected shapes."""
    k, n = layer.in_features, layer.out_features
    group = k if group == -1 else group
    missing = [p for p in PARTS[:3] if p not in parts]
    if missing:
        raise CheckpointError(f"{what}: GPTQ layer without {', '.join(missing)}")
    if k % group or group % NIBBLES or n % NIBBLES:
        raise CheckpointError(f"{what}: in_features {k} / out_features {n} do not fit group size {group} "
                              f"(in must divide into groups of a multiple of 8 inputs, out into words of 8)")
    shapes = {"qweight": (k // NIBBLES, n), "qzeros": (k // group, n // NIBBLES), "scales": (k // group, n),
              "g_idx": (k,)}
    dtypes = {"qweight": torch.int32, "qzeros": torch.int32, "scales": torch.float16, "g_idx": torch.int32}
    for name, t in parts.items():
        if tuple(t.shape) != shapes[name] or t.dtype != dtypes[name]:
            raise CheckpointError(f"{what}.{name}: {t.dtype} {tuple(t.shape)}, expected {dtypes[name]} "
                                  f"{shapes[name]}")
    if "g_idx" in parts and not torch.equal(parts["g_idx"].long(), torch.arange(k) // group):
        raise CheckpointError(f"{what}.g_idx: inputs are not in groups of {group} in order (act-order)")
    zeros = _nibbles(parts["qzeros"]) + (1 if v1 else 0)
    if not torch.all(zeros == 8):
        raise CheckpointError(f"{what}.qzeros: zero points other than 8 (asymmetric quantization)")
    out = QuantLinear(k, n, 4, group, layer.bias is not None, device="cpu", scale_dtype=torch.float16)
    # GPTQ's word (r, n) is our word (n, r): same nibble order, same unsigned values (zero point 8)
    words = parts["qweight"].T.contiguous()
    out.qweight = to_panels(words).contiguous().view(torch.uint8).view(n, k // 2)
    out.scales = to_panels(parts["scales"].T.contiguous()).contiguous()
    return out


def load_gptq(cls: type[CausalLM], root: Path, raw: dict, dtype: torch.dtype | None = None,
              device=None) -> CausalLM:
    """Build `cls` from GPTQ checkpoint directory `root` (config.json contents `raw`): its quantized
    layers as int4 `QuantLinear`s with fp16 scales, every other tensor as `load_weights` loads it.
    All or nothing: every tensor is checked."""
    group, v1 = _settings(raw, root / "config.json")
    config = cls.text_config(raw)
    dtype = dtype or torch.bfloat16
    device = torch.device(device) if device is not None else default_device()
    with torch.device("meta"):
        model = cls(config)

    def rename(name: str) -> str | None:
        base, _, part = name.rpartition(".")
        if part in PARTS:  # a GPTQ tensor: renamed by its layer's weight name
            target = cls.remap(f"{base}.weight", config)
            return None if target is None else f"{target.removesuffix('.weight')}.{part}"
        target = cls.remap(name, config)
        return None if model.tied and target == "lm_head.weight" else target

    state, source = read_tensors(weight_files(root), rename)
    layers = sorted({n.rpartition(".")[0] for n in state if n.endswith(".qweight")})
    quantized = {}
    for name in layers:
        where = f"{source[name + '.qweight']}: {name!r}"
        parent_name, _, attr = name.rpartition(".")
        try:
            layer = getattr(model.get_submodule(parent_name), attr, None)
        except AttributeError:
            layer = None
        if not isinstance(layer, nn.Linear):
            raise CheckpointError(f"{where} is no linear layer of hybridlm's {cls.__name__} (layers that are "
                                  "fused or split on load cannot be loaded from GPTQ tensors)")
        parts = {p: state.pop(f"{name}.{p}") for p in PARTS if f"{name}.{p}" in state}
        quantized[name] = _layer(parts, layer, v1, group, where)
    if not quantized:
        raise CheckpointError(f"{root}: a GPTQ config.json but no GPTQ tensors (*.qweight)")
    state = cls.convert(state, config)
    with torch.device("meta"):
        for name, q in quantized.items():
            parent_name, _, attr = name.rpartition(".")
            empty = QuantLinear(q.in_features, q.out_features, 4, q.group_size, q.bias is not None,
                                scale_dtype=torch.float16)
            setattr(model.get_submodule(parent_name), attr, empty)
    for name, q in quantized.items():
        state[f"{name}.qweight"], state[f"{name}.scales"] = q.qweight, q.scales
    assign_state(model, state, source, root, dtype, device)
    model.quantization = {"scheme": "int4", "group_size": next(iter(quantized.values())).group_size}
    return model
