"""Qwen3.5 checkpoints: text-only layout, tied embeddings, and the vision-language layout."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save

MIX = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]


def text_config(tie: bool, layer_types: list[str], **kw):
    from transformers import Qwen3_5TextConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=tie,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    base.update(kw)
    return Qwen3_5TextConfig(**base)


def text(out):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    return save(Qwen3_5ForCausalLM(text_config(False, MIX)), out, "qwen3_5_text")


def text_tied(out):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    cfg = text_config(True, ["full_attention", "linear_attention", "linear_attention"])
    return save(Qwen3_5ForCausalLM(cfg), out, "qwen3_5_text_tied")


def vision_language(out):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
        in_channels=3,
    )
    cfg = Qwen3_5Config(
        text_config=text_config(True, MIX[:3]).to_dict(), vision_config=vision, tie_word_embeddings=True
    )
    return save(Qwen3_5ForConditionalGeneration(cfg), out, "qwen3_5_vl")


BUILDERS = {"qwen3_5_text": text, "qwen3_5_text_tied": text_tied, "qwen3_5_vl": vision_language}
REPRESENTATIVE = ["qwen3_5_text"]
