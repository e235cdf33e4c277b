"""Random-weight checkpoints written by hybridlm itself (benchmarks, no transformers needed).

The tensors have the names and shapes of the family's published checkpoints, so the files load
exactly like a downloaded model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridlm.models.base import FAMILIES
from hybridlm.ops.norms import OffsetRMSNorm

# Qwen3.5-0.8B's published text shape (DESIGN.md §6.1): 752 M parameters, tied embeddings.
QWEN3_5_0_8B = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "eos_token_id": 248044,
}

# LFM2-350M's published shape: short-conv hybrid, 16 layers (6 attention).
LFM2_350M = {
    "model_type": "lfm2",
    "vocab_size": 65536,
    "hidden_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "block_ff_dim": 6656,
    "block_auto_adjust_ff_dim": True,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256,
    "conv_L_cache": 3,
    "conv_bias": False,
    "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    "rope_theta": 1000000.0,
    "norm_eps": 1e-5,
    "max_position_embeddings": 128000,
    "tie_embedding": True,
}

# Gemma 3 270M's published text shape: 5 sliding-window (512) layers per global layer.
GEMMA3_270M = {
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
}

# Qwen3.5-35B-A3B's layout (every layer sparse: top-8 routed experts plus a sigmoid-gated shared
# expert; 3 Gated DeltaNet layers per gated-attention layer; untied 248k vocabulary) scaled to a
# machine of 16-32 GB: d 1024, 24 layers, 128 experts of width 256. 3.2 B parameters (6.4 GB in bf16),
# of which a decode step reads 0.66 B (0.41 B without the LM head); tests/models/test_random.py counts.
QWEN3_5_MOE_3B = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "eos_token_id": 248044,
}

# Nemotron-H-8B's layout (`nemotron_h`: Mamba-2, relu² MLP and attention-without-positions blocks, one
# a layer; untied 131072 vocabulary; Mamba-2 of 64-wide heads, 8 groups, state 128, expand 2) scaled
# to a 2-core 24 GB machine: d 1536, 26 layers (the first half of 8B's 52-letter pattern: 12 M, 12 -,
# 2 *, the same proportions), relu² width 8192 (8B: 5.25 d; 8192 keeps rows a multiple of 256 for
# Q4_K), 48 Mamba heads (2 d inner), 12 attention heads of 128 sharing 4 KV heads. 0.93 B parameters
# (1.85 GB in bf16), 0.72 B without the embedding table; tests/models/test_random.py counts.
NEMOTRON_H_1B = {
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 1536,
    "num_hidden_layers": 26,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-",
    "intermediate_size": 8192,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "attention_bias": False,
    "mamba_num_heads": 48,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "chunk_size": 128,
    "use_conv_bias": True,
    "use_bias": False,
    "mamba_hidden_act": "silu",
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "layer_norm_epsilon": 1e-5,
    "residual_in_fp32": False,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

PRESETS = {
    "qwen3.5-0.8b": QWEN3_5_0_8B,
    "lfm2-350m": LFM2_350M,
    "gemma3-270m": GEMMA3_270M,
    "qwen3.5-moe-3b": QWEN3_5_MOE_3B,
    "nemotron-h-1b": NEMOTRON_H_1B,
}


def random_state(config: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Tensors for every parameter of the family, seeded: matrices ~ N(0, 0.02²), norms at their
    identity value, Gated DeltaNet decay parameters in their trained ranges."""
    cls = FAMILIES[config["model_type"]]
    with torch.device("meta"):
        model = cls(cls.text_config(config))
    zero_centred = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, OffsetRMSNorm)}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        if model.tied and name == "lm_head.weight":
            continue
        if name.endswith("A_log"):
            t = torch.log(torch.rand(p.shape, generator=g) * 15 + 1)
        elif name in zero_centred or name.endswith(".bias"):
            t = torch.zeros(p.shape)
        elif p.dim() == 1:
            t = torch.ones(p.shape)
        else:
            t = torch.randn(p.shape, generator=g) * 0.02
        state[name] = t.to(dtype)
    return state


def write_random_checkpoint(config: dict, out: str | Path, seed: int = 0) -> Path:
    """Write config.json + model.safetensors (bf16) for `config` into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = random_state(config, seed)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def cached_random_checkpoint(config: dict, out: Path, name: str) -> Path:
    """`out`, holding a random checkpoint of `config` written on first use (into a temporary
    directory renamed into place, so a concurrent or interrupted writer never leaves half of one)."""
    if not (out / "config.json").exists():
        print(f"writing a random {name} checkpoint to {out} ...", flush=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        write_random_checkpoint(config, tmp)
        tmp.rename(out)
    return out
