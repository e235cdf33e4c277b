"""Qwen3.5-MoE checkpoints: the text-only layout (`qwen3_5_moe_text`) and the vision-language layout
(`qwen3_5_moe`), with odd sizes: 3 attention heads over 1 KV head, 3 value heads on 1 key head in the
Gated DeltaNet, 6 experts (not a power of two), top-3; hidden and expert widths of 64 so int4
quantization covers the experts."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save

MIX = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def text_config(tie: bool, layer_types: list[str], **kw):
    from transformers import Qwen3_5MoeTextConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=6,
        num_experts_per_tok=3,
        # widths of 64: int4 (groups of 64) applies to both expert projections
        moe_intermediate_size=64,
        shared_expert_intermediate_size=40,
        tie_word_embeddings=tie,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    base.update(kw)
    return Qwen3_5MoeTextConfig(**base)


def text(out):
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(0)
    return save(Qwen3_5MoeForCausalLM(text_config(False, MIX)), out, "qwen3_5_moe_text")


def vision_language(out):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

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
    cfg = Qwen3_5MoeConfig(
        text_config=text_config(True, MIX[:3]).to_dict(), vision_config=vision, tie_word_embeddings=True
    )
    return save(Qwen3_5MoeForConditionalGeneration(cfg), out, "qwen3_5_moe_vl")


BUILDERS = {"qwen3_5_moe_text": text, "qwen3_5_moe_vl": vision_language}
REPRESENTATIVE = ["qwen3_5_moe_text"]
