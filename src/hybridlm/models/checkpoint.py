"""Reading a checkpoint directory: config.json, safetensors files, the tensor checks, and placing
weights in memory. The loaders (`loader`, `quantized`, `gptq`, `mtp`, the assistant) all build on it;
it imports none of them.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open


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


def take(state: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Pop tensor `name` from `state`, checking its shape (`CheckpointError` when missing or misshapen)."""
    if name not in state:
        raise CheckpointError(f"missing tensor {name!r}")
    t = state.pop(name)
    if tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


# Tensors that keep float32 whatever dtype the model loads in: a router's selection bias
# (`models.moe.Router`), whose small differences between experts decide the choice; a bf16 copy
# rounds biases near 2 to steps of 1/64, more than the scores it separates.
FLOAT32_SUFFIXES = (".e_score_correction_bias",)


def load_dtype(name: str, t: torch.Tensor, dtype: torch.dtype, keep: tuple[str, ...] = ()) -> torch.dtype:
    """The dtype checkpoint tensor `name` (`t`) takes in a model loaded in `dtype`: integer tensors keep
    theirs (index tables: the Gemma 4 assistant's token ordering), names ending in `FLOAT32_SUFFIXES`
    or the family's `keep` (`CausalLM.keep_float32`) float32, other floating tensors `dtype`."""
    if not t.is_floating_point():
        return t.dtype
    return torch.float32 if name.endswith(FLOAT32_SUFFIXES + keep) else dtype


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
