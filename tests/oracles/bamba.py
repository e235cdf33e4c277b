"""Bamba checkpoints: Mamba-2 layers (2 groups of 8 heads, a time-step clamp that binds, a chunk size
that divides no test prompt) around one partial-rotary attention layer."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save


def config(**kw):
    from transformers import BambaConfig

    base = dict(
        vocab_size=VOCAB,
        # Every linear's input a multiple of 64 (the int4 group size) and output of 16 (int4 panels; see
        # tests/models/test_quantized.py).
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=16,
        mamba_d_head=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        time_step_limit=(0.0, 1.2),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return BambaConfig(**base)


def bamba(out):
    from transformers import BambaForCausalLM

    torch.manual_seed(0)
    return save(BambaForCausalLM(config()), out, "bamba")


BUILDERS = {"bamba": bamba}
REPRESENTATIVE = ["bamba"]
