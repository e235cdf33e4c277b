"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a registered family.

Loading is all-or-nothing: every tensor is checked (name, shape) before the model is returned,
and any problem raises `CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hybridlm.models.base import FAMILIES, CausalLM
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
from hybridlm.models.fused import fuse_projections
from hybridlm.models.gptq import is_gptq, load_gptq
from hybridlm.models.quantized import is_quantized, load_quantized, quantize_model

log = logging.getLogger(__name__)


def family_for(config: dict, root: Path) -> type[CausalLM]:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise CheckpointError(
            f"{root / 'config.json'}: unsupported model_type {model_type!r} (supported: {known})"
        )
    return FAMILIES[model_type]


def load_model(
    path: str | Path, dtype: torch.dtype | None = None, device=None, quantize: str | None = None
) -> CausalLM:
    """Build the family named by config.json and load its weights (bf16 unless `dtype` says).

    quantize: "int8" / "int4" quantizes every linear layer on load (`models.quantized`); a
    checkpoint written by `save_quantized` loads quantized as it was saved, a GPTQ checkpoint as
    int4 (`models.gptq`); `quantize` must then be None or that scheme. Linear layers that read the
    same input are fused once loaded (`models.fused`)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    raw = read_json(root / "config.json")
    cls = family_for(raw, root)
    if is_quantized(raw):
        saved = raw["quantization_config"].get("scheme")
        if quantize not in (None, saved):
            raise CheckpointError(f"{root}: already quantized as {saved}; cannot load it as {quantize}")
        return fuse_projections(load_quantized(cls, root, raw, dtype, device))
    if is_gptq(raw):
        if quantize not in (None, "int4"):
            raise CheckpointError(f"{root}: a GPTQ int4 checkpoint; cannot load it as {quantize}")
        return fuse_projections(load_gptq(cls, root, raw, dtype, device))
    model = load_weights(cls, root, raw, dtype, device)
    return fuse_projections(model if quantize is None else quantize_model(model, quantize))


def load_weights(cls, root: Path, raw: dict, dtype: torch.dtype | None = None, device=None):
    """Build `cls` (a `CausalLM`, or a module with the same loading hooks: `text_config`, `remap`,
    `convert`, `tied`, `model.embed_tokens`, `lm_head`) from config.json's contents `raw` and load
    the checkpoint's tensors into it, all or nothing. Integer tensors keep their dtype."""
    config = cls.text_config(raw)
    dtype = dtype or torch.bfloat16
    device = torch.device(device) if device is not None else default_device()
    with torch.device("meta"):
        model = cls(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.tied:
        expected.pop("lm_head.weight", None)

    def rename(name: str) -> str | None:
        target = cls.remap(name, config)
        return None if model.tied and target == "lm_head.weight" else target

    state, source = read_tensors(weight_files(root), rename)
    state = cls.convert(state, config)
    check_tensors(state, expected, source, root)
    keep = getattr(cls, "keep_float32", ())
    state = {k: placed(v, device, load_dtype(k, v, dtype, keep)) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if model.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    log.debug("loaded %s from %s (%d tensors)", type(model).__name__, root, len(state))
    return model
