"""Dense decoders: Llama (`llama`) and Qwen3 (`qwen3`).

Both are pre-norm stacks of GQA attention + gated MLP with RMSNorm (cast to the input dtype
before the weight). They differ only in what the attention carries: Qwen3 RMS-normalises q and k
per head and may make its upper layers sliding-window; Llama has optional q/k/v/o and MLP biases.
"""

from __future__ import annotations

from torch import nn

from hybridlm.models.base import CausalLM, Config, register
from hybridlm.models.layers import Attention, DecoderLayer, GatedMLP
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import RMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params

# rope types whose parameters include the pretraining context length
LONG_CONTEXT_ROPE = ("llama3", "yarn", "longrope")


def rope_params(c: Config) -> dict:
    """`rope_parameters` as transformers standardises them: a scaled rope without its own
    `original_max_position_embeddings` takes the config's top-level one, else the model's limit."""
    rope = c.get_rope()
    if rope["rope_type"] in LONG_CONTEXT_ROPE:
        if "original_max_position_embeddings" in c:
            rope["original_max_position_embeddings"] = c.original_max_position_embeddings
        else:
            rope.setdefault("original_max_position_embeddings", c.max_position_embeddings)
    return rope


class DenseLM(CausalLM):
    """Shared body: every layer is `self_attn` + `mlp`; subclasses choose the q/k norm and the
    per-layer attention windows."""

    qk_norm: type[nn.Module] | None = None
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        # old configs omit head_dim (or write null) and num_key_value_heads (plain MHA)
        c["head_dim"] = c.get("head_dim") or c.hidden_size // c.num_attention_heads
        c["num_key_value_heads"] = c.get("num_key_value_heads") or c.num_attention_heads
        eps = c.get("rms_norm_eps", 1e-6)
        rotary = Rotary(*inv_freq_from_params(c.head_dim, rope_params(c)))
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList()
        for window in self.windows(c):
            attn = Attention(
                c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, rotary,
                bias=c.get("attention_bias", False), qk_norm=self.qk_norm, eps=eps, window=window,
            )
            mlp = GatedMLP(
                c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"), bias=c.get("mlp_bias", False)
            )
            self.model.layers.append(DecoderLayer("self_attn", attn, mlp, RMSNorm, c.hidden_size, eps))
        self.model.norm = RMSNorm(c.hidden_size, eps=eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    @classmethod
    def windows(cls, c: Config) -> list[int | None]:
        """Per layer: the sliding window in tokens (query included), or None for full attention."""
        return [None] * c.num_hidden_layers


@register("llama")
class Llama(DenseLM):
    """Llama 2/3: no q/k norm, `attention_bias` on q/k/v/o, `mlp_bias`, llama3 rope scaling."""


@register("qwen3")
class Qwen3(DenseLM):
    """Qwen3: per-head RMSNorm of q and k before rotary; layers listed as `sliding_attention`
    (by default those from `max_window_layers` on, when `use_sliding_window`) see the last
    `sliding_window` tokens."""

    qk_norm = RMSNorm

    @classmethod
    def windows(cls, c: Config) -> list[int | None]:
        # transformers drops sliding_window unless use_sliding_window (Qwen2-era configs carry a
        # window value with the flag off), which turns every layer into full attention
        window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
        if c.get("layer_types"):
            return [window if t == "sliding_attention" else None for t in c.layer_types]
        first = c.get("max_window_layers", 28)
        return [window if i >= first else None for i in range(c.num_hidden_layers)]
