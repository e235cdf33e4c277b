"""Kimi Linear checkpoints: KDA (softplus decay) and MLA (no rotary) layers, a dense MLP then the
grouped sigmoid-router MoE; odd head counts, 6 experts in 3 groups, top-2 of the best 2 groups."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, randomize_router_bias, save


def config(**kw):
    from transformers import KimiLinearConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_attention_heads=3,
        num_key_value_heads=3,
        kv_lora_rank=20,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        linear_num_heads=3,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        num_local_experts=6,
        num_experts_per_tok=2,
        n_group=3,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return KimiLinearConfig(**base)


def kimi_linear(out):
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(config())
    randomize_router_bias(model, seed=7)
    return save(model, out, "kimi_linear")


BUILDERS = {"kimi_linear": kimi_linear}
REPRESENTATIVE = ["kimi_linear"]
