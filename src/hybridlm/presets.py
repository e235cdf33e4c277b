"""The published shapes the benchmarks build random-weight checkpoints of (`models.random`), scaled to
a 24 GB machine where the published model is larger. Plain data: the command line lists them
without importing torch."""

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

# Granite-4.0-H-Tiny's layout (`granitemoehybrid`, 7B-A1B: Mamba-2 layers of 48 heads of 64, one group,
# state 128; an attention layer (12 heads, 4 KV, no positional encoding) every tenth; every layer's
# feed-forward the shared SwiGLU MLP of width 1024 plus 6 of 64 routed experts of width 512; µP
# multipliers; tied 100352 vocabulary) halved in depth to fit a 2-core 24 GB machine: 20 layers (18
# Mamba-2, attention at 5 and 15, as Tiny's first half). 3.7 B parameters (7.4 GB in bf16), of which a
# decode step reads 0.96 B; tests/models/test_random.py counts.
GRANITE_4_0_H_3B = {
    "model_type": "granitemoehybrid",
    "vocab_size": 100352,
    "hidden_size": 1536,
    "num_hidden_layers": 20,
    "layer_types": ["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "shared_intermediate_size": 1024,
    "num_local_experts": 64,
    "num_experts_per_tok": 6,
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "position_embedding_type": "nope",
    "embedding_multiplier": 12.0,
    "attention_multiplier": 0.0078125,
    "residual_multiplier": 0.22,
    "logits_scaling": 6.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "bos_token_id": 100257,
    "eos_token_id": 100257,
    "pad_token_id": 100256,
}

# Kimi-Linear-48B-A3B's layout (`kimi_linear`: 3 KDA layers of 32 heads of 128 per MLA layer of 32 heads,
# latent rank 512, no rotary; a dense first layer of width 9216, then 8 of E routed experts of width 1024
# plus a shared one; untied 163840 vocabulary) scaled to a 2-core 24 GB machine: 12 of its 27 layers
# (9 KDA, 3 MLA) and 32 of its 256 experts. 3.8 B parameters (7.7 GB in bf16), of which a decode step
# reads 1.6 B (KDA's projections and the LM head are most of it); tests/models/test_random.py counts.
KIMI_LINEAR_3B = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 12,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 3,
    "mlp_layer_types": ["dense"] + ["sparse"] * 11,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "linear_num_heads": 32,
    "linear_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_local_experts": 32,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.446,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
}

# Ling 3.0's layout as transformers' `BailingHybridConfig` defaults give it (`bailing_hybrid`: groups of
# 6 layers, 5 KDA (safe gate, lower bound -5) closed by an MLA layer with rotary keys; dense width 6144
# on the first 2 layers, then 8 routed experts of width 768 chosen within the best 4 of 8 groups, plus a
# shared one; untied 157184 vocabulary) scaled to a 2-core 24 GB machine: 12 layers (2 groups) and 32
# of its 512 experts. 3.5 B parameters (7.1 GB in bf16), of which a decode step reads 1.7 B;
# tests/models/test_random.py counts.
LING_3_3B = {
    "model_type": "bailing_hybrid",
    "vocab_size": 157184,
    "hidden_size": 2560,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 12,
    "layer_group_size": 6,
    "first_k_dense_replace": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "num_local_experts": 32,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_theta": 6000000.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "eos_token_id": 156895,
    "pad_token_id": 156892,
}

# LFM2-8B-A1B's layout (`lfm2_moe`: LFM2's short convs with an attention layer (32 heads, 8 KV) at
# 6 of 24 layers; 2 dense layers of width 7168, then 4 of 32 experts of width 1792 chosen by sigmoid
# scores plus `expert_bias`; tied 65536 vocabulary) halved in depth: 12 layers, attention at 2, 6 and 10
# (the first half's). 4.1 B parameters (8.1 GB in bf16), of which a decode step reads 0.98 B;
# tests/models/test_random.py counts.
LFM2_MOE_4B = {
    "model_type": "lfm2_moe",
    "vocab_size": 65536,
    "hidden_size": 2048,
    "intermediate_size": 7168,
    "moe_intermediate_size": 1792,
    "num_hidden_layers": 12,
    "layer_types": ["full_attention" if i in (2, 6, 10) else "conv" for i in range(12)],
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_dense_layers": 2,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "use_expert_bias": True,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "conv_L_cache": 3,
    "conv_bias": False,
    "norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "max_position_embeddings": 128000,
    "bos_token_id": 1,
    "eos_token_id": 7,
    "pad_token_id": 0,
}

PRESETS = {
    "qwen3.5-0.8b": QWEN3_5_0_8B,
    "lfm2-350m": LFM2_350M,
    "gemma3-270m": GEMMA3_270M,
    "qwen3.5-moe-3b": QWEN3_5_MOE_3B,
    "nemotron-h-1b": NEMOTRON_H_1B,
    "granite-4.0-h-3b": GRANITE_4_0_H_3B,
    "kimi-linear-3b": KIMI_LINEAR_3B,
    "ling-3-3b": LING_3_3B,
    "lfm2-moe-4b": LFM2_MOE_4B,
}
