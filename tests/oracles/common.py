"""Random-weight checkpoints of every family, written by transformers itself (`save_pretrained`),
so they carry the real tensor names and config layouts. transformers is the oracle: `reference`
loads the same directory back into its own implementation.

Each family module in this package defines `BUILDERS` (checkpoint name -> builder(out) ->
Checkpoint) and `REPRESENTATIVE` (the names the slower cache-path tests run on).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 512


@dataclass
class Checkpoint:
    path: Path
    hf_class: type
    family: str

    def reference(self, dtype=torch.float32):
        """transformers' own model for this checkpoint (eval mode)."""
        return self.hf_class.from_pretrained(self.path, dtype=dtype).eval()


def save(model, out: Path, name: str, seed: int = 1) -> Checkpoint:
    """Randomize every weight of a transformers model and save it."""
    randomize(model, seed)
    model.save_pretrained(out)
    return Checkpoint(out, type(model), name)


def randomize(model, seed: int) -> None:
    """Make every parameter random and O(1)-scaled, including norms/gates that init to constants,
    so parity tests exercise every weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(p + torch.randn(p.shape, generator=g) * 0.1)


def randomize_router_bias(model, seed: int) -> None:
    """Random `e_score_correction_bias` buffers (DeepSeek-style routers; zero at init, so parity would
    not see whether the bias steers the choice of experts)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
