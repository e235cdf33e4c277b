import os

import pytest
import torch

torch.set_flush_denormal(True)
os.environ.setdefault("HYBRIDLM_LOG_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Builds (once per session) random transformers checkpoints by name; see tests/oracles."""
    from tests.oracles.checkpoints import build

    root = tmp_path_factory.mktemp("ckpt")
    made: dict[str, object] = {}

    def get(name: str):
        if name not in made:
            made[name] = build(name, root / name)
        return made[name]

    return get
