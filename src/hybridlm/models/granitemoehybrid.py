"""Granite 4.0-H (`granitemoehybrid`: Micro dense, Tiny / Small MoE): Mamba-2 and attention layers per
`layer_types`, each followed by the always-on shared SwiGLU MLP plus, where `num_local_experts` > 0,
a softmax top-k mixture of SwiGLU experts (`block_sparse_moe`: the top-k router logits softmaxed),
RoPE or no positional encoding per `position_embedding_type`, and the µP multipliers: embeddings
times `embedding_multiplier`, every block's output times `residual_multiplier` before the residual
add, attention scores scaled by `attention_multiplier` (not head_dim^-0.5), logits divided by
`logits_scaling`.

The checkpoint's shared MLP holds gate and up in one `input_linear` (gate first); `convert` splits it
into the shared `GatedMLP`'s two projections, `remap` renames the rest (the experts' stacked
`input_linear` / `output_linear` become `Experts`' `gate_up_proj` / `down_proj`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from hybridlm.batch import Batch
from hybridlm.models.base import CausalLM, Config, register, renamed
from hybridlm.models.layers import Attention, DecoderLayer, GatedMLP
from hybridlm.models.mamba2 import mamba2_mixer
from hybridlm.models.moe import Experts, routes_in_kernel
from hybridlm.ops.linear import Linear
from hybridlm.ops.moe import route_rows
from hybridlm.ops.norms import RMSNorm
from hybridlm.ops.rope import Rotary, inv_freq_from_params

RENAMES = [
    (".shared_mlp.output_linear.", ".mlp.down_proj."),
    (".shared_mlp.input_linear.", ".mlp.input_linear."),
    (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".block_sparse_moe.router."),
]


MAMBA_KINDS = ("mamba", "linear_attention")


class SoftmaxTopKMoE(nn.Module):
    """Granite's routed experts: the router's top-k logits (float32) softmaxed into weights in the
    activation dtype (the top k of the softmax renormalised, as `moe.softmax_topk` computes it: decode
    rows take the router kernel, `ops.moe.route_rows`); gated SwiGLU experts (`moe.Experts`: only the
    chosen ones run). The router keeps the model's dtype when quantizing, as `moe.Router`s do."""

    UNQUANTIZED = ("router",)

    def __init__(self, c: Config):
        super().__init__()
        self.top_k = c.num_experts_per_tok
        self.router = Linear(c.hidden_size, c.num_local_experts, bias=False)
        act = c.get("hidden_act", "silu")
        self.experts = Experts(c.num_local_experts, c.hidden_size, c.intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d] -> [B, L, d]."""
        return self.run(self._modules, x)

    def run(self, parts: Mapping[str, Callable], x: torch.Tensor) -> torch.Tensor:
        """`forward` over `parts` (see `DecoderLayer.run`)."""
        flat = x.reshape(-1, x.shape[-1])
        weight = self.router._parameters.get("weight")
        if isinstance(self.router, nn.Linear) and routes_in_kernel(flat, weight):
            rule = (self.top_k, False, True, None, 1.0, 0.0)  # softmax, top k renormalised
            weights, index, _ = route_rows(flat.contiguous(), weight, *rule, None, None, -1, x.dtype)
        else:
            logits, index = parts["router"](flat).float().topk(self.top_k, dim=-1)
            weights = logits.softmax(dim=-1).to(x.dtype)
        return parts["experts"](flat, index, weights).view(x.shape)


class ScaledDecoderLayer(DecoderLayer):
    """Pre-norm block whose mixer and feed-forward outputs are scaled before each residual add:
    h + r·mixer(norm(h)), then h + r·ff(norm(h)) with ff = shared MLP (+ routed experts if any)."""

    def __init__(self, *args, residual_multiplier: float, moe: nn.Module | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.residual_multiplier = residual_multiplier
        self.block_sparse_moe = moe

    def run(self, parts: Mapping[str, Callable], h: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        r, moe, mlp = self.residual_multiplier, parts.get("block_sparse_moe"), parts["mlp"]
        h = h + parts[self.mixer_name](parts["input_layernorm"](h), batch, cache) * r
        x = parts["post_attention_layernorm"](h)
        ff = mlp(x) if moe is None else moe(x) + mlp(x)
        return h + ff * r


@register("granitemoehybrid")
class GraniteMoeHybrid(CausalLM):
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        d = c.hidden_size
        head_dim = c.get("head_dim") or d // c.num_attention_heads
        if c.get("position_embedding_type") == "rope":
            rotary = Rotary(*inv_freq_from_params(head_dim, c.get_rope()))
        else:
            rotary = Rotary(torch.zeros(0, device="cpu"))  # no positional encoding: a rotation of no dims
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.model.layers = nn.ModuleList()
        for kind in c.layer_types:
            # Published configs: "mamba" / "attention"; transformers 5: "linear_attention" / "full_attention".
            if kind not in MAMBA_KINDS:
                mixer_name = "self_attn"
                mixer = Attention(
                    d, c.num_attention_heads, c.num_key_value_heads, head_dim, rotary,
                    bias=c.get("attention_bias", False), scale=c.get("attention_multiplier", 1.0),
                )
            else:
                mixer_name = "mamba"
                mixer = mamba2_mixer(c)
            mlp = GatedMLP(d, c.shared_intermediate_size, c.get("hidden_act", "silu"))
            self.model.layers.append(ScaledDecoderLayer(
                mixer_name, mixer, mlp, RMSNorm, d, c.rms_norm_eps,
                residual_multiplier=c.get("residual_multiplier", 1.0),
                moe=SoftmaxTopKMoE(c) if c.get("num_local_experts", 0) else None,
            ))
        self.model.norm = RMSNorm(d, eps=c.rms_norm_eps)
        self.lm_head = Linear(d, c.vocab_size, bias=False)

    @classmethod
    def text_config(cls, raw: dict) -> Config:
        c = super().text_config(raw)
        if not c.get("layer_types"):
            c["layer_types"] = ["mamba"] * c.num_hidden_layers
        return c

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        return renamed(name, RENAMES)

    @classmethod
    def convert(cls, state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
        """Split each shared MLP's `input_linear` [2·I, d] into gate_proj (first half) and up_proj."""
        for name in [n for n in state if n.endswith(".mlp.input_linear.weight")]:
            gate, up = state.pop(name).chunk(2, dim=0)
            prefix = name[: -len("input_linear.weight")]
            state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"] = gate, up
        return state

    @classmethod
    def published(cls, state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
        """The shared MLP's gate and up joined back into `shared_mlp.input_linear`, the experts'
        stacks and router under their published names."""
        out = {}
        for name, t in state.items():
            if name.endswith(".mlp.up_proj.weight"):
                continue
            if name.endswith(".mlp.gate_proj.weight"):
                t = torch.cat([t, state[name.replace(".gate_proj.", ".up_proj.")]])
                name = name.replace(".gate_proj.", ".input_linear.")
            for theirs, ours in RENAMES:
                if ours in name:
                    name = name.replace(ours, theirs)
                    break
            out[name] = t
        return out

    def embed(self, batch: Batch) -> torch.Tensor:
        return self.model.embed_tokens(batch.input_ids) * self.config.get("embedding_multiplier", 1.0)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float() / self.config.get("logits_scaling", 1.0)
