"""Falcon-H1 (`falcon_h1`): attention and Mamba-2 side by side in every layer,

    x = norm(h);  h = h + m_ssm_out · mamba(m_ssm_in · x) + m_attn_out · attn(m_attn_in · x)
    h = h + mlp(norm(h))

with Falcon's µP multipliers: the Mamba-2 input projection scaled per part (`ssm_multipliers` over
z, x, B, C, dt: the `mup_vector`, applied before the split, so the logged xBC rows are the scaled
ones the conv reads), keys times `key_multiplier`, the MLP's gate and output (`mlp_multipliers`),
embeddings and logits (`embedding_multiplier`, `lm_head_multiplier`). The Mamba-2 output is gated by
silu(z), through a per-group RMSNorm (normalised before the gate, by default) where
`mamba_rms_norm` says.

Every layer holds KV rows *and* a Mamba-2 state. Each is its own cache of its own kind — the model's
cache list has two entries a layer, `[kv_0, ssm_0, kv_1, ssm_1, ...]` — so the prefix trie, the
tiers, packing and speculation handle them as they handle any attention or Mamba-2 layer, and a trie
node holds the layer's two snapshots side by side (DESIGN §3.9's "one layer, two caches").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache
from hybridlm.models.base import CausalLM, Config, register
from hybridlm.models.layers import Attention, GatedMLP
from hybridlm.models.mamba2 import Mamba2Mixer, mamba_head_dim, time_step_limit
from hybridlm.ops.elementwise import elementwise_rows
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import RMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params


class FalconMamba(Mamba2Mixer):
    """The Mamba-2 mixer with Falcon's input scale and per-part projection multipliers, and the plain
    silu(z) gate where the config has no gated norm."""

    def __init__(self, *args, in_multiplier: float, multipliers: list[float], rms_norm: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_multiplier = in_multiplier
        gn = self.groups * self.state_size
        sizes = [self.inner, self.inner, gn, gn, self.heads]
        # Not a checkpoint tensor (transformers computes it from the config too); made on the CPU
        # whatever device the module is built on, and cast to the projection's dtype where used.
        self.mup = torch.cat([torch.full((n,), float(m), device="cpu") for n, m in zip(sizes, multipliers,
                                                                                      strict=True)])
        if not rms_norm:
            self.norm = None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.in_proj(x * self.in_multiplier)
        return proj * self.mup.to(proj.device, proj.dtype)

    def gate(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.norm is not None:
            return self.norm(y, z, dtype)
        return (y * F.silu(z.float())).to(dtype)


class FalconAttention(Attention):
    """Attention whose keys are scaled by `key_multiplier` before the rotation."""

    def __init__(self, *args, key_multiplier: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_multiplier = key_multiplier

    def forward(self, x: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        k = k * self.key_multiplier
        return self.o_proj(self.attend_projected(q, k, v, batch, cache, self.q_norm, self.k_norm))


class FalconMLP(GatedMLP):
    """down(act(m_gate · gate(x)) · up(x)) · m_down."""

    def __init__(self, *args, multipliers: list[float], **kwargs):
        super().__init__(*args, **kwargs)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = elementwise_rows(self.act, gate * self.gate_multiplier)
        return self.down_proj(up * act) * self.down_multiplier


class FalconH1Layer(nn.Module):
    """One layer: Mamba-2 and attention in parallel on the same normed input, then the MLP."""

    def __init__(self, c: Config, rotary: Rotary):
        super().__init__()
        d, eps = c.hidden_size, c.rms_norm_eps
        head_dim = c.get("head_dim") or d // c.num_attention_heads
        inner = c.get("mamba_d_ssm") or int(c.mamba_expand * d)
        mamba_head = mamba_head_dim(c, inner)
        self.attn_in = c.get("attention_in_multiplier", 1.0)
        self.attn_out = c.get("attention_out_multiplier", 1.0)
        self.ssm_out = c.get("ssm_out_multiplier", 1.0)
        self.mamba = FalconMamba(
            d, c.mamba_n_heads, mamba_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv,
            eps=eps, dt_limit=time_step_limit(c), conv_bias=c.get("mamba_conv_bias", True),
            proj_bias=c.get("mamba_proj_bias", False), norm_before_gate=c.get("mamba_norm_before_gate", True),
            in_multiplier=c.get("ssm_in_multiplier", 1.0),
            multipliers=c.get("ssm_multipliers") or [1.0] * 5, rms_norm=c.get("mamba_rms_norm", False),
        )
        if c.get("projectors_bias", False) != c.get("mamba_proj_bias", False):
            # The output projection's bias follows `projectors_bias`, the input's `mamba_proj_bias`.
            self.mamba.out_proj = Linear(inner, d, bias=c.get("projectors_bias", False))
        self.self_attn = FalconAttention(
            d, c.num_attention_heads, c.num_key_value_heads, head_dim, rotary,
            bias=c.get("attention_bias", False), key_multiplier=c.get("key_multiplier", 1.0),
        )
        self.feed_forward = FalconMLP(
            d, c.intermediate_size, c.get("hidden_act", "silu"), bias=c.get("mlp_bias", False),
            multipliers=c.get("mlp_multipliers") or [1.0, 1.0],
        )
        self.input_layernorm = RMSNorm(d, eps=eps)
        self.pre_ff_layernorm = RMSNorm(d, eps=eps)

    def make_caches(self, batch_size: int, dtype, device) -> list[LayerCache]:
        """[KV cache, Mamba-2 cache]."""
        return [self.self_attn.make_cache(batch_size, dtype, device),
                self.mamba.make_cache(batch_size, dtype, device)]

    def forward(self, h: torch.Tensor, batch: Batch, kv, ssm) -> torch.Tensor:
        x = self.input_layernorm(h)
        ssm_out = self.mamba(x, batch, ssm) * self.ssm_out
        h = h + (ssm_out + self.self_attn(x * self.attn_in, batch, kv) * self.attn_out)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


@register("falcon_h1")
class FalconH1(CausalLM):
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        head_dim = c.get("head_dim") or c.hidden_size // c.num_attention_heads
        rotary = Rotary(*inv_freq_from_params(head_dim, c.get_rope()))
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList(FalconH1Layer(c, rotary) for _ in range(c.num_hidden_layers))
        self.model.final_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    def make_caches(self, batch_size: int = 1) -> list[LayerCache | None]:
        """Two caches a layer: `[kv_0, ssm_0, kv_1, ssm_1, ...]`."""
        made = (layer.make_caches(batch_size, self.dtype, self.device) for layer in self.model.layers)
        return [c for pair in made for c in pair]

    def hidden_states(self, batch: Batch, caches: list) -> torch.Tensor:
        """[B, L, d] final-normed hidden states; layer i advances caches 2i (KV) and 2i + 1 (Mamba-2).
        Every step runs through the modules (decode plans know only single-cache layers)."""
        self.prepare(batch)
        h = self.embed(batch)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, batch, caches[2 * i], caches[2 * i + 1])
        return self.model.final_layernorm(h)

    def embed(self, batch: Batch) -> torch.Tensor:
        return self.model.embed_tokens(batch.input_ids) * self.config.get("embedding_multiplier", 1.0)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float() * self.config.get("lm_head_multiplier", 1.0)
