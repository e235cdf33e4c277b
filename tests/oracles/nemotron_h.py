"""Nemotron-H checkpoints from `hybrid_override_pattern` (every block kind: M * E -): Mamba-2 (2 groups
of 4 heads, chunk 16, Δ clamped below at time_step_min), attention without positional encoding,
relu² MLP, and a sigmoid-routed MoE with grouped top-k, a correction bias that changes the choice,
a routed scaling factor and a shared expert; one with latent MoE projections (sizes whose bf16 rows are
multiples of 16 bytes: transformers' grouped GEMM needs that)."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save


def config(**kw):
    from transformers import NemotronHConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,  # every linear's input a multiple of 64 (int4 groups), output of 16 (int4 panels)
        hybrid_override_pattern="M*E-M",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=10,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        time_step_min=1.2,  # binds for some heads: softplus(dt + dt_bias) spans ~1 to 1.7 here
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        moe_shared_expert_intermediate_size=64,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return NemotronHConfig(**base)


def build(cfg, out, name):
    from transformers import NemotronHForCausalLM

    torch.manual_seed(0)
    model = NemotronHForCausalLM(cfg)
    ckpt = save(model, out, name)
    # A correction bias on the scale of the sigmoid scores, so that it changes which experts are chosen.
    from safetensors.torch import load_file, save_file

    (file,) = out.glob("*.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(2)
    for k in tensors:
        if k.endswith("e_score_correction_bias"):
            tensors[k] = torch.rand(tensors[k].shape, generator=g) * 0.3
    save_file(tensors, file, metadata={"format": "pt"})
    return ckpt


def nemotron_h(out):
    return build(config(), out, "nemotron_h")


def nemotron_h_latent(out):
    return build(config(hybrid_override_pattern="E*M", moe_latent_size=24), out, "nemotron_h_latent")


BUILDERS = {"nemotron_h": nemotron_h, "nemotron_h_latent": nemotron_h_latent}
REPRESENTATIVE = ["nemotron_h"]
