"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a registered family.

Loading is all-or-nothing: every tensor is checked (name, shape) before the model is returned,
and any problem raises `CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import json
import logging
import mmap
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from hybridlm.models.base import FAMILIES, CausalLM

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as it is."""


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index, else every *.safetensors."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [root / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: names missing files {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files (pickle checkpoints are not read)")
    return files


def read_tensors(
    files: list[Path], rename: Callable[[str], str | None]
) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of `files` that `rename` maps to a name (None skips it): (tensors by new name,
    the file each came from)."""
    state: dict[str, torch.Tensor] = {}
    source: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    target = rename(name)
                    if target is None:
                        continue
                    if target in source:
                        raise CheckpointError(f"{file}: tensor {name!r} duplicates one in {source[target]}")
                    state[target] = f.get_tensor(name)
                    source[target] = file
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers/data
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
    return state, source


def check_tensors(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Size], source: dict[str, Path], root: Path
) -> None:
    """Raise `CheckpointError` unless `state` holds exactly the `expected` names and shapes."""
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise CheckpointError(
            f"{source.get(name, root)}: unexpected tensor {name!r} ({len(unexpected)} in all)"
        )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"{root}: missing tensor {missing[0]!r} ({len(missing)} missing: {missing[:5]})"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            where = source.get(name, root)
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(state[name].shape)}, expected {tuple(shape)}"
            )


def family_for(config: dict, root: Path) -> type[CausalLM]:
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise CheckpointError(
            f"{root / 'config.json'}: unsupported model_type {model_type!r} (supported: {known})"
        )
    return FAMILIES[model_type]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


HUGE_PAGE = 2 << 20


def placed(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a model weight on `device` in `dtype`. On the CPU, weights of a megabyte or more go
    into anonymous memory advised for transparent huge pages: decode streams every weight once per
    token, and with 4 KiB pages each page read is a TLB miss (a Qwen3.5-0.8B-shaped bf16 decode
    step took 72-74 ms on 4 KiB pages and 67 ms on 2 MiB ones)."""
    nbytes = t.numel() * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE // 2 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return t.to(device=device, dtype=dtype)
    # Private: shared anonymous memory is shmem, which follows another huge-page policy.
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps `memory` alive (frombuffer holds a reference to the buffer).
    out = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).view(t.shape)
    return out.copy_(t)


def load_model(
    path: str | Path, dtype: torch.dtype | None = None, device=None, quantize: str | None = None
) -> CausalLM:
    """Build the family named by config.json and load its weights (bf16 unless `dtype` says).

    quantize: "int8" / "int4" quantizes every linear layer on load (`models.quantized`); a
    checkpoint written by `save_quantized` loads quantized as it was saved, a GPTQ checkpoint as
    int4 (`models.gptq`); `quantize` must then be None or that scheme. Linear layers that read the
    same input are fused once loaded (`models.fused`)."""
    from hybridlm.models.fused import fuse_projections
    from hybridlm.models.gptq import is_gptq, load_gptq
    from hybridlm.models.quantized import is_quantized, load_quantized, quantize_model

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
    # index tables (the Gemma 4 assistant's token ordering) must not become floats
    state = {k: placed(v, device, dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if model.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    log.debug("loaded %s from %s (%d tensors)", type(model).__name__, root, len(state))
    return model
