"""Gemma 3 (`gemma3_text`, and the multimodal `gemma3` layout whose text model we load): local
sliding-window attention layers interleaved with global attention, each with its own rope base,
q/k norm, sandwich norms around attention and MLP, `(1 + w)` RMSNorm, scaled embeddings."""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.batch import Batch
from hybridlm.models.base import CausalLM, Config, register
from hybridlm.models.layers import Attention, GatedMLP
from hybridlm.ops.elementwise import elementwise_rows
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import OffsetRMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params

SLIDING, FULL = "sliding_attention", "full_attention"

# Gemma3TextConfig defaults: published configs (the multimodal ones above all) leave these out.
DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
ROPE_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}

# checkpoint prefix -> parameter prefix (None: not part of the text model). transformers 5 names
# the multimodal model `model.language_model.*` in memory but saves the published layout
# `language_model.model.*`; both occur.
RENAMES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.vision_tower.": None,
    "vision_tower.": None,
    "model.multi_modal_projector.": None,
    "multi_modal_projector.": None,
}


def layer_types(c: Config) -> list[str]:
    """`layer_types`, or the older `sliding_window_pattern`: every pattern-th layer is global."""
    if c.get("layer_types"):
        return list(c.layer_types)
    pattern = c.sliding_window_pattern
    return [SLIDING if (i + 1) % pattern else FULL for i in range(c.num_hidden_layers)]


def rope_params(c: Config, kind: str) -> dict:
    """Rope parameters of one layer type, as transformers derives them: `rope_parameters` nested
    by layer type, else the flat fields (`rope_theta` and `rope_scaling` for the global layers,
    `rope_local_base_freq` for the sliding ones)."""
    params = dict((c.get("rope_parameters") or {}).get(kind) or {})
    if kind == FULL:
        params.update(c.get("rope_scaling") or {})
        params.setdefault("rope_theta", c.get("rope_theta", ROPE_THETA[FULL]))
    else:
        params.setdefault("rope_theta", c.get("rope_local_base_freq", ROPE_THETA[SLIDING]))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


class Gemma3Block(nn.Module):
    """Sandwich-norm block: h + post_attn(attn(input(h))), then h + post_ff(mlp(pre_ff(h)))."""

    def __init__(self, c: Config, attn: Attention):
        super().__init__()
        self.self_attn = attn
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_activation)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, OffsetRMSNorm(c.hidden_size, eps=c.rms_norm_eps))

    def make_cache(self, batch_size: int, dtype, device):
        return self.self_attn.make_cache(batch_size, dtype, device)

    def forward(self, h: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        """h [B, L, d] -> [B, L, d]; advances the attention cache by the batch."""
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), batch, cache))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


@register("gemma3_text", "gemma3")
class Gemma3(CausalLM):
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        if c.use_bidirectional_attention:
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not causal")
        kinds = layer_types(c)
        # the loader builds under torch.device("meta"); the rotary tables must hold real values
        with torch.device("cpu"):
            rotary = {k: Rotary(*inv_freq_from_params(c.head_dim, rope_params(c, k))) for k in set(kinds)}
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList()
        for kind in kinds:
            # attn_logit_softcapping is not applied: Gemma 3 replaced it by q/k norm, and
            # transformers' Gemma 3 attention ignores the field too.
            attn = Attention(
                c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, rotary[kind],
                bias=c.attention_bias, qk_norm=OffsetRMSNorm, eps=c.rms_norm_eps,
                window=c.sliding_window if kind == SLIDING else None, scale=c.query_pre_attn_scalar**-0.5,
            )
            self.model.layers.append(Gemma3Block(c, attn))
        self.model.norm = OffsetRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    @classmethod
    def text_config(cls, raw: dict) -> Config:
        text = dict(raw.get("text_config") or raw)
        if "text_config" in raw:
            # the multimodal model ties its head by its own field (default True), not the text one
            text["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
        for key, value in DEFAULTS.items():
            text.setdefault(key, value)
        return Config(text)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        for old, new in RENAMES.items():
            if name.startswith(old):
                return None if new is None else new + name[len(old) :]
        return name

    def embed(self, batch: Batch) -> torch.Tensor:
        """[B, L, d] embeddings times sqrt(d), the scale rounded to the activation dtype first
        (as the reference does: sqrt(3072) is 55.5 in bf16)."""
        e = self.model.embed_tokens(batch.input_ids)
        return e * torch.tensor(self.config.hidden_size**0.5).to(e.dtype)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., V] float32 logits, soft-capped to ±cap when the config sets a cap."""
        logits = self.lm_head(h).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = elementwise_rows(lambda t: torch.tanh(t / cap) * cap, logits)
        return logits
