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
from hybridlm.models.checkpoint import CheckpointError
from hybridlm.models.layers import ACTIVATIONS, GatedMLP
from hybridlm.models.qwen3_5 import Qwen3_5, layer_types
from hybridlm.ops.elementwise import elementwise_rows
from hybridlm.ops.linear import Linear, linear


class Experts(nn.Module):
    """The routed experts, stored as transformers holds them: `gate_up_proj` [E, 2·I, d] (gate rows
    first) and `down_proj` [E, d, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, d], index / weights [N, k] (expert ids; routing weights in x's dtype, or float32 to
        weight each expert's output in float32) -> [N, d].

        Tokens are grouped by expert and only the experts some token selected run, each as one
        matmul over its tokens on a view of its weights (`ops.linear.linear`, so few-token bf16
        calls take the decode kernel): at decode that reads exactly the k selected experts'
        weights once.
        """
        k = index.shape[1]
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)
        hit, sizes = torch.unique_consecutive(flat[order], return_counts=True)
        tokens = order // k
        w = weights.reshape(-1)[order, None]
        # Each expert's output is weighted in the activation dtype, the k of a token summed in
        # float32 and rounded once (transformers' default grouped_mm path does the same).
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, n in zip(hit.tolist(), sizes.tolist(), strict=True):
            rows = tokens[start : start + n]
            gate, up = linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = linear(elementwise_rows(self.act, gate) * up, self.down_proj[e])
            # index_put_ accumulates serially: index_add_ opens a parallel region per expert, which
            # cost milliseconds per call on a loaded 2-core machine. Either adds once per row.
            out.index_put_((rows,), (y * w[start : start + n]).float(), accumulate=True)
            start += n
        return out.to(x.dtype)


class SparseMoE(nn.Module):
    """Top-k softmax router over `experts`, plus `shared_expert` scaled by sigmoid(`shared_expert_gate`)."""

    def __init__(self, c: Config):
        super().__init__()
        act = c.get("hidden_act", "silu")
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.get("norm_topk_prob", True)
        self.gate = Linear(c.hidden_size, c.num_experts, bias=False)
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, act)
        self.shared_expert = GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, act)
        self.shared_expert_gate = Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d] -> [B, L, d]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        # Routing probabilities in float32; the chosen weights go back to the activation dtype.
        probs = self.gate(x).softmax(dim=-1, dtype=torch.float32)
        weights, index = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, index, weights.to(x.dtype))
        out = out + elementwise_rows(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


def is_sparse(c: Config, index: int) -> bool:
    """Whether layer `index` has the MoE block (transformers' rule)."""
    return (
        index not in (c.get("mlp_only_layers") or [])
        and c.get("num_experts", 0) > 0
        and (index + 1) % c.get("decoder_sparse_step", 1) == 0
    )


def take(state: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Pop checkpoint tensor `name`, checking its shape."""
    if name not in state:
        raise CheckpointError(f"missing tensor {name!r}")
    t = state.pop(name)
    if tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


@register("qwen3_next")
class Qwen3Next(Qwen3_5):
    def mlp(self, c: Config, index: int) -> nn.Module:
        if is_sparse(c, index):
            return SparseMoE(c)
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
            e, inter = f"{p}.mlp.experts", c.moe_intermediate_size
            if f"{e}.0.gate_proj.weight" in state:
                n = range(c.num_experts)
                gate = [take(state, f"{e}.{j}.gate_proj.weight", (inter, d)) for j in n]
                up = [take(state, f"{e}.{j}.up_proj.weight", (inter, d)) for j in n]
                down = [take(state, f"{e}.{j}.down_proj.weight", (d, inter)) for j in n]
                state[f"{e}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
                state[f"{e}.down_proj"] = torch.stack(down)
        return state
