import pytest
import torch


@pytest.fixture
def single_thread():
    """One intra-op thread: the quantized and fused tests' models are tiny, and the kernels' results
    must not depend on the thread count anyway (tested in tests/ops)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
