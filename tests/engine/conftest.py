import pytest
import torch

import hybridlm
from hybridlm.demo import write_demo_model
from hybridlm.engine import Engine


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(autouse=True)
def single_thread():
    # The demo model is tiny: intra-op threads only add synchronisation, which dominates on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model(demo_dir):
    return hybridlm.load_model(demo_dir)


@pytest.fixture(scope="session")
def model32(demo_dir):
    """float32 weights: cached decoding and a full recompute agree to ~1e-5, so argmax comparisons hold."""
    return hybridlm.load_model(demo_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model.lm, model.tokenizer) as e:
        yield e


@pytest.fixture(scope="session")
def chat_ids(model):
    def make(text: str) -> list[int]:
        tok = model.tokenizer
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    return make
