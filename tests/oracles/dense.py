"""Dense checkpoints: Qwen3 (sliding-window upper layers, untied; all full attention, tied) and
Llama (llama3 rope scaling with attention and MLP biases, untied; default rope, MHA, tied).
Names start with `dense_` so `-k dense` selects them (`-k qwen3` would also pick Qwen3.5)."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save


def qwen3(out):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    # a window of 16 with max_window_layers=2: layers 2-3 slide, and every test sequence is longer
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return save(Qwen3ForCausalLM(cfg), out, "dense_qwen3")


def qwen3_tied(out):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        tie_word_embeddings=True,
        attention_bias=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    return save(Qwen3ForCausalLM(cfg), out, "dense_qwen3_tied")


def llama(out):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # original context 64 with low/high factors 1/4 puts the 8 frequencies of head_dim 16 in all
    # three llama3 bands (kept, smoothed, divided by `factor`)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        rope_parameters=rope,
    )
    return save(LlamaForCausalLM(cfg), out, "dense_llama")


def llama_tied(out):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    return save(LlamaForCausalLM(cfg), out, "dense_llama_tied")


BUILDERS = {
    "dense_qwen3": qwen3,
    "dense_qwen3_tied": qwen3_tied,
    "dense_llama": llama,
    "dense_llama_tied": llama_tied,
}
REPRESENTATIVE = ["dense_qwen3", "dense_llama"]
