"""LFM2 (`lfm2`): gated short-convolution layers interleaved with full attention (q/k RMSNorm),
SwiGLU feed-forward, RMSNorm everywhere (weight applied after the cast back, Llama order).

The checkpoint names its pieces differently from the shared layers (`operator_norm`,
`feed_forward.w1/w3/w2`, `self_attn.out_proj`, `q_layernorm`, `model.embedding_norm` — which,
despite its name, is the final norm); `remap` renames them so the shared `Attention`, `GatedMLP`
and `DecoderLayer` are used as they are.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hybridlm.batch import Batch, Packed
from hybridlm.cache import ConvCache
from hybridlm.models.base import CausalLM, Config, register, renamed
from hybridlm.models.layers import Attention, DecoderLayer, GatedMLP, per_segment, segment_rows
from hybridlm.models.moe import SIGMOID, Experts, Router, SparseMoE, stack_experts
from hybridlm.ops.conv import causal_conv1d, causal_conv1d_packed
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import RMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params

# Checkpoint name fragment -> parameter name fragment (a tensor name holds at most one of them).
RENAMES = [
    ("model.embedding_norm.", "model.norm."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    # LFM2-MoE: the router's selection bias sits on the block, the router and experts inside it
    (".feed_forward.expert_bias", ".mlp.gate.e_score_correction_bias"),
    (".feed_forward.", ".mlp."),
]


class ShortConv(nn.Module):
    """LFM2's gated short convolution: in_proj -> (B, C, x); y = C · conv(B · x); out_proj(y).

    The conv input B·x [B, L, hidden] is what `ConvCache` logs and carries (its last K-1 rows are
    the tail), so replay needs no projection: the cache's own `conv_replay` suffices.
    """

    def __init__(self, hidden: int, kernel: int, bias: bool):
        super().__init__()
        self.hidden, self.kernel = hidden, kernel
        self.in_proj = Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)

    def make_cache(self, batch_size: int, dtype, device) -> ConvCache:
        return ConvCache(batch_size, self.hidden, self.kernel, dtype, device)

    def forward(self, x: torch.Tensor, batch: Batch, cache: ConvCache) -> torch.Tensor:
        """x [B, L, hidden] -> [B, L, hidden]; advances `cache` by the batch's real tokens (a `Packed`
        batch: the projections over all rows, the convolution of its decode / verify segments in one
        call, each on its own cache, and of any longer segment alone)."""
        b_gate, c_gate, v = self.in_proj(x).chunk(3, dim=-1)
        packed = partial(self.convolve_packed, batch, cache)
        y = per_segment(batch, cache, self.convolve, b_gate * v, packed=packed)
        return self.out_proj(c_gate * y)

    def convolve(self, batch: Batch, cache: ConvCache, bx: torch.Tensor) -> torch.Tensor:
        """The causal conv of this forward's conv inputs bx [B, L, hidden] from `cache`'s tail; the
        cache takes the new tail, its captures and (while recording) the inputs."""
        return self.convolve_history(batch, cache, cache.get(batch), bx)

    def convolve_history(self, batch: Batch, cache: ConvCache, hist, bx: torch.Tensor) -> torch.Tensor:
        """`convolve` from `hist`, what `cache.get(batch)` returned for this forward."""
        # Padded positions must not reach the carried tail (a padded row ends in the state of its prefix).
        lens = batch.query_lens if batch.padded else None
        w, bias = self.conv.weight.squeeze(1), self.conv.bias
        y, tail, tails = causal_conv1d(bx, w, bias, hist.conv_tail, query_lens=lens, splits=hist.splits)
        cache.put(batch, tail, None, [(t, None) for t in tails], inputs=bx if hist.record else None)
        return y

    def convolve_packed(self, batch: Packed, caches: list[ConvCache], few: list[int], bx: torch.Tensor):
        """Segments `few` of a packed batch (bx [1, T, hidden]) in one conv call, each from and into its
        own cache's tail -> y [1, T, hidden] with their rows set."""
        starts, lens = segment_rows(batch, few)
        segs = [batch.segments[i] for i in few]
        own = [caches[i] for i in few]
        hists = [c.get(s) for c, s in zip(own, segs, strict=True)]
        w, bias = self.conv.weight.squeeze(1), self.conv.bias
        priors, splits = [h.conv_tail for h in hists], [h.splits for h in hists]
        ran = causal_conv1d_packed(bx, w, bias, priors, starts, lens, splits)
        if ran is None:
            y = bx.new_empty(bx.shape)
            for seg, c, h, lo, n in zip(segs, own, hists, starts, lens, strict=True):
                y.narrow(1, lo, n).copy_(self.convolve_history(seg, c, h, bx.narrow(1, lo, n)))
            return y
        y, tails, bounds = ran
        for j, (seg, c, h, lo, n) in enumerate(zip(segs, own, hists, starts, lens, strict=True)):
            inputs = bx.narrow(1, lo, n) if h.record else None
            c.put(seg, tails[j], None, [(t, None) for t in bounds[j]], inputs=inputs)
        return y


def ff_dim(c: Config) -> int:
    """The feed-forward width: `block_auto_adjust_ff_dim` (default on) takes 2/3 of
    `intermediate_size`, scales it by `block_ffn_dim_multiplier` and rounds up to
    `block_multiple_of` — so published configs say 12288 for an 8192-wide MLP."""
    size = c.intermediate_size
    if c.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = c.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = c.get("block_multiple_of", 256)
            size = int(multiplier * size)
            size = multiple * ((size + multiple - 1) // multiple)
    return size


@register("lfm2")
class Lfm2(CausalLM):
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        head_dim = c.get("head_dim") or c.hidden_size // c.num_attention_heads
        rotary = Rotary(*inv_freq_from_params(head_dim, c.get_rope(default_theta=1e6)))
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = nn.ModuleList()
        kernel = c.get("conv_L_cache", 3)
        for i, kind in enumerate(c.layer_types):
            if kind == "conv":
                mixer_name, mixer = "conv", ShortConv(c.hidden_size, kernel, c.get("conv_bias", False))
            else:
                mixer_name = "self_attn"
                mixer = Attention(
                    c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim, rotary,
                    qk_norm=RMSNorm, eps=c.norm_eps,
                )
            mlp = self.mlp(c, i)
            self.model.layers.append(DecoderLayer(mixer_name, mixer, mlp, RMSNorm, c.hidden_size, c.norm_eps))
        self.model.norm = RMSNorm(c.hidden_size, eps=c.norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    def mlp(self, c: Config, index: int) -> nn.Module:
        """The feed-forward block of layer `index`."""
        return GatedMLP(c.hidden_size, ff_dim(c))

    @classmethod
    def text_config(cls, raw: dict) -> Config:
        """Normalise the field names of older LFM2 configs the way `Lfm2Config` does."""
        c = Config(raw)
        c.setdefault("norm_eps", 1e-5)
        # Older configs: `tie_embedding` (wins over tie_word_embeddings), `block_ff_dim`, and
        # `full_attn_idxs` instead of `layer_types` (absent: every layer is attention).
        c["tie_word_embeddings"] = c.get("tie_embedding", c.get("tie_word_embeddings", True))
        c["intermediate_size"] = c.get("block_ff_dim", c.get("intermediate_size", 12288))
        if not c.get("layer_types"):
            idxs = c.get("full_attn_idxs")
            attn = set(range(c.num_hidden_layers) if idxs is None else idxs)
            c["layer_types"] = ["full_attention" if i in attn else "conv" for i in range(c.num_hidden_layers)]
        return c

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        return renamed(name, RENAMES)


@register("lfm2_moe")
class Lfm2Moe(Lfm2):
    """LFM2-MoE (`lfm2_moe`): LFM2's short-conv and attention layers, a dense SwiGLU feed-forward of
    `intermediate_size` (no auto-adjust) on the first `num_dense_layers` layers, then a sparse MoE:
    sigmoid router scores, `expert_bias` added for selection only (`use_expert_bias`), top-k,
    renormalised (+1e-6) when `norm_topk_prob`, times `routed_scaling_factor`; no shared expert.
    Experts are stored one by one as `feed_forward.experts.{e}.w1/w3/w2` (`convert` stacks them)."""

    def mlp(self, c: Config, index: int) -> nn.Module:
        if index < c.num_dense_layers:
            return GatedMLP(c.hidden_size, c.intermediate_size)
        router = Router(
            c.hidden_size, c.num_experts, c.num_experts_per_tok, SIGMOID, normalize=c.norm_topk_prob,
            bias=c.use_expert_bias, scaling=c.routed_scaling_factor, eps=1e-6,
        )
        experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, "silu")
        # transformers rounds the routing weights to the activation dtype before weighting the experts
        return SparseMoE(router, experts, weights_dtype="activation")

    @classmethod
    def text_config(cls, raw: dict) -> Config:
        """LFM2's normalisation, with Lfm2MoeConfig's defaults for the MoE fields."""
        c = super().text_config(raw)
        for key, value in MOE_DEFAULTS.items():
            c.setdefault(key, value)
        return c

    @classmethod
    def convert(cls, state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
        """Stack the per-expert tensors of the sparse layers (left alone where already stacked)."""
        c = config
        for i in range(c.num_dense_layers, len(c.layer_types)):
            stack_experts(state, f"model.layers.{i}.mlp.experts", c.num_experts, c.hidden_size,
                          c.moe_intermediate_size, ("w1", "w3", "w2"))
        return state


# Lfm2MoeConfig's defaults for the fields published configs may leave out.
MOE_DEFAULTS = {
    "num_dense_layers": 2,
    "use_expert_bias": True,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
}
