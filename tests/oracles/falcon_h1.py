"""Falcon-H1 checkpoints: attention and Mamba-2 in every layer (2 groups of 3 heads, chunk 16,
`mamba_d_ssm` narrower than expand × hidden), every µP multiplier away from 1; one with the plain
silu(z) gate (the published default), one with the per-group gated norm, biases and tied embeddings."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save


def config(**kw):
    from transformers import FalconH1Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_ssm=72,
        mamba_n_heads=6,
        mamba_d_head=12,
        mamba_n_groups=2,
        mamba_d_state=10,
        mamba_d_conv=4,
        mamba_chunk_size=16,
        mamba_rms_norm=False,
        time_step_limit=(0.0, 1.3),
        embedding_multiplier=3.0,
        lm_head_multiplier=0.4,
        mlp_multipliers=[0.7, 1.6],
        key_multiplier=0.6,
        attention_in_multiplier=1.4,
        attention_out_multiplier=0.8,
        ssm_multipliers=[0.6, 1.3, 0.9, 1.2, 0.5],
        ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.7,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return FalconH1Config(**base)


def falcon_h1(out):
    from transformers import FalconH1ForCausalLM

    torch.manual_seed(0)
    return save(FalconH1ForCausalLM(config()), out, "falcon_h1")


def falcon_h1_norm(out):
    from transformers import FalconH1ForCausalLM

    torch.manual_seed(0)
    cfg = config(
        mamba_rms_norm=True, mamba_norm_before_gate=True, projectors_bias=True, mamba_conv_bias=False,
        tie_word_embeddings=True, num_hidden_layers=1,
    )
    return save(FalconH1ForCausalLM(cfg), out, "falcon_h1_norm")


BUILDERS = {"falcon_h1": falcon_h1, "falcon_h1_norm": falcon_h1_norm}
REPRESENTATIVE = ["falcon_h1"]
