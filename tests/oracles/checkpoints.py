"""Every oracle checkpoint by name, gathered from the family modules."""

from __future__ import annotations

from pathlib import Path

from tests.oracles import (
    bamba,
    dense,
    falcon_h1,
    gemma3,
    gemma4,
    granitemoehybrid,
    lfm2,
    mtp,
    nemotron_h,
    qwen3_5,
    qwen3_next,
)
from tests.oracles.common import Checkpoint

MODULES = [qwen3_5, qwen3_next, lfm2, gemma3, gemma4, dense, mtp]
MODULES += [bamba, granitemoehybrid, nemotron_h, falcon_h1]  # the Mamba-2 hybrids
BUILDERS = {name: fn for m in MODULES for name, fn in m.BUILDERS.items()}
REPRESENTATIVE = [name for m in MODULES for name in m.REPRESENTATIVE]


def build(name: str, out: Path) -> Checkpoint:
    """Write checkpoint `name` into `out`."""
    return BUILDERS[name](out)
