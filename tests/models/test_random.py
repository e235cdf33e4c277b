"""The random-checkpoint presets (`models.random`): each builds as its family, and has the size its
comment states (what `bench forward --preset` reports as its scale); a family that publishes another
layout than hybridlm's (Granite 4.0-H) is written in it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridlm.batch import Batch
from hybridlm.models import load_model
from hybridlm.models.base import FAMILIES
from hybridlm.models.moe import Experts, SparseMoE
from hybridlm.models.random import cached_random_checkpoint, random_state, write_random_checkpoint
from hybridlm.presets import (
    GRANITE_4_0_H_3B,
    KIMI_LINEAR_3B,
    LFM2_MOE_4B,
    LING_3_3B,
    NEMOTRON_H_1B,
    PRESETS,
    QWEN3_5_MOE_3B,
)


def build(config: dict):
    cls = FAMILIES[config["model_type"]]
    with torch.device("meta"):
        return cls(cls.text_config(config))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_as_its_family(name):
    model = build(PRESETS[name])
    assert len(model.model.layers) == PRESETS[name]["num_hidden_layers"]


def test_the_qwen3_5_moe_preset_holds_3_2_b_parameters_and_a_step_reads_0_66_b():
    """Total parameters, and those a decode step reads: all but the unchosen experts (k of E per
    layer) and the embedding table (one row)."""
    model = build(QWEN3_5_MOE_3B)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    e, k = QWEN3_5_MOE_3B["num_experts"], QWEN3_5_MOE_3B["num_experts_per_tok"]
    read = total - experts * (e - k) / e - model.model.embed_tokens.weight.numel()
    assert 3.1e9 < total < 3.3e9
    assert 0.63e9 < read < 0.69e9
    assert 0.38e9 < read - model.lm_head.weight.numel() < 0.44e9


def test_the_nemotron_h_preset_holds_0_93_b_parameters_in_8b_s_layer_proportions():
    """Total parameters and all but the embedding table (a decode step reads one row of it); the
    layers are 8B's kinds in its proportions (24 M, 24 -, 4 * of 52), dense."""
    model = build(NEMOTRON_H_1B)
    kinds = [layer.kind for layer in model.model.layers]
    assert kinds.count("linear_attention") == kinds.count("mlp") == 12
    assert kinds.count("full_attention") == 2 and "moe" not in kinds
    total = sum(p.numel() for p in model.parameters())
    assert 0.90e9 < total < 0.95e9
    assert 0.70e9 < total - model.model.embed_tokens.weight.numel() < 0.75e9


@pytest.mark.parametrize(
    ("config", "total_b", "read_b"),
    [
        (GRANITE_4_0_H_3B, 3.70, 0.96),
        (KIMI_LINEAR_3B, 3.83, 1.59),
        (LING_3_3B, 3.54, 1.72),
        (LFM2_MOE_4B, 4.06, 0.98),
    ],
    ids=["granite", "kimi_linear", "ling", "lfm2_moe"],
)
def test_each_scaled_moe_preset_holds_the_parameters_its_comment_states(config, total_b, read_b):
    """Total parameters, and those a decode step reads (all but the unchosen experts and, when the LM
    head has its own matrix, the embedding table), within 1 % of the comment's figures; the routed
    experts are the family's `Experts` on every sparse layer."""
    model = build(config)
    stacks = [m for m in model.modules() if isinstance(m, Experts)]
    assert stacks
    e = config.get("num_experts") or config["num_local_experts"]
    k = config["num_experts_per_tok"]
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for m in stacks for p in m.parameters())
    read = total - experts * (e - k) / e - (0 if model.tied else model.model.embed_tokens.weight.numel())
    assert total == pytest.approx(total_b * 1e9, rel=0.01)
    assert read == pytest.approx(read_b * 1e9, rel=0.01)


def test_a_random_granite_checkpoint_has_the_published_names_and_loads_as_its_own_names_do(
    checkpoints, tmp_path
):
    """Granite 4.0-H's random checkpoint is written in the published layout (what transformers saves,
    and all llama.cpp's converter reads: the shared MLP's gate and up joined in `input_linear`), and
    loads to the same model as the same tensors under hybridlm's own names."""
    hf = checkpoints("granitemoehybrid_moe").path
    config = json.loads((hf / "config.json").read_text())
    published = write_random_checkpoint(config, tmp_path / "published")
    assert tensor_names(published) == tensor_names(hf)
    own = tmp_path / "own"
    own.mkdir()
    save_file(random_state(config), str(own / "model.safetensors"))
    (own / "config.json").write_text(json.dumps(config))
    assert tensor_names(own) != tensor_names(hf)
    ids = Batch.single([3, 1, 4, 1, 5, 9, 2, 6])
    a, b = (load_model(p, torch.float32, "cpu") for p in (published, own))
    assert torch.equal(a(ids, a.make_caches(1), logits="all"), b(ids, b.make_caches(1), logits="all"))


def tensor_names(checkpoint) -> set[str]:
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_a_cached_preset_is_written_once_and_again_when_its_config_changes(checkpoints, tmp_path):
    config = json.loads((checkpoints("granitemoehybrid_moe").path / "config.json").read_text())
    out = tmp_path / "preset"
    cached_random_checkpoint(config, out, "tiny")
    first = (out / "model.safetensors").stat().st_mtime_ns
    cached_random_checkpoint(config, out, "tiny")
    assert (out / "model.safetensors").stat().st_mtime_ns == first
    edited = {**config, "vocab_size": config["vocab_size"] + 8}
    cached_random_checkpoint(edited, out, "tiny")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == edited["vocab_size"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == edited["vocab_size"]
