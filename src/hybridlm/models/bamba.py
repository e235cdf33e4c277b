"""Bamba (`bamba`): Mamba-2 layers with full attention at `attn_layer_indices` (partial rotary, half
of each head), SwiGLU feed-forward, RMSNorm (weight applied after the cast back, Llama order).

The checkpoint names the feed-forward block `feed_forward`, its norm `pre_ff_layernorm` and the
final norm `final_layernorm`; `remap` renames them so the shared `DecoderLayer` is used as it is.
"""

from __future__ import annotations

from torch import nn

from hybridlm.models.base import CausalLM, Config, register, renamed
from hybridlm.models.layers import Attention, DecoderLayer, GatedMLP
from hybridlm.models.mamba2 import mamba2_mixer
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import RMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params

RENAMES = [
    ("model.final_layernorm.", "model.norm."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    (".feed_forward.", ".mlp."),
]


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
                mixer = mamba2_mixer(c)
            mlp = GatedMLP(d, c.intermediate_size, c.get("hidden_act", "silu"), bias=c.get("mlp_bias", False))
            self.model.layers.append(DecoderLayer(mixer_name, mixer, mlp, RMSNorm, d, c.rms_norm_eps))
        self.model.norm = RMSNorm(d, eps=c.rms_norm_eps)
        self.lm_head = Linear(d, c.vocab_size, bias=False)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        return renamed(name, RENAMES)
