"""The engine's thread owns the process's only OpenMP pool (docs/architecture.md "Engine")."""

import subprocess
import sys

from hybridlm.models.random import write_random_checkpoint
from hybridlm.presets import QWEN3_5_0_8B

# Built with the engine's caller at two torch threads: any parallel torch work on that thread (a
# cache allocation big enough to be split: the recurrent state here is 16 x 128 x 128) makes it a
# pool of its own beside the engine's, and libgomp then stops spinning between parallel regions.
CHILD = """
import os, sys, torch, hybridlm
from hybridlm.engine import Engine, serial_setup
from hybridlm.prefix.cache import PrefixCache

torch.set_num_threads(2)
with serial_setup():
    model = hybridlm.load_model(sys.argv[1])
    prefix = PrefixCache(model.lm)
before = len(os.listdir("/proc/self/task"))
engine = Engine(model.lm, None, prefix=prefix)
print(len(os.listdir("/proc/self/task")) - before)
engine.close()
"""


def test_constructing_an_engine_starts_its_worker_and_no_thread_pool_on_the_caller(tmp_path):
    config = {
        **QWEN3_5_0_8B,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "head_dim": 32,
    }
    path = write_random_checkpoint(config, tmp_path / "wide-state")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split()[-1] == "1"  # the engine's worker thread alone
