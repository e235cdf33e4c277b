"""LFM2 checkpoints: two layer mixes, untied / tied embeddings, conv bias and kernel 4, the
feed-forward auto-adjust on and off, and a config.json in the older field names of the published
checkpoints (`tie_embedding`, `block_ff_dim`, `full_attn_idxs`, flat `rope_theta`)."""

from __future__ import annotations

import json

import torch

from tests.oracles.common import VOCAB, save


def config(layer_types: list[str], **kw):
    from transformers import Lfm2Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=200,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        # auto-adjust: int(2·200/3) = 133, ×1.5 -> 199, rounded up to a multiple of 32 -> 224
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.5,
        block_multiple_of=32,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return Lfm2Config(**base)


def untied(out):
    from transformers import Lfm2ForCausalLM

    torch.manual_seed(0)
    cfg = config(["conv", "conv", "full_attention", "conv", "full_attention", "conv"])
    return save(Lfm2ForCausalLM(cfg), out, "lfm2")


def tied(out):
    from transformers import Lfm2ForCausalLM

    torch.manual_seed(0)
    cfg = config(
        ["full_attention", "conv", "conv"],
        tie_word_embeddings=True,
        conv_bias=True,
        conv_L_cache=4,
        block_auto_adjust_ff_dim=False,
        intermediate_size=96,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return save(Lfm2ForCausalLM(cfg), out, "lfm2_tied")


def legacy_config(out):
    """Saved by transformers, then config.json rewritten in the older names (tied by default)."""
    from transformers import Lfm2ForCausalLM

    torch.manual_seed(0)
    kinds = ["conv", "full_attention", "conv", "conv"]
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    cfg = config(kinds, tie_word_embeddings=True, rope_parameters=rope)
    ckpt = save(Lfm2ForCausalLM(cfg), out, "lfm2_legacy_config")
    path = out / "config.json"
    raw = json.loads(path.read_text())
    for key in ("layer_types", "tie_word_embeddings", "rope_parameters"):
        raw.pop(key)
    raw["full_attn_idxs"] = [i for i, k in enumerate(kinds) if k == "full_attention"]
    raw["tie_embedding"] = True
    raw["block_ff_dim"] = raw.pop("intermediate_size")
    raw["rope_theta"] = rope["rope_theta"]
    path.write_text(json.dumps(raw, indent=2))
    return ckpt


BUILDERS = {"lfm2": untied, "lfm2_tied": tied, "lfm2_legacy_config": legacy_config}
REPRESENTATIVE = ["lfm2"]
