"""Whole-model weight-only quantization (int8 / int4) and quantized checkpoints.

`quantize_model` swaps every linear layer of a loaded model, the LM head included, for a
`QuantLinear` (`ops.quant`). The embedding table stays in the model's dtype: a lookup reads one row
per token, so quantizing it would save memory but no decode time, and with tied embeddings the head
is quantized on its own while the table keeps serving lookups.

A quantized checkpoint is a directory written by `save_quantized`:

- ``config.json``: the source's, plus ``"quantization_config": {"quant_method": "hybridlm",
  "scheme": "int8" | "int4", "bits": 8 | 4, "group_size": G, "layout": ...}``;
- ``model.safetensors``: tensors under the implementation's parameter names (after the family's
  renaming and fusing, so loading needs neither), where each quantized layer ``X`` holds, as in
  GPTQ's naming, ``X.qweight`` and ``X.scales`` (and ``X.bias`` when it has one) instead of
  ``X.weight``:

  - int8: ``qweight`` int8 [out, in], symmetric per output channel; ``scales`` float32 [out];
    ``W = qweight * scales[:, None]``.
  - int4: ``qweight`` uint8 [out, in / 2] holding little-endian 32-bit words, each eight weights
    of a row, ``q[n, 8b + s] + 8`` in bits 4s .. 4s + 3 (symmetric, q in [-8, 7], no zero points:
    GPTQ's word format with its symmetric zero point 8); the words in panels of 16 rows: rows
    16p .. 16p + 15 of the array hold panel p, word (b, n) at b * 16 + n (the last panel holds the
    out % 16 rows left, word (b, n) at b * (out % 16) + n). ``scales`` bf16 [out, in / G], one per
    group of G weights of a row, panel-ordered the same way (`ops.quant.to_panels`):
    ``W[n, k] = q[n, k] * scale[n, k // G]``. GPTQ stores the words transposed ([in / 8, out]); the
    panels follow the CPU kernel's reads, where a 64-byte load is eight weights of 16 rows.

  Routed-expert stacks are quantized per expert and projection: ``X.gate_up_proj.{e}.qweight`` /
  ``.scales`` (``X.up_proj`` for non-gated experts) and ``X.down_proj.{e}.qweight`` / ``.scales``
  (`models.moe.QuantExperts`) in place of the stacked ``X.gate_up_proj`` / ``X.down_proj``.
  Everything else (embedding table, norms, convolutions, MoE routers and shared-expert gates) keeps the
  model's dtype;
  the source's ``mtp.*`` tensors are copied unchanged, so a multi-token-prediction head still loads.
- the source's other files (tokenizer, chat template, generation config).

Loading a quantized checkpoint gives the very same tensors, hence bit-identical logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hybridlm.models.base import CausalLM
from hybridlm.models.checkpoint import (
    CheckpointError,
    check_tensors,
    default_device,
    load_dtype,
    placed,
    read_json,
    read_tensors,
    weight_files,
)
from hybridlm.models.fused import unfused_state
from hybridlm.models.moe import Experts, QuantExperts
from hybridlm.ops.quant import INT4_GROUP, QUANTIZATIONS, QuantLinear, quantize_

__all__ = ["QUANT_METHOD", "is_quantized", "load_quantized", "quantize_model", "save_quantized"]

QUANT_METHOD = "hybridlm"
LAYOUT = "qweight/scales per linear layer; int4 in 16-row panels of 8-weight words (models/quantized.py)"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_quantized(raw: dict) -> bool:
    """Whether config.json's contents `raw` describe a checkpoint written by `save_quantized`."""
    return (raw.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD


def _place_buffers(model: nn.Module) -> None:
    """Move each quantized layer's buffers into `placed` memory (huge pages on the CPU)."""
    for layer in model.modules():
        if isinstance(layer, QuantLinear):
            for name in ("qweight", "scales"):
                t = getattr(layer, name)
                setattr(layer, name, placed(t, t.device, t.dtype))


def _kept_of(model: nn.Module) -> tuple[str, ...]:
    """Module paths of the linears a block keeps in the model's dtype (its ``UNQUANTIZED`` names): MoE
    routers and shared-expert gates, which make choices or scale a whole expert, and which the router
    kernel computes in its call (`ops.moe.route_rows`); quantizing a [1, d] gate saved 1.5 KB a layer and
    cost a call."""
    return tuple(
        f"{path}.{name}".lstrip(".")
        for path, module in model.named_modules()
        for name in getattr(module, "UNQUANTIZED", ())
        if isinstance(module._modules.get(name), nn.Linear)
    )


@torch.no_grad()
def _experts_of(model: nn.Module) -> list[tuple[str, nn.Module, str, Experts]]:
    """(module path, parent module, attribute, module) of every bf16 routed-expert stack of `model`."""
    return [
        (f"{path}.{attr}".lstrip("."), parent, attr, child)
        for path, parent in model.named_modules()
        for attr, child in parent.named_children()
        if isinstance(child, Experts)
    ]


def quantize_model(model: CausalLM, scheme: str, group_size: int = INT4_GROUP) -> CausalLM:
    """Quantize every linear layer of `model` (LM head included) and every routed-expert stack
    (`models.moe.QuantExperts`) by `scheme` ("int8" / "int4"), in place; returns `model`, with
    ``model.quantization`` = {"scheme", "group_size"}."""
    if scheme not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {scheme!r}; known: {', '.join(QUANTIZATIONS)}")
    if getattr(model, "quantization", None):
        raise ValueError(f"the model is already quantized ({model.quantization['scheme']})")
    quantize_(model, scheme, group_size, skip=_kept_of(model))
    for _, parent, attr, experts in _experts_of(model):
        setattr(parent, attr, QuantExperts.from_experts(experts, scheme, group_size))
    _place_buffers(model)
    model.quantization = {"scheme": scheme, "group_size": group_size if scheme == "int4" else None}
    return model


def save_quantized(model: CausalLM, source: str | Path, out: str | Path) -> Path:
    """Write quantized `model` (loaded from checkpoint directory `source`) as a quantized checkpoint
    directory `out` (see the module docstring); returns `out`."""
    source, out = Path(source), Path(out)
    quant = getattr(model, "quantization", None)
    if not quant:
        raise ValueError("the model is not quantized (quantize_model first)")
    state = {k: v.contiguous() for k, v in unfused_state(model).items()}
    if model.tied and isinstance(model.lm_head, nn.Linear):
        state.pop("lm_head.weight")  # the embedding table, tied back on load
    for file in weight_files(source):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith("mtp."):
                    state[name] = f.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in state.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            shutil.copy2(f, out / f.name)
    raw = read_json(source / "config.json")
    bits = 8 if quant["scheme"] == "int8" else 4
    raw["quantization_config"] = {
        "quant_method": QUANT_METHOD, "scheme": quant["scheme"], "bits": bits,
        "group_size": quant["group_size"], "layout": LAYOUT,
    }
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def _empty_layer(layer: nn.Linear, q: torch.Tensor, scales: torch.Tensor | None, what: str) -> QuantLinear:
    """The `QuantLinear` (on the current device, meta when loading) that tensors `q` / `scales`
    describe for `layer`; CheckpointError naming `what` when they fit no layout."""
    bits = {torch.int8: 8, torch.uint8: 4}.get(q.dtype)
    want = {8: ((torch.float32,), 1), 4: ((torch.bfloat16, torch.float16), 2)}.get(bits)
    if want is None or scales is None or scales.dtype not in want[0] or scales.dim() != want[1]:
        raise CheckpointError(f"{what} is not an int8 / int4 layer of this layout (qweight int8 + float32 "
                              "scales [out], or uint8 + bf16 / fp16 scales [out, groups])")
    group = layer.in_features // max(1, scales.shape[-1]) if bits == 4 else layer.in_features
    try:
        return QuantLinear(layer.in_features, layer.out_features, bits, group, layer.bias is not None,
                           scale_dtype=scales.dtype if bits == 4 else torch.bfloat16)
    except ValueError as e:
        raise CheckpointError(f"{what}: {e}") from None


def _empty_experts(
    model: nn.Module, state: dict[str, torch.Tensor], source: dict[str, Path], root: Path
) -> tuple[str, ...]:
    """Swap each expert stack of the (meta) `model` whose tensors `state` holds quantized
    (`experts.gate_up_proj.{e}.qweight`, or `up_proj` for non-gated experts, ...) for the empty
    `QuantExperts` they describe; returns the swapped stacks' name prefixes ("path.")."""
    done = []
    for path, parent, attr, experts in _experts_of(model):
        first = experts.first
        if f"{path}.{first}.0.qweight" not in state:
            continue
        e, (rows, d) = experts.num_experts, getattr(experts, first).shape[1:]
        inter = rows // 2 if experts.gated else rows
        layers = {}
        for proj, shape in ((first, (rows, d)), ("down_proj", (d, inter))):
            template = nn.Linear(shape[1], shape[0], bias=False)
            layers[proj] = []
            for j in range(e):
                name = f"{path}.{proj}.{j}"
                if name + ".qweight" not in state:
                    raise CheckpointError(f"{root}: missing tensor {name + '.qweight'!r}")
                q, scales = state[name + ".qweight"], state.get(name + ".scales")
                what = f"{source[name + '.qweight']}: {name!r}"
                layers[proj].append(_empty_layer(template, q, scales, what))
        quant = QuantExperts(layers[first], layers["down_proj"], experts.act_name, experts.gated)
        setattr(parent, attr, quant)
        done.append(path + ".")
    return tuple(done)


def assign_state(
    model: CausalLM, state: dict[str, torch.Tensor], source: dict[str, str], root: Path, dtype, device
) -> None:
    """Check `state` against the (meta) model with its quantized layers in place, then assign it: float
    tensors in `dtype`, integer weights and scales as stored, on `device`; a float LM head tied to
    the embedding shares it (a quantized head is its own)."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tie = model.tied and isinstance(model.lm_head, nn.Linear)
    if tie:
        expected.pop("lm_head.weight", None)
    check_tensors(state, expected, source, root)

    def keeps_dtype(name: str, t: torch.Tensor) -> bool:
        return not t.is_floating_point() or name.endswith(".scales")

    keep = getattr(type(model), "keep_float32", ())
    state = {k: placed(v, device, v.dtype if keeps_dtype(k, v) else load_dtype(k, v, dtype, keep))
             for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if tie:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()


def load_quantized(cls, root: Path, raw: dict, dtype: torch.dtype | None = None, device=None) -> CausalLM:
    """Build `cls` from a quantized checkpoint directory `root` (config.json contents `raw`), all or
    nothing: every tensor is checked (name, shape, dtype of the quantized ones)."""
    layout = raw["quantization_config"].get("layout")
    if layout != LAYOUT:
        raise CheckpointError(f"{root / 'config.json'}: quantized layout {layout!r} is not this version's "
                              f"({LAYOUT!r}); quantize the source checkpoint again")
    config = cls.text_config(raw)
    dtype = dtype or torch.bfloat16
    device = torch.device(device) if device is not None else default_device()
    state, source = read_tensors(weight_files(root), lambda name: None if name.startswith("mtp.") else name)
    with torch.device("meta"):
        model = cls(config)
        stacks = _empty_experts(model, state, source, root)
        for name in [n.removesuffix(".qweight") for n in state if n.endswith(".qweight")]:
            if name.startswith(stacks):
                continue
            where = source[name + ".qweight"]
            parent_name, _, attr = name.rpartition(".")
            try:
                parent = model.get_submodule(parent_name)
            except AttributeError:
                raise CheckpointError(f"{where}: {name!r} is no layer of the model") from None
            layer = getattr(parent, attr, None)
            if not isinstance(layer, nn.Linear):
                raise CheckpointError(f"{where}: {name!r} is not a linear layer")
            setattr(parent, attr, _empty_layer(layer, state[name + ".qweight"], state.get(name + ".scales"),
                                               f"{where}: {name!r}"))
    assign_state(model, state, source, root, dtype, device)
    quant = raw["quantization_config"]
    model.quantization = {"scheme": quant.get("scheme"), "group_size": quant.get("group_size")}
    return model
