"""Granite 4.0-H checkpoints: dense (`num_local_experts` = 0, Micro) with Mamba-2 layers (3 groups of 2
heads, chunk 16) around attention, every µP multiplier away from 1 and no positional encoding (as
Granite 4.0-H ships); dense with RoPE; and MoE (5 experts, top 2, beside the shared MLP)."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save


def config(**kw):
    from transformers import GraniteMoeHybridConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        shared_intermediate_size=56,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=0,
        mamba_n_heads=6,
        mamba_d_head=16,
        mamba_n_groups=3,
        mamba_d_state=10,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        embedding_multiplier=6.0,
        residual_multiplier=0.4,
        attention_multiplier=0.1,
        logits_scaling=3.0,
        position_embedding_type=None,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    base.update(kw)
    return GraniteMoeHybridConfig(**base)


def dense(out):
    from transformers import GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    return save(GraniteMoeHybridForCausalLM(config()), out, "granitemoehybrid")


def dense_rope(out):
    from transformers import GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    cfg = config(
        position_embedding_type="rope", tie_word_embeddings=False,
        layer_types=["full_attention", "linear_attention"], num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return save(GraniteMoeHybridForCausalLM(cfg), out, "granitemoehybrid_rope")


def moe(out):
    from transformers import GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    cfg = config(num_local_experts=5, num_experts_per_tok=2, intermediate_size=24, tie_word_embeddings=False)
    return save(GraniteMoeHybridForCausalLM(cfg), out, "granitemoehybrid_moe")


BUILDERS = {"granitemoehybrid": dense, "granitemoehybrid_rope": dense_rope, "granitemoehybrid_moe": moe}
REPRESENTATIVE = ["granitemoehybrid_moe"]  # its layers hold everything the dense ones do
