import pytest
import torch

from hybridlm.models import load_model
from hybridlm.ops.quant import quantize_


@pytest.fixture(autouse=True)
def single_thread():
    # The test models are tiny: intra-op threads only add synchronisation on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models(checkpoints):
    """float32 models by checkpoint name, loaded once; `int8=True` gives a weight-only int8 copy."""
    made = {}

    def get(name: str, int8: bool = False):
        if (name, int8) not in made:
            model = load_model(checkpoints(name).path, dtype=torch.float32, device="cpu")
            made[name, int8] = quantize_(model, "int8") if int8 else model
        return made[name, int8]

    return get
