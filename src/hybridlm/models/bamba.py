"""Bamba (`bamba`): Mamba-2 layers with full attention at `attn_layer_indices` (partial rotary, half
of each head), SwiGLU feed-forward, RMSNorm (weight applied after the cast back, Llama order).

The checkpoint names the feed-forward block `feed_forward`, its norm `pre_ff_layernorm` and the
final norm `final_layernorm`; `remap` renames them so the shared `DecoderLayer` is used as it is.
"""

from __future__ import annotations

import math

from torch import nn

from hybridlm.models.base import CausalLM, Config, register
from hybridlm.models.layers import Attention, DecoderLayer, GatedMLP
from hybridlm.models.mamba2 import Mamba2Mixer
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import RMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params

RENAMES = [
    ("model.final_layernorm.", "model.norm."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    (".feed_forward.", ".mlp."),
]


def time_step_limit(c: Config) -> tuple[float, float]:
    """Δ's clamp; absent or null in the config means none. transformers 5 writes a non-finite bound
    as ``{"__float__": "Infinity"}`` (JSON has no infinity), older configs as the literal ``Infinity``."""
    limit = c.get("time_step_limit") or (0.0, math.inf)
    return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in limit)


@register("bamba")
class Bamba(CausalLM):
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        d = c.hidden_size
        head_dim = c.get("head_dim") or d // c.num_attention_heads
        rope = c.get_rope()
        rope.setdefault("partial_rotary_factor", 0.5)  # transformers hard-codes it for Bamba
        rotary = Rotary(*inv_freq_from_params(head_dim, rope))
        inner = int(c.mamba_expand * d)
        mamba_head = c.get("mamba_d_head", "auto")
        mamba_head = inner // c.mamba_n_heads if mamba_head in (None, "auto") else mamba_head
        attn = set(c.get("attn_layer_indices") or [])
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.model.layers = nn.ModuleList()
        for i in range(c.num_hidden_layers):
            if i in attn:
                mixer_name = "self_attn"
                mixer = Attention(d, c.num_attention_heads, c.num_key_value_heads, head_dim, rotary,
                                  bias=c.get("attention_bias", False))
            else:
                mixer_name = "mamba"
                mixer = Mamba2Mixer(
                    d, c.mamba_n_heads, mamba_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv,
                    eps=c.rms_norm_eps, dt_limit=time_step_limit(c), conv_bias=c.get("mamba_conv_bias", True),
                    proj_bias=c.get("mamba_proj_bias", False),
                )
            mlp = GatedMLP(d, c.intermediate_size, c.get("hidden_act", "silu"), bias=c.get("mlp_bias", False))
            self.model.layers.append(DecoderLayer(mixer_name, mixer, mlp, RMSNorm, d, c.rms_norm_eps))
        self.model.norm = RMSNorm(d, eps=c.rms_norm_eps)
        self.lm_head = Linear(d, c.vocab_size, bias=False)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        for old, new in RENAMES:
            if old in name:
                return name.replace(old, new, 1)
        return name
