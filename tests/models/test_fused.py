"""Fused projections (models.fused): one call for the linear layers that read the same input, with
decode rows bit-identical to the separate layers, for bf16, int8 and int4 weights."""

import pytest
import torch
from torch import nn

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.models.checkpoint import read_json
from hybridlm.models.fused import fuse_projections, unfused_modules, unfused_state
from hybridlm.models.loader import family_for, load_weights
from hybridlm.models.quantized import quantize_model
from hybridlm.ops.linear import FusedLinear, rowwise
from hybridlm.ops.quant import QuantLinear
from tests.speculative.helpers import ids_for

FAMILIES = [
    "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "lfm2", "lfm2_moe", "gemma3_text", "gemma4_text",
    "dense_llama",
]
SCHEMES = [None, "int8", "int4"]


pytestmark = pytest.mark.usefixtures("single_thread")


def unfused(path, scheme):
    """The model as `load_model` builds it, but never fused."""
    raw = read_json(path / "config.json")
    model = load_weights(family_for(raw, path), path, raw, torch.bfloat16, "cpu")
    return model if scheme is None else quantize_model(model, scheme)


def decode_logits(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Logits of a few-token prompt (decode kernels) and of `steps` one-token steps feeding back the
    argmax; the rows-as-decode logits of the whole run after them."""
    caches = model.make_caches(1)
    out = [model(Batch.single(prompt), caches)]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(out[-1].argmax()))
        out.append(model(Batch.single(tokens[-1:], offset=len(tokens) - 1), caches))
    with rowwise():
        out.append(model(Batch.single(tokens), model.make_caches(1), logits="all"))
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", FAMILIES)
def test_fused_projections_give_decode_rows_bit_identical_to_the_separate_layers(checkpoints, name, scheme):
    path = checkpoints(name).path
    fused = load_model(path, torch.bfloat16, "cpu", quantize=scheme)
    groups = [m for m in fused.modules() if isinstance(m, FusedLinear)]
    assert groups, "every family has an MLP gate / up pair to fuse"
    kind = nn.Linear if scheme is None else QuantLinear
    assert all(isinstance(g.proj, kind) for g in groups)
    reference = unfused(path, scheme)
    assert not any(isinstance(m, FusedLinear) for m in reference.modules())
    prompt = ids_for(5, seed=7)
    for got, want in zip(decode_logits(fused, prompt, 4), decode_logits(reference, prompt, 4), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_prefill_stays_within_rounding_of_the_separate_layers(checkpoints, scheme):
    path = checkpoints("qwen3_5_text").path
    fused, reference = load_model(path, torch.bfloat16, "cpu", quantize=scheme), unfused(path, scheme)
    ids = ids_for(40, seed=3)
    got = fused(Batch.single(ids), fused.make_caches(1), logits="all").float()
    want = reference(Batch.single(ids), reference.make_caches(1), logits="all").float()
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_unfused_state_is_the_state_of_the_model_never_fused(checkpoints, scheme):
    """What `save_quantized` writes: the separate layers' names and tensors, bit for bit."""
    path = checkpoints("qwen3_5_text").path
    fused, reference = load_model(path, torch.bfloat16, "cpu", quantize=scheme), unfused(path, scheme)
    got, want = unfused_state(fused), reference.state_dict()
    assert got.keys() == want.keys()
    for key, t in want.items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    layers = unfused_modules(fused)
    assert layers.keys() == dict(reference.named_modules()).keys()


def test_groups_that_do_not_share_a_kind_stay_separate():
    """A quantized layer beside a float one (a GPTQ checkpoint that left one unquantized) is not fused."""
    from hybridlm.models.layers import GatedMLP

    mlp = GatedMLP(64, 96).to(torch.bfloat16).eval()
    mlp.up_proj = QuantLinear.from_linear(mlp.up_proj, "int8")
    fuse_projections(mlp)
    assert mlp.gate_up is None and isinstance(mlp.up_proj, QuantLinear)
