"""Qwen3-Next (`qwen3_next`): Qwen3.5's hybrid of Gated DeltaNet and gated full attention, with

- fused Gated DeltaNet input projections `in_proj_qkvz` / `in_proj_ba`, interleaved per key-head
  group; `convert` splits them at load time into the shared layer's `in_proj_qkv` / `in_proj_z` /
  `in_proj_b` / `in_proj_a`, so layer, cache and replay code are Qwen3.5's;
- a sparse mixture of experts with a sigmoid-gated shared expert on the layers chosen by
  `decoder_sparse_step` / `mlp_only_layers`, a dense MLP elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.models.base import Config, register
from hybridlm.models.checkpoint import take
from hybridlm.models.layers import GatedMLP
from hybridlm.models.moe import SOFTMAX, Experts, Router, SparseMoE, stack_experts
from hybridlm.models.qwen3_5 import Qwen3_5, layer_types


def sparse_moe(c: Config) -> SparseMoE:
    """Top-k softmax router over the routed experts, plus `shared_expert` scaled by
    sigmoid(`shared_expert_gate`); routing weights rounded to the activation dtype, as transformers
    does."""
    act = c.get("hidden_act", "silu")
    top_k, normalize = c.num_experts_per_tok, c.get("norm_topk_prob", True)
    router = Router(c.hidden_size, c.num_experts, top_k, SOFTMAX, normalize)
    experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, act)
    shared = GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, act)
    return SparseMoE(router, experts, shared, "shared_expert", gated_shared=True, weights_dtype="activation")


def is_sparse(c: Config, index: int) -> bool:
    """Whether layer `index` has the MoE block (transformers' rule)."""
    return (
        index not in (c.get("mlp_only_layers") or [])
        and c.get("num_experts", 0) > 0
        and (index + 1) % c.get("decoder_sparse_step", 1) == 0
    )


@register("qwen3_next")
class Qwen3Next(Qwen3_5):
    def mlp(self, c: Config, index: int) -> nn.Module:
        if is_sparse(c, index):
            return sparse_moe(c)
        return super().mlp(c, index)

    @classmethod
    def convert(cls, state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
        """De-interleave the fused Gated DeltaNet projections; stack per-expert weights.

        `in_proj_qkvz` rows are grouped by key head: [q (Dk), k (Dk), v (r·Dv), z (r·Dv)] per key
        head, r = Hv / Hk value heads per key head; `in_proj_ba` rows likewise [b (r), a (r)].
        Value head j of key head g is value head g·r + j in both layouts.
        Published checkpoints (and transformers' `save_pretrained`) store experts one by one:
        `mlp.experts.{e}.{gate,up,down}_proj.weight`, the MTP head's layer (`mtp.layers.0`, with
        layer 0's feed-forward block) too. Layers absent from `state` are left alone (the MTP head is
        loaded on its own).
        """
        c = config
        d, hk, hv = c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv, r = c.linear_key_head_dim, c.linear_value_head_dim, hv // hk
        for i, kind in enumerate(layer_types(c)):
            la = f"model.layers.{i}.linear_attn"
            if kind == "linear_attention" and f"{la}.in_proj_qkvz.weight" in state:
                qkvz = take(state, f"{la}.in_proj_qkvz.weight", (hk * (2 * dk + 2 * r * dv), d))
                q, k, v, z = qkvz.view(hk, -1, d).split([dk, dk, r * dv, r * dv], dim=1)
                state[f"{la}.in_proj_qkv.weight"] = torch.cat([t.reshape(-1, d) for t in (q, k, v)])
                state[f"{la}.in_proj_z.weight"] = z.reshape(-1, d)
                ba = take(state, f"{la}.in_proj_ba.weight", (2 * hv, d))
                b, a = ba.view(hk, 2 * r, d).split([r, r], dim=1)
                state[f"{la}.in_proj_b.weight"] = b.reshape(hv, d)
                state[f"{la}.in_proj_a.weight"] = a.reshape(hv, d)
        sparse = [f"model.layers.{i}" for i in range(len(layer_types(c))) if is_sparse(c, i)]
        for p in sparse + (["mtp.layers.0"] if is_sparse(c, 0) else []):
            stack_experts(state, f"{p}.mlp.experts", c.num_experts, d, c.moe_intermediate_size)
        return state


@register("qwen3_5_moe_text", "qwen3_5_moe")
class Qwen3_5Moe(Qwen3Next):
    """Qwen3.5-MoE (`qwen3_5_moe_text`, and the vision-language `qwen3_5_moe` layout whose text model we
    load): Qwen3.5's separate Gated DeltaNet projections and gated attention, the sparse MoE with a
    sigmoid-gated shared expert on every layer (no dense MLP), zero-centred RMSNorm, and an MTP head
    whose layer has the MoE block. Experts are stored one by one (`convert` stacks them) or already
    stacked; the checkpoint's other names are Qwen3.5's (`remap`)."""
