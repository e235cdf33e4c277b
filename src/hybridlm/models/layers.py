"""Layers shared by the families: attention, gated MLP, Gated DeltaNet, the pre-norm block.

Attribute names follow the Hugging Face checkpoints (families remap where theirs differ).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from hybridlm.batch import Batch, Packed
from hybridlm.cache import KVCache, RecurrentCache, SlidingKVCache
from hybridlm.ops.attention import attention, attention_packed
from hybridlm.ops.conv import causal_conv1d, causal_conv1d_packed
from hybridlm.ops.elementwise import elementwise_rows, gated_rows
from hybridlm.ops.gated_delta import FUSED_MAX_LEN, gated_delta_net_scan, gated_delta_net_scan_packed
from hybridlm.ops.linear import Linear
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.norms import GatedRMSNorm
from hybridlm.ops.rope import Rotary, apply_rotary


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)² (Nemotron-H's non-gated MLPs and experts)."""
    return F.relu(x).square()


ACTIVATIONS = {
    "silu": F.silu,
    "relu2": relu2,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def rope_tables(batch: Batch, rotary: Rotary, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, L, rot_dim] for this forward, built once per rotary table (a packed batch joins
    its segments' own tables: each row gets the numbers it gets alone)."""
    if isinstance(batch, Packed):
        def build():
            tables = [rope_tables(s, rotary, dtype) for s in batch.segments]
            return torch.cat([c for c, _ in tables], dim=2), torch.cat([s for _, s in tables], dim=2)

        return batch.memoize(("rope", id(rotary), dtype), build)
    return batch.memoize(("rope", id(rotary), dtype), lambda: rotary.cos_sin(batch.positions(), dtype))


def per_segment(batch: Batch, cache, run, *rows: torch.Tensor, dim: int = 1, packed=None):
    """`run(batch, cache, *rows)` for a plain batch; for a `Packed` one, per segment on its own cache
    (`cache` is then the list of the segments' caches) with `rows` cut to its bounds along `dim`,
    the results joined along `dim`.

    With `packed`, the decode and verify segments (1 to FEW_TOKENS rows: `few_segments`) run in one
    call `packed(few, *rows)`, which advances each of their caches and returns the packed result
    with their rows set; the other segments (prefill chunks) still run one by one into the rest."""
    if not isinstance(batch, Packed):
        return run(batch, cache, *rows)
    few = few_segments(batch) if packed is not None else []
    out = packed(few, *rows) if few else None
    taken = set(few)
    outs = []
    for i, (seg, c, (lo, hi)) in enumerate(zip(batch.segments, cache, batch.bounds, strict=True)):
        if i in taken:
            continue
        y = run(seg, c, *(r.narrow(dim, lo, hi - lo) for r in rows))
        if out is None:
            outs.append(y)
        else:
            out.narrow(dim, lo, hi - lo).copy_(y)
    return torch.cat(outs, dim=dim) if out is None else out


def few_segments(batch: Packed) -> list[int]:
    """Indices of the segments the packed mixer kernels take: 1 to FEW_TOKENS rows (decode and
    verify rows), the lengths at which every per-token kernel computes a row as a one-sequence call
    does, so running them together changes no bit of any sequence."""
    return [i for i, (lo, hi) in enumerate(batch.bounds) if 0 < hi - lo <= FEW_TOKENS]


def segment_rows(batch: Packed, few: list[int]) -> tuple[list[int], list[int]]:
    """(starts, lengths) of segments `few` in the packed rows."""
    return [batch.bounds[i][0] for i in few], [batch.bounds[i][1] - batch.bounds[i][0] for i in few]


def scan_segments(batch: Packed, caches: list, few: list[int], inputs, gates, kernels, scan_history, empty):
    """A recurrent layer's `scan_packed`: segments `few` of a packed batch, each from and into its own
    cache. `kernels(hists, starts, lens)` runs the layer's packed conv and scan on the segments'
    histories and returns both results (`causal_conv1d_packed`'s, then the scan's (out, boundary
    states)), either None where its kernel does not apply. Each cache then takes its tail, state and
    boundary pairs, and while recording its rows of `inputs` / `gates` (the scan inputs, [1, T, ...]).
    Without the kernels each segment runs `scan_history(segment, cache, hist, its inputs, its gates)`
    into `empty()`. Returns the packed output with the segments' rows set."""
    starts, lens = segment_rows(batch, few)
    segs = [batch.segments[i] for i in few]
    own = [caches[i] for i in few]
    hists = [c.get(s) for c, s in zip(own, segs, strict=True)]
    conv, ran = kernels(hists, starts, lens)
    pieces = list(zip(segs, own, hists, starts, lens, strict=True))
    if ran is None:
        out = empty()
        for seg, c, h, lo, n in pieces:
            rows = inputs.narrow(1, lo, n), gates.narrow(1, lo, n)
            out.narrow(1, lo, n).copy_(scan_history(seg, c, h, *rows))
        return out
    out, state_bounds = ran
    _, tails, tail_bounds = conv
    for j, (seg, c, h, lo, n) in enumerate(pieces):
        c.put(
            seg,
            tails[j],
            h.state,
            list(zip(tail_bounds[j], state_bounds[j], strict=True)),
            inputs=inputs.narrow(1, lo, n) if h.record else None,
            gates=gates.narrow(1, lo, n) if h.record else None,
        )
    return out


class Attention(nn.Module):
    """Multi-head GQA attention with optional per-head q/k norm, output gate (Qwen3.5: q_proj
    yields query and gate), partial rotary, sliding window and logit soft-capping."""

    FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}  # see models.fused

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rotary: Rotary,
        *,
        bias: bool = False,
        qk_norm: type[nn.Module] | None = None,
        eps: float = 1e-6,
        gated: bool = False,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.gated, self.window, self.softcap = gated, window, softcap
        self.scale = scale if scale is not None else head_dim**-0.5
        self.rotary = rotary
        self.q_proj = Linear(hidden, heads * head_dim * (2 if gated else 1), bias=bias)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias)
        self.qkv_proj = None
        if qk_norm is not None:
            self.q_norm = qk_norm(head_dim, eps=eps)
            self.k_norm = qk_norm(head_dim, eps=eps)
        else:
            self.q_norm = self.k_norm = None

    def make_cache(self, batch_size: int, dtype, device):
        return KVCache(batch_size) if self.window is None else SlidingKVCache(self.window, batch_size)

    def forward(self, x: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attend_projected(q, k, v, batch, cache, self.q_norm, self.k_norm))

    def attend_projected(self, q, k, v, batch: Batch, cache: KVCache, q_norm, k_norm) -> torch.Tensor:
        """The layer between its projections: q [B, L, heads·head_dim (·2 when gated)], k / v [B, L,
        kv_heads·head_dim] -> [B, L, heads·head_dim], ready for o_proj; the cache takes k / v.
        `q_norm` / `k_norm` are the norms to apply (the layer's, or what a decode plan runs for them)."""
        b, length, _ = q.shape
        gate = None
        if self.gated:
            q, gate = q.view(b, length, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(b, length, -1)
        else:
            q = q.view(b, length, self.heads, self.head_dim)
        k = k.view(b, length, self.kv_heads, self.head_dim)
        v = v.view(b, length, self.kv_heads, self.head_dim)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope_tables(batch, self.rotary, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        packed = partial(self.attend_packed, batch, cache)
        o = per_segment(batch, cache, self.attend, q, k, v, dim=2, packed=packed)
        o = o.transpose(1, 2).reshape(b, length, -1)
        if gate is not None:
            o = o * elementwise_rows(torch.sigmoid, gate)
        return o

    def attend(self, batch: Batch, cache: KVCache, q, k, v) -> torch.Tensor:
        """q [B, Hq, L, D], k/v [B, Hkv, L, D] of this forward -> [B, Hq, L, D], after `cache` took k/v."""
        return self.attend_history(batch, cache.update(batch, k, v), q)

    def attend_packed(self, batch: Packed, caches: list[KVCache], few: list[int], q, k, v) -> torch.Tensor:
        """Segments `few` of a packed batch (q [1, Hq, T, D], k/v [1, Hkv, T, D]): each cache takes
        its segment's k/v, then one kernel call attends every segment over its own history ->
        [1, Hq, T, D] with their rows set."""
        starts, lens = segment_rows(batch, few)
        hists = [
            caches[i].update(batch.segments[i], k.narrow(2, lo, n), v.narrow(2, lo, n))
            for i, lo, n in zip(few, starts, lens, strict=True)
        ]
        out = attention_packed(
            q, hists, starts, lens, batch.positions(), scale=self.scale, softcap=self.softcap
        )
        if out is None:
            out = q.new_empty(q.shape)
            for i, lo, n, hist in zip(few, starts, lens, hists, strict=True):
                out.narrow(2, lo, n).copy_(self.attend_history(batch.segments[i], hist, q.narrow(2, lo, n)))
        return out

    def attend_history(self, batch: Batch, hist, q) -> torch.Tensor:
        """q [B, Hq, L, D] over `hist` (the cache's `AttentionHistory` after this forward's k/v)."""
        return attention(
            q,
            hist.keys,
            hist.values,
            batch,
            key_start=hist.key_start,
            scale=self.scale,
            window=hist.window,
            softcap=self.softcap,
            prefix=hist.prefix,
        )


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    FUSED = {"gate_up": ("gate_proj", "up_proj")}  # see models.fused

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up = None
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(gated_rows(self.act, gate, up))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next linear-attention layers).

    Scan inputs (what `RecurrentCache` logs for replay): the pre-conv projection [B, L, conv_dim]
    and the raw gate projections a‖b [B, L, 2·Hv]; everything after them is `mix`.
    """

    FUSED = {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")}  # see models.fused

    def __init__(self, hidden, k_heads, v_heads, k_dim, v_dim, conv_kernel, eps=1e-6):
        super().__init__()
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = k_heads, v_heads, k_dim, v_dim
        self.key_dim, self.value_dim = k_heads * k_dim, v_heads * v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = conv_kernel
        self.in_proj_qkv = Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, v_heads, bias=False)
        self.in_proj_a = Linear(hidden, v_heads, bias=False)
        self.in_proj = None
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.zeros(v_heads))
        self.norm = GatedRMSNorm(v_dim, eps=eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def make_cache(self, batch_size: int, dtype, device):
        return RecurrentCache(
            batch_size,
            self.conv_dim,
            self.kernel,
            self.v_heads,
            self.k_dim,
            self.v_dim,
            self.replay,
            dtype,
            device,
        )

    def mix(self, qkv, ab, conv_tail, state, query_lens=None, splits=(), inplace=False,
            fused_max_len=FUSED_MAX_LEN):
        """Conv + gated delta scan over scan inputs.

        qkv [B, L, conv_dim], ab [B, L, 2·Hv] -> (o [B, L, Hv, Dv], conv_tail, state, boundary)
        where boundary[i] = (tail, state) after `splits[i]` tokens. `inplace` lets the scan advance
        `state` in place (the live cache state, handed straight back to the cache);
        `fused_max_len` as in `gated_delta_net_scan`.
        """
        b, length, _ = qkv.shape
        conv_w = self.conv1d.weight.squeeze(1)
        x, tail, tails = causal_conv1d(
            qkv, conv_w, None, conv_tail, activation="silu", query_lens=query_lens, splits=splits
        )
        o, state, states = gated_delta_net_scan(
            x, ab, self.A_log, self.dt_bias, state, k_heads=self.k_heads, k_dim=self.k_dim,
            v_heads=self.v_heads, v_dim=self.v_dim, query_lens=query_lens, splits=splits, inplace=inplace,
            fused_max_len=fused_max_len,
        )
        return o, tail, state, list(zip(tails, states, strict=True))

    @torch.no_grad()
    def replay(self, conv_tail, state, qkv, ab):
        # The fused scan at any length: replay is not compared against transformers' rounding.
        _, tail, state, _ = self.mix(qkv, ab, conv_tail, state, inplace=True, fused_max_len=None)
        return tail, state

    def forward(self, x: torch.Tensor, batch: Batch, cache: RecurrentCache) -> torch.Tensor:
        mask = batch.token_mask()
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        if self.in_proj is not None:
            qkv, z, a, b_ = self.in_proj(x)
        else:
            qkv, z, a, b_ = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_a(x), self.in_proj_b(x)
        return self.out_proj(self.scan_projected(qkv, z, a, b_, batch, cache, self.norm))

    def scan_projected(self, qkv, z, a, b, batch: Batch, cache: RecurrentCache, norm, scan=None):
        """The layer between its projections: qkv [B, L, conv_dim], z [B, L, value_dim], a / b
        [B, L, Hv] -> the gated norm's output [B, L, value_dim], ready for out_proj; the cache takes
        the new state. `norm` is the gated norm to apply and `scan` what runs `self.scan` of a plain
        batch (the layer's, or what a decode plan runs for them)."""
        batch_size, length, _ = qkv.shape
        ab = torch.cat([a, b], dim=-1)
        packed = partial(self.scan_packed, batch, cache)
        o = per_segment(batch, cache, scan or self.scan, qkv, ab, packed=packed)
        z = z.view(batch_size, length, self.v_heads, self.v_dim)
        o = norm(o.to(qkv.dtype), z)
        return o.reshape(batch_size, length, self.value_dim)

    def scan(self, batch: Batch, cache: RecurrentCache, qkv, ab) -> torch.Tensor:
        """Conv + scan of this forward's scan inputs from `cache`'s state -> o [B, L, Hv, Dv]; the
        cache takes the new state, its captures and (while recording) the inputs."""
        return self.scan_history(batch, cache, cache.get(batch), qkv, ab)

    def scan_history(self, batch: Batch, cache: RecurrentCache, hist, qkv, ab) -> torch.Tensor:
        """`scan` from `hist`, what `cache.get(batch)` returned for this forward."""
        lens = batch.query_lens if batch.padded else None
        o, tail, state, boundary = self.mix(
            qkv, ab, hist.conv_tail, hist.state, lens, hist.splits, inplace=True
        )
        cache.put(
            batch,
            tail,
            state,
            boundary,
            inputs=qkv if hist.record else None,
            gates=ab if hist.record else None,
        )
        return o

    def scan_packed(self, batch: Packed, caches: list[RecurrentCache], few: list[int], qkv, ab):
        """Segments `few` of a packed batch (qkv [1, T, conv_dim], ab [1, T, 2·Hv]) in one conv call and
        one scan call, each segment from and into its own cache's conv tail and state (advanced in
        place) -> o [1, T, Hv, Dv] with their rows set (`scan_segments`)."""

        def kernels(hists, starts, lens):
            splits = [h.splits for h in hists]
            conv_w = self.conv1d.weight.squeeze(1)
            conv = causal_conv1d_packed(
                qkv, conv_w, None, [h.conv_tail for h in hists], starts, lens, splits, activation="silu"
            )
            return conv, conv and gated_delta_net_scan_packed(
                conv[0], ab, self.A_log, self.dt_bias, [h.state for h in hists], starts, lens, splits,
                k_heads=self.k_heads, k_dim=self.k_dim, v_heads=self.v_heads, v_dim=self.v_dim,
            )

        empty = lambda: qkv.new_empty(1, qkv.shape[1], self.v_heads, self.v_dim)
        return scan_segments(batch, caches, few, qkv, ab, kernels, self.scan_history, empty)


class DecoderLayer(nn.Module):
    """Pre-norm block: h + mixer(norm(h)), then h + mlp(norm(h)). `mixer_name` is the checkpoint's
    attribute name for the token mixer (self_attn, linear_attn, conv...)."""

    def __init__(
        self,
        mixer_name: str,
        mixer: nn.Module,
        mlp: nn.Module,
        norm: type[nn.Module],
        hidden: int,
        eps: float,
    ):
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = norm(hidden, eps=eps)
        self.post_attention_layernorm = norm(hidden, eps=eps)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def make_cache(self, batch_size: int, dtype, device):
        return self.mixer.make_cache(batch_size, dtype, device)

    def forward(self, h: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        return self.run(self._modules, h, batch, cache)

    def run(self, parts: Mapping[str, Callable], h: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        """The block over `parts`, by the names of its children: the modules themselves (`forward`), or
        what a decode plan runs in their place (`models.decode`)."""
        h = h + parts[self.mixer_name](parts["input_layernorm"](h), batch, cache)
        return h + parts["mlp"](parts["post_attention_layernorm"](h))
