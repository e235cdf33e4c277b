"""Ling 3.0 (bailing_hybrid) checkpoints: groups of KDA layers (safe gate) closed by an MLA layer with
interleaved rotary keys and a head-wise gate, a dense MLP then the grouped sigmoid-router MoE; odd
head counts, 6 experts in 3 groups, top-2 of the best 2 groups."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, randomize_router_bias, save


def config(**kw):
    from transformers import BailingHybridConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        layer_group_size=2,
        first_k_dense_replace=1,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=16,
        kv_lora_rank=20,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        short_conv_kernel_size=4,
        num_local_experts=6,
        num_experts_per_tok=2,
        n_group=3,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
    )
    base.update(kw)
    return BailingHybridConfig(**base)


def bailing_hybrid(out):
    from transformers import BailingHybridForCausalLM

    torch.manual_seed(0)
    model = BailingHybridForCausalLM(config())
    randomize_router_bias(model, seed=7)
    return save(model, out, "bailing_hybrid")


BUILDERS = {"bailing_hybrid": bailing_hybrid}
REPRESENTATIVE = ["bailing_hybrid"]
