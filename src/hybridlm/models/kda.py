"""Layers of the Kimi Delta Attention + multi-head latent attention hybrids (`kimi_linear`,
`bailing_hybrid`): the KDA token mixer, MLA, and their DeepSeek-style routed MoE.

Attribute names are this implementation's; the families' `remap` / `convert` bring the published
checkpoints' names and layouts to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.batch import Batch
from hybridlm.cache import LatentCache, RecurrentCache
from hybridlm.models.checkpoint import take
from hybridlm.models.layers import GatedMLP, per_segment, rope_tables
from hybridlm.models.moe import SIGMOID, Experts, Router, SparseMoE
from hybridlm.ops.attention import attention
from hybridlm.ops.conv import causal_conv1d
from hybridlm.ops.elementwise import elementwise_rows, token_rows
from hybridlm.ops.kda import kda_rule
from hybridlm.ops.linear import Linear
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.norms import RMSNorm, SigmoidGatedRMSNorm
from hybridlm.ops.rope import Rotary, apply_rotary


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), taken as x above 20 (transformers' form for Kimi's gate)."""
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


class KimiGate(nn.Module):
    """Kimi's per-channel decay: ``g = -exp(A_log[h]) · softplus(f_b(f_a(x)) + dt_bias)`` (softplus
    taken as the identity above 20, as transformers does), float32."""

    def __init__(self, hidden: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.f_a_proj = Linear(hidden, head_dim, bias=False)
        self.f_b_proj = Linear(head_dim, heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d] -> log decay [B, L, H, Dk] float32."""
        b, length, _ = x.shape
        g = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        softplus = elementwise_rows(_softplus, g).view(b, length, self.heads, -1)
        return -torch.exp(self.A_log.float()) * softplus


class SafeGate(nn.Module):
    """Ling's per-channel decay: with ``a = exp(A_log[h])`` and ``x' = f_proj(x) + dt_bias``, the
    lower-bounded "safe gate" ``g = lower_bound · sigmoid(a · x')`` (each token's log decay in
    (lower_bound, 0)), or ``-a · softplus(x')`` when the config turns it off; rounded to the
    activation dtype as transformers does."""

    def __init__(self, hidden: int, heads: int, head_dim: int, safe: bool, lower_bound: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.safe, self.lower_bound = safe, lower_bound
        self.f_proj = Linear(hidden, heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(heads * head_dim))
        self.A_log = nn.Parameter(torch.zeros(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d] -> log decay [B, L, H, Dk] in x's dtype."""
        b, length, _ = x.shape
        shape = (b, length, self.heads, self.head_dim)
        g = self.f_proj(x).float().view(shape) + self.dt_bias.view(1, 1, self.heads, self.head_dim)
        rate = self.A_log.exp().view(1, 1, self.heads, 1)
        if self.safe:
            g = self.lower_bound * elementwise_rows(torch.sigmoid, (rate * g).flatten(2)).view(shape)
        else:
            g = -rate * elementwise_rows(F.softplus, g.flatten(2)).view(shape)
        return g.to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """The KDA token mixer: q / k / v projections, each through its depthwise causal conv (one conv
    over q‖k‖v here) and SiLU, per-channel decay `gate`, β = sigmoid(b_proj(x)), KDA with in-kernel
    q / k L2 normalisation, per-head sigmoid-gated RMSNorm, o_proj.

    Scan inputs (what `RecurrentCache` logs per token for replay): the pre-conv q‖k‖v row
    [B, L, 3·H·Dk] in the activation dtype, and the post-gate log decay and β as one float32 row
    [B, L, H·Dk + H] (exactly what the scan consumed, so replay needs no projection).
    """

    def __init__(self, hidden: int, heads: int, head_dim: int, conv_kernel: int, gate: nn.Module,
                 out_gate: nn.Module, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.dim = heads * head_dim
        self.kernel = conv_kernel
        self.q_proj = Linear(hidden, self.dim, bias=False)
        self.k_proj = Linear(hidden, self.dim, bias=False)
        self.v_proj = Linear(hidden, self.dim, bias=False)
        self.conv1d = nn.Conv1d(3 * self.dim, 3 * self.dim, conv_kernel, groups=3 * self.dim, bias=False)
        self.gate = gate
        self.b_proj = Linear(hidden, heads, bias=False)
        self.out_gate = out_gate
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps=eps)
        self.o_proj = Linear(self.dim, hidden, bias=False)

    def make_cache(self, batch_size: int, dtype, device):
        h, d = self.heads, self.head_dim
        return RecurrentCache(batch_size, 3 * self.dim, self.kernel, h, d, d, self.replay, dtype, device)

    def forward(self, x: torch.Tensor, batch: Batch, cache: RecurrentCache) -> torch.Tensor:
        mask = batch.token_mask()
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        b, length, _ = x.shape
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = self.gate(x).float().reshape(b, length, self.dim)
        # beta is rounded to x's dtype before the scan takes it in float32, as in transformers
        beta = elementwise_rows(torch.sigmoid, self.b_proj(x)).float()
        gates = torch.cat([g, beta], dim=-1)
        o = per_segment(batch, cache, self.scan, qkv, gates)
        o = token_rows(self.o_norm, o, self.out_gate(x).view(b, length, self.heads, self.head_dim))
        return self.o_proj(o.reshape(b, length, self.dim))

    def mix(self, qkv, gates, conv_tail, state, query_lens=None, splits=(), inplace=False):
        """Conv + KDA over scan inputs: qkv [B, L, 3·H·Dk], gates [B, L, H·Dk + H] float32 ->
        (o [B, L, H, Dk], conv_tail, state, boundary) with boundary[i] = (tail, state) after
        `splits[i]` tokens; `inplace` advances `state` itself."""
        b, length, _ = qkv.shape
        shape = (b, length, self.heads, self.head_dim)
        x, tail, tails = causal_conv1d(
            qkv, self.conv1d.weight.squeeze(1), None, conv_tail, activation="silu",
            query_lens=query_lens, splits=splits,
        )
        q, k, v = (t.view(shape) for t in x.split(self.dim, dim=-1))
        g, beta = gates.split([self.dim, self.heads], dim=-1)
        o, state, states = kda_rule(
            q, k, v, g.view(shape), beta, state, normalize_qk=True, query_lens=query_lens,
            splits=splits, inplace=inplace,
        )
        return o, tail, state, list(zip(tails, states, strict=True))

    @torch.no_grad()
    def replay(self, conv_tail, state, qkv, gates):
        _, tail, state, _ = self.mix(qkv, gates, conv_tail, state, inplace=True)
        return tail, state

    def scan(self, batch: Batch, cache: RecurrentCache, qkv, gates) -> torch.Tensor:
        """Conv + KDA of this forward's scan inputs from `cache`'s state -> o [B, L, H, Dk]; the cache
        takes the new state, its captures and (while recording) the inputs."""
        hist = cache.get(batch)
        lens = batch.query_lens if batch.padded else None
        o, tail, state, boundary = self.mix(qkv, gates, hist.conv_tail, hist.state, lens, hist.splits, True)
        cache.put(
            batch, tail, state, boundary,
            inputs=qkv if hist.record else None, gates=gates if hist.record else None,
        )
        return o


class KimiOutGate(nn.Module):
    """Kimi's output-gate projection, low rank: g_b(g_a(x))."""

    def __init__(self, hidden: int, dim: int, head_dim: int):
        super().__init__()
        self.g_a_proj = Linear(hidden, head_dim, bias=False)
        self.g_b_proj = Linear(head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_b_proj(self.g_a_proj(x))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 MLA without a query low-rank path).

    Per token: q = q_proj(x) split per head into a no-position part [nope] and a rotary part [rope];
    the latent c = kv_a_layernorm(first `rank` of kv_a_proj_with_mqa(x)) and one shared key part
    k_rot (the rest, rotated when `rotary` is given). `LatentCache` stores c and k_rot. Keys and values
    of head h are k_h = [W_uk,h c ; k_rot], v_h = W_uv,h c with kv_b_proj = [W_uk,h ; W_uv,h] per head.

    Two equal ways to attend (equal within float rounding): prompts expand the latents to keys and
    values; a few queries (decode, verification: up to FEW_TOKENS) use the absorbed form
    q'_h = [W_uk,hᵀ q_nope,h ; q_rot,h] against the rows [c ; k_rot] (one shared "key head") with
    values c, then W_uv,h — reading only the latent rows, never expanded keys or values.
    Optional `head_gate` (Ling): the output of head h is scaled by sigmoid(g_proj(x)_h).
    """

    def __init__(self, hidden, heads, nope, rope, v_dim, rank, eps, rotary: Rotary | None,
                 scale: float, head_gate: bool = False, bias: bool = False):
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim, self.rank = heads, nope, rope, v_dim, rank
        self.rotary, self.scale = rotary, scale
        self.q_proj = Linear(hidden, heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, rank + rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(rank, eps=eps)
        self.kv_b_proj = Linear(rank, heads * (nope + v_dim), bias=False)
        self.o_proj = Linear(heads * v_dim, hidden, bias=bias)
        self.g_proj = Linear(hidden, heads, bias=False) if head_gate else None

    def make_cache(self, batch_size: int, dtype, device):
        return LatentCache(batch_size)

    def forward(self, x: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.heads, -1).transpose(1, 2)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # [B, 1, L, rank]
        k_rot = k_rot[:, None]
        if self.rotary is not None:
            cos, sin = rope_tables(batch, self.rotary, q.dtype)
            q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
            q = torch.cat([q_nope, apply_rotary(q_rot, cos, sin)], dim=-1)
            k_rot = apply_rotary(k_rot, cos, sin)
        o = per_segment(batch, cache, self.attend, q, latent, k_rot, dim=2)  # [B, H, L, v]
        o = o.transpose(1, 2)
        if self.g_proj is not None:
            o = o * elementwise_rows(torch.sigmoid, self.g_proj(x).float()).to(x.dtype)[..., None]
        return self.o_proj(o.reshape(b, length, -1))

    def attend(self, batch: Batch, cache: LatentCache, q, latent, k_rot, absorbed: bool | None = None):
        """q [B, H, L, nope + rope], latent [B, 1, L, rank], k_rot [B, 1, L, rope] of this forward ->
        [B, H, L, v] after `cache` took the rows. `absorbed` None picks the form by query count."""
        lat, rot, key_start = cache.update_latent(batch, latent, k_rot)
        if absorbed is None:
            # The absorbed form reads kv_b_proj's float weight; a quantized one expands.
            absorbed = q.shape[2] <= FEW_TOKENS and isinstance(self.kv_b_proj, nn.Linear)
        if absorbed:
            return self._absorbed(batch, q, lat, rot, key_start)
        b, _, t, _ = lat.shape
        kv = self.kv_b_proj(lat[:, 0]).view(b, t, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, rot.expand(-1, self.heads, -1, -1)], dim=-1)
        return attention(q, k, v, batch, key_start=key_start, scale=self.scale)

    def _absorbed(self, batch, q, lat, rot, key_start):
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        q_lat = torch.matmul(q_nope, w_uk.to(q.dtype))  # [B, H, L, rank]
        keys = torch.cat([lat, rot], dim=-1)  # [B, 1, T, rank + rope]
        o_lat = attention(
            torch.cat([q_lat, q_rot], dim=-1), keys, keys[..., : self.rank], batch,
            key_start=key_start, scale=self.scale,
        )
        return torch.matmul(o_lat, w_uv.transpose(1, 2).to(q.dtype))  # [B, H, L, v]


def moe_settings(c) -> dict:
    """The MoE fields under the names transformers writes to config.json (DeepSeek-V3's, through the
    families' attribute maps) or their DeepSeek names."""
    pick = lambda *names, default=None: next((c[n] for n in names if n in c), default)  # noqa: E731
    return dict(
        experts=pick("num_experts", "num_local_experts", "n_routed_experts"),
        top_k=pick("num_experts_per_token", "num_experts_per_tok"),
        n_group=pick("num_expert_group", "n_group", default=1),
        topk_group=pick("topk_group", default=1),
        norm=pick("moe_renormalize", "norm_topk_prob", default=True),
        shared=pick("num_shared_experts", "n_shared_experts", default=1),
    )


def feed_forward(c, kind: str) -> nn.Module:
    """The feed-forward block of a layer of MLP type `kind` ("dense" or "sparse")."""
    if kind == "dense":
        return GatedMLP(c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"))
    return routed_moe(c)


def routed_moe(c) -> SparseMoE:
    """The MoE block of config `c` (hidden_size, moe_intermediate_size, routed_scaling_factor and the
    fields of `moe_settings`): DeepSeek-V3's router (sigmoid scores in float32, selection by score +
    `e_score_correction_bias` among the best groups, scaled weights) over the experts, plus the
    always-on `shared_experts` MLP; a routing the config cannot run is a `CheckpointError`."""
    m = moe_settings(c)
    act = c.get("hidden_act", "silu")
    router = Router(
        c.hidden_size, m["experts"], m["top_k"], SIGMOID, m["norm"], bias=True, n_group=m["n_group"],
        topk_group=m["topk_group"], scaling=c.routed_scaling_factor, float32_logits=True,
    )
    experts = Experts(m["experts"], c.hidden_size, c.moe_intermediate_size, act)
    shared = GatedMLP(c.hidden_size, c.moe_intermediate_size * m["shared"], act)
    # float32 weights: each expert's output is weighted in float32 (as transformers' grouped_mm path
    # does for DeepSeek-style routers, whose weights stay float32), summed, rounded once
    return SparseMoE(router, experts, shared, "shared_experts", weights_dtype="float32")


def join_convs(state: dict, prefix: str, dim: int, kernel: int) -> None:
    """The q / k / v depthwise conv weights [dim, 1, K] as one conv over q‖k‖v ([3·dim, 1, K])."""
    if f"{prefix}.q_conv1d.weight" in state:
        parts = [take(state, f"{prefix}.{n}_conv1d.weight", (dim, 1, kernel)) for n in "qkv"]
        state[f"{prefix}.conv1d.weight"] = torch.cat(parts)
