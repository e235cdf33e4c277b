"""Random-weight checkpoints written by hybridlm itself (benchmarks, no transformers needed).

The tensors have the shapes of the family's published checkpoints and the names hybridlm's loader
takes, which for most families are the published ones (or names llama.cpp's converter also reads);
a family whose converter reads only its published layout writes that (`CausalLM.published`:
Granite 4.0-H).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridlm.models.base import FAMILIES
from hybridlm.ops.norms import OffsetRMSNorm


def random_state(config: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Tensors for every parameter of the family, seeded: matrices ~ N(0, 0.02²), norms at their
    identity value, Gated DeltaNet decay parameters in their trained ranges."""
    cls = FAMILIES[config["model_type"]]
    with torch.device("meta"):
        model = cls(cls.text_config(config))
    zero_centred = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, OffsetRMSNorm)}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        if model.tied and name == "lm_head.weight":
            continue
        if name.endswith("A_log"):
            t = torch.log(torch.rand(p.shape, generator=g) * 15 + 1)
        elif name in zero_centred or name.endswith(".bias"):
            t = torch.zeros(p.shape)
        elif p.dim() == 1:
            t = torch.ones(p.shape)
        else:
            t = torch.randn(p.shape, generator=g) * 0.02
        state[name] = t.to(dtype)
    return state


def write_random_checkpoint(config: dict, out: str | Path, seed: int = 0) -> Path:
    """Write config.json + model.safetensors (bf16) for `config` into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cls = FAMILIES[config["model_type"]]
    state = cls.published(random_state(config, seed), cls.text_config(config))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def cached_random_checkpoint(config: dict, out: Path, name: str) -> Path:
    """`out`, holding a random checkpoint of `config` written on first use, and again when the
    config changed since (into a temporary directory renamed into place, so a concurrent or
    interrupted writer never leaves half of one)."""
    written = out / "config.json"
    if written.exists() and json.loads(written.read_text()) != json.loads(json.dumps(config)):
        print(f"the {name} preset changed since {out} was written: writing it again", flush=True)
        shutil.rmtree(out)
    if not written.exists():
        print(f"writing a random {name} checkpoint to {out} ...", flush=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        write_random_checkpoint(config, tmp)
        tmp.rename(out)
    return out
