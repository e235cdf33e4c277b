import os

# Under pytest-xdist the two workers share the machine's cores: one torch thread each (and in the
# servers they start) keeps OpenMP's spinning teams from fighting over the same cores. Set before
# torch loads, which reads it once; tests of multi-threaded behaviour set their thread counts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_flush_denormal(True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
os.environ.setdefault("HYBRIDLM_LOG_LEVEL", "WARNING")


@pytest.fixture
def single_thread():
    """One intra-op thread, restored after: the tests' models are tiny (intra-op threads only add
    synchronisation, which dominates on a busy machine), and kernels' results must not depend on the
    thread count anyway (tested in tests/ops)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """The demo checkpoint (Gated DeltaNet + attention), written once per session."""
    from hybridlm.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def ray_port():
    """A local Ray with Serve's HTTP proxy (started once for the cluster tests): its port."""
    from hybridlm.cluster import ray_cluster

    with ray_cluster(cpus=2) as port:
        yield port
