"""Kimi Linear (`kimi_linear`): Kimi Delta Attention layers (per-channel softplus decay, low-rank
forget and output gates) interleaved with multi-head latent attention without positional encoding
(its decoupled key part is cached but never rotated); dense MLP on the first
`first_k_dense_replace` layers, then DeepSeek-V3's sigmoid router with grouped top-k, correction
bias, routed scaling and one shared expert. RMSNorm (Llama order) everywhere.

Published checkpoints (and transformers' `save_pretrained`) name the pieces differently from this
implementation: `block_sparse_moe` for the feed-forward block with experts `w1` / `w3` / `w2`
(gate / up / down), separate `q_conv1d` / `k_conv1d` / `v_conv1d`, the gate projections directly
on the layer; `remap` and `convert` bring them to `models.kda`'s layers.
"""

from __future__ import annotations

from torch import nn

from hybridlm.models.base import CausalLM, Config, register
from hybridlm.models.checkpoint import CheckpointError
from hybridlm.models.kda import (
    KimiDeltaAttention,
    KimiGate,
    KimiOutGate,
    LatentAttention,
    feed_forward,
    join_convs,
    moe_settings,
)
from hybridlm.models.layers import DecoderLayer
from hybridlm.models.moe import stack_experts
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import RMSNorm

GATE_PARAMS = ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log")
OUT_GATE_PARAMS = ("g_a_proj.", "g_b_proj.")


def layer_types(c: Config) -> list[str]:
    """"linear_attention" (KDA) or "full_attention" (MLA) per layer: config.json's `layer_types`, else
    the published `linear_attn_config` (1-based `full_attn_layers`), else transformers' default."""
    if c.get("layer_types"):
        return list(c.layer_types)
    full = (c.get("linear_attn_config") or {}).get("full_attn_layers")
    if full is not None:
        return ["full_attention" if i + 1 in full else "linear_attention" for i in range(c.num_hidden_layers)]
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(c.num_hidden_layers)]


def mlp_types(c: Config) -> list[str]:
    if c.get("mlp_layer_types"):
        return list(c.mlp_layer_types)
    dense = c.get("first_k_dense_replace", 1)
    return ["dense" if i < dense else "sparse" for i in range(c.num_hidden_layers)]


def linear_attn(c: Config) -> tuple[int, int, int]:
    """(heads, head_dim, conv kernel) of the KDA layers."""
    la = c.get("linear_attn_config") or {}
    return (
        c.get("linear_num_heads", la.get("num_heads")),
        c.get("linear_head_dim", la.get("head_dim")),
        c.get("linear_conv_kernel_dim", la.get("short_conv_kernel_size", 4)),
    )


@register("kimi_linear")
class KimiLinear(CausalLM):
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        if c.get("q_lora_rank"):
            raise CheckpointError("kimi_linear with a low-rank query path (q_lora_rank) is not supported")
        d, eps = c.hidden_size, c.rms_norm_eps
        heads, head_dim, kernel = linear_attn(c)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.model.layers = nn.ModuleList()
        for kind, mlp_kind in zip(layer_types(c), mlp_types(c), strict=True):
            if kind == "linear_attention":
                mixer = KimiDeltaAttention(
                    d, heads, head_dim, kernel, KimiGate(d, heads, head_dim),
                    KimiOutGate(d, heads * head_dim, head_dim), eps,
                )
            else:
                mixer = LatentAttention(
                    d, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                    c.kv_lora_rank, eps, None, (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5,
                    bias=c.get("attention_bias", False),
                )
            mlp = feed_forward(c, mlp_kind)
            self.model.layers.append(DecoderLayer("self_attn", mixer, mlp, RMSNorm, d, eps))
        self.model.norm = RMSNorm(d, eps=eps)
        self.lm_head = Linear(d, c.vocab_size, bias=False)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        head, sep, tail = name.partition(".self_attn.")
        if sep and tail.startswith(GATE_PARAMS):
            return f"{head}.self_attn.gate.{tail}"
        if sep and tail.startswith(OUT_GATE_PARAMS):
            return f"{head}.self_attn.out_gate.{tail}"
        return name

    @classmethod
    def convert(cls, state, config: Config):
        """One conv over q‖k‖v per KDA layer; experts `w1` / `w3` / `w2` stacked."""
        c = config
        heads, head_dim, kernel = linear_attn(c)
        experts = moe_settings(c)["experts"]
        for i, (kind, mlp_kind) in enumerate(zip(layer_types(c), mlp_types(c), strict=True)):
            if kind == "linear_attention":
                join_convs(state, f"model.layers.{i}.self_attn", heads * head_dim, kernel)
            if mlp_kind == "sparse":
                stack_experts(state, f"model.layers.{i}.mlp.experts", experts, c.hidden_size,
                              c.moe_intermediate_size, ("w1", "w3", "w2"))
        return state
