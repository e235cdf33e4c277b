"""Qwen3.5 (`qwen3_5_text`, and the vision-language `qwen3_5` layout whose text model we load):
Gated DeltaNet layers interleaved with gated full attention, dense MLP, zero-centred RMSNorm; the
checkpoint's multi-token-prediction head (`mtp.*`) is loaded separately, as a drafter (`models.mtp`)."""

from __future__ import annotations

from torch import nn

from hybridlm.models.base import CausalLM, Config, register
from hybridlm.models.layers import Attention, DecoderLayer, GatedDeltaNet, GatedMLP
from hybridlm.models.mtp import MTPHead
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import OffsetRMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params


def gdn_mixer(c: Config) -> GatedDeltaNet:
    return GatedDeltaNet(
        c.hidden_size,
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
        c.linear_conv_kernel_dim,
        c.rms_norm_eps,
    )


def gated_attention(c: Config, rotary: Rotary) -> Attention:
    return Attention(
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        rotary,
        bias=c.get("attention_bias", False),
        qk_norm=OffsetRMSNorm,
        eps=c.rms_norm_eps,
        gated=True,
    )


def layer_types(c: Config) -> list[str]:
    if c.get("layer_types"):
        return list(c.layer_types)
    interval = c.get("full_attention_interval", 4)
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(c.num_hidden_layers)
    ]


@register("qwen3_5_text", "qwen3_5")
class Qwen3_5(CausalLM):
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        c.setdefault("head_dim", c.hidden_size // c.num_attention_heads)
        rope = c.get_rope()
        rope.setdefault("partial_rotary_factor", 0.25)
        self.rotary = rotary = Rotary(*inv_freq_from_params(c.head_dim, rope))
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList()
        for i, kind in enumerate(layer_types(c)):
            if kind == "linear_attention":
                mixer_name, mixer = "linear_attn", gdn_mixer(c)
            else:
                mixer_name, mixer = "self_attn", gated_attention(c, rotary)
            mlp = self.mlp(c, i)
            self.model.layers.append(
                DecoderLayer(mixer_name, mixer, mlp, OffsetRMSNorm, c.hidden_size, c.rms_norm_eps)
            )
        self.model.norm = OffsetRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    def mlp(self, c: Config, index: int) -> nn.Module:
        """The feed-forward block of layer `index`."""
        return GatedMLP(c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"))

    def mtp_head(self) -> MTPHead:
        """One gated full-attention decoder layer with layer 0's feed-forward block (Qwen3-Next: the
        MoE where layer 0 has it), as the published heads are built."""
        c = self.config
        d, eps = c.hidden_size, c.rms_norm_eps
        attention = gated_attention(c, self.rotary)
        layer = DecoderLayer("self_attn", attention, self.mlp(c, 0), OffsetRMSNorm, d, eps)
        return MTPHead(layer, OffsetRMSNorm, d, eps)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        if name.startswith(("model.visual.", "visual.", "mtp.")):
            return None
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model.") :]
        return name
