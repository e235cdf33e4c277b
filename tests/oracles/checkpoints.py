"""Every oracle checkpoint by name, gathered from the family modules."""

from __future__ import annotations

from pathlib import Path

from tests.oracles import (
    bailing_hybrid,
    bamba,
    dense,
    falcon_h1,
    gemma3,
    gemma4,
    granitemoehybrid,
    kimi_linear,
    lfm2,
    lfm2_moe,
    mtp,
    nemotron_h,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
)
from tests.oracles.common import Checkpoint

MODULES = [
    qwen3_5, qwen3_next, qwen3_5_moe, lfm2, lfm2_moe, gemma3, gemma4, dense, mtp, kimi_linear, bailing_hybrid
]
MODULES += [bamba, granitemoehybrid, nemotron_h, falcon_h1]  # the Mamba-2 hybrids
BUILDERS = {name: fn for m in MODULES for name, fn in m.BUILDERS.items()}
REPRESENTATIVE = [name for m in MODULES for name in m.REPRESENTATIVE]


def build(name: str, out: Path) -> Checkpoint:
    """Write checkpoint `name` into `out`."""
    return BUILDERS[name](out)
