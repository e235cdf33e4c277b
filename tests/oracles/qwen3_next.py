"""Qwen3-Next checkpoints: fused Gated DeltaNet projections (2 or 1 value heads per key head),
sparse MoE with a shared expert on some layers, dense MLP on the others; tied and untied."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save


def config(tie: bool, layer_types: list[str], **kw):
    from transformers import Qwen3NextConfig

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
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        tie_word_embeddings=tie,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    base.update(kw)
    return Qwen3NextConfig(**base)


def untied(out):
    """MoE on every layer but layer 1 (mlp_only_layers), normalized top-2 of 8 experts."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    kinds = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]
    cfg = config(False, kinds, decoder_sparse_step=1, mlp_only_layers=[1])
    return save(Qwen3NextForCausalLM(cfg), out, "qwen3_next")


def tied(out):
    """MoE on odd layers (decoder_sparse_step 2) except layer 3, unnormalized top-2 of 4 experts,
    one value head per key head."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(0)
    kinds = ["full_attention", "linear_attention", "linear_attention", "linear_attention", "full_attention"]
    cfg = config(
        True,
        kinds,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        num_experts=4,
        norm_topk_prob=False,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_value_head_dim=32,
    )
    return save(Qwen3NextForCausalLM(cfg), out, "qwen3_next_tied")


BUILDERS = {"qwen3_next": untied, "qwen3_next_tied": tied}
REPRESENTATIVE = ["qwen3_next"]
