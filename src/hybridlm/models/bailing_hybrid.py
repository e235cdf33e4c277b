"""Ling 3.0 (`bailing_hybrid`): groups of `layer_group_size` layers, Kimi Delta Attention in all but
the last of each group (per-channel decay by the lower-bounded "safe gate", a full-rank output gate)
and multi-head latent attention in the last, with interleaved rotary positions on its decoupled key
and a head-wise sigmoid output gate; dense MLP on the first `first_k_dense_replace` layers, then
DeepSeek-V3's grouped sigmoid router (512 experts in 8 groups in the published shapes) with a
shared expert. RMSNorm (Llama order) everywhere.

Published names differ from this implementation's: the token mixer is `attention` with its output
projection `dense`, the embedding `model.word_embeddings`, the router's bias `expert_bias`; the
checkpoint's multi-token-prediction layers (`model.layers.{num_hidden_layers}...`) are ignored. The
interleaved rotary pairs (x0, x1), (x2, x3)… are de-interleaved at load time by permuting the
rotary rows of q_proj and kv_a_proj_with_mqa (a permutation shared by queries and keys leaves their
products unchanged), so the shared rotate-half kernel applies.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.models.base import CausalLM, Config, register
from hybridlm.models.kda import (
    KimiDeltaAttention,
    LatentAttention,
    SafeGate,
    feed_forward,
    join_convs,
    moe_settings,
)
from hybridlm.models.layers import DecoderLayer
from hybridlm.models.moe import stack_experts
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import RMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params

GATE_PARAMS = ("f_proj.", "dt_bias", "A_log")


def layer_types(c: Config) -> list[str]:
    if c.get("layer_types"):
        return list(c.layer_types)
    group = c.get("layer_group_size", 6)
    kinds = ("linear_attention", "full_attention")
    return [kinds[(i + 1) % group == 0] for i in range(c.num_hidden_layers)]


def mlp_types(c: Config) -> list[str]:
    if c.get("mlp_layer_types"):
        return list(c.mlp_layer_types)
    dense = c.get("first_k_dense_replace", 2)
    return ["dense" if i < dense else "sparse" for i in range(c.num_hidden_layers)]


def linear_attn(c: Config) -> tuple[int, int, int]:
    """(heads, head_dim, conv kernel) of the KDA layers (transformers writes `linear_*`; the published
    config names them by the attention heads, `head_dim` and `short_conv_kernel_size`)."""
    return (
        c.get("linear_num_heads", c.num_attention_heads),
        c.get("linear_head_dim", c.get("head_dim")),
        c.get("linear_conv_kernel_dim", c.get("short_conv_kernel_size", 4)),
    )


@register("bailing_hybrid")
class BailingHybrid(CausalLM):
    packs = True
    keep_float32 = (".conv1d.weight", ".gate.dt_bias", ".gate.A_log", ".e_score_correction_bias")

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        d, eps = c.hidden_size, c.rms_norm_eps
        heads, head_dim, kernel = linear_attn(c)
        # Published Ling 3.0 configs use default rotary; a yarn config (which would also scale the
        # softmax by mscale²) is refused by `inv_freq_from_params`.
        rope = c.get_rope(default_theta=c.get("rope_theta", 6_000_000.0))
        self.rotary = Rotary(*inv_freq_from_params(c.qk_rope_head_dim, rope))
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.model.layers = nn.ModuleList()
        for kind, mlp_kind in zip(layer_types(c), mlp_types(c), strict=True):
            if kind == "linear_attention":
                safe, bound = c.get("kda_safe_gate", True), c.get("kda_lower_bound", -5.0)
                gate = SafeGate(d, heads, head_dim, safe, bound)
                out_gate = Linear(d, heads * head_dim, bias=False)
                mixer = KimiDeltaAttention(d, heads, head_dim, kernel, gate, out_gate, eps)
            else:
                mixer = LatentAttention(
                    d, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                    c.kv_lora_rank, eps, self.rotary, (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5,
                    head_gate=True, bias=c.get("attention_bias", False),
                )
            mlp = feed_forward(c, mlp_kind)
            self.model.layers.append(DecoderLayer("attention", mixer, mlp, RMSNorm, d, eps))
        self.model.norm = RMSNorm(d, eps=eps)
        self.lm_head = Linear(d, c.vocab_size, bias=False)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        if name.startswith("model.word_embeddings."):
            return "model.embed_tokens." + name[len("model.word_embeddings.") :]
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index >= config.num_hidden_layers:
                return None  # the multi-token-prediction layers
            name = name.replace(".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias")
            name = name.replace(".attention.dense.", ".attention.o_proj.")
            head, sep, tail = name.partition(".attention.")
            if sep and layer_types(config)[index] == "linear_attention":
                if tail.startswith(GATE_PARAMS):
                    return f"{head}.attention.gate.{tail}"
                if tail.startswith("g_proj."):
                    return f"{head}.attention.out_gate.{tail[len('g_proj.'):]}"
        return name

    @classmethod
    def convert(cls, state, config: Config):
        """One conv over q‖k‖v per KDA layer; experts stacked; MLA's rotary rows de-interleaved."""
        c = config
        heads, head_dim, kernel = linear_attn(c)
        experts = moe_settings(c)["experts"]
        nope, rope, rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        for i, (kind, mlp_kind) in enumerate(zip(layer_types(c), mlp_types(c), strict=True)):
            p = f"model.layers.{i}.attention"
            if kind == "linear_attention":
                join_convs(state, p, heads * head_dim, kernel)
            else:
                q = state.get(f"{p}.q_proj.weight")
                if q is not None and q.shape[0] == c.num_attention_heads * (nope + rope):
                    q = q.view(c.num_attention_heads, nope + rope, -1)
                    q = torch.cat([q[:, :nope], q[:, nope:][:, order]], dim=1)
                    state[f"{p}.q_proj.weight"] = q.flatten(0, 1)
                for suffix in ("weight", "bias"):
                    kv = state.get(f"{p}.kv_a_proj_with_mqa.{suffix}")
                    if kv is not None and kv.shape[0] == rank + rope:
                        state[f"{p}.kv_a_proj_with_mqa.{suffix}"] = torch.cat([kv[:rank], kv[rank:][order]])
            if mlp_kind == "sparse":
                stack_experts(state, f"model.layers.{i}.mlp.experts", experts, c.hidden_size,
                              c.moe_intermediate_size)
        return state
