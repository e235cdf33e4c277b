import pytest
import torch

from hybridlm.models import load_model


@pytest.fixture(scope="session")
def tiny_model(checkpoints):
    """The GDN + attention hybrid (float32) the state-machine tests drive."""
    return load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")
