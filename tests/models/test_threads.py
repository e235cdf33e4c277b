"""A decode-sized step's numbers do not depend on how many threads share it (`ops.threads` changes the
team of exactly these steps when other processes take cores)."""

import random

import pytest
import torch

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.models.base import forward_packed
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.quant import quantize_

FAMILIES = [
    "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "gemma3_text", "gemma4_text",
    "dense_llama", "bamba", "nemotron_h", "falcon_h1",
]


def steps(model, prompt, sizes, threads):
    """Logits of a prompt then decode / verify steps of `sizes` tokens, the steps run on `threads`."""
    rng = random.Random(3)
    caches = model.make_caches(1)
    model(Batch.single(prompt), caches)
    offset, out = len(prompt), []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in sizes:
            ids = [rng.randrange(1, 500) for _ in range(n)]
            out.append(model(Batch.single(ids, offset=offset), caches, logits="all"))
            offset += n
        rows = [Batch.single([rng.randrange(1, 500)], offset=offset), Batch.single([7, 8, 9], offset=offset)]
        out += forward_packed(model, rows, [caches, model.make_caches(1)], ["last", "all"])
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("scheme", [None, "int4"])
@pytest.mark.parametrize("name", FAMILIES)
def test_decode_steps_give_the_same_bits_on_one_thread_and_two(checkpoints, name, scheme, monkeypatch):
    """bf16 and quantized models: the steps whose team `ops.threads` may shrink."""
    monkeypatch.setenv("HYBRIDLM_ADAPT_THREADS", "0")
    model = load_model(checkpoints(name).path, dtype=torch.bfloat16, device="cpu")
    if scheme:
        quantize_(model.model, scheme)
    prompt = list(range(3, 40))
    sizes = [1, 4, FEW_TOKENS, 1]
    one, two = steps(model, prompt, sizes, 1), steps(model, prompt, sizes, 2)
    for a, b in zip(one, two, strict=True):
        assert a.equal(b), f"max |diff| {(a - b).abs().max():.3e}"


def test_only_bf16_cpu_steps_of_few_tokens_change_their_team(checkpoints):
    model = load_model(checkpoints("qwen3_5_text").path, dtype=torch.bfloat16, device="cpu")
    assert model.decode_sized(1) and model.decode_sized(FEW_TOKENS) and not model.decode_sized(FEW_TOKENS + 1)
    assert not load_model(checkpoints("qwen3_5_text").path, dtype=torch.float32, device="cpu").decode_sized(1)
