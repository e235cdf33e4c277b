"""The Mamba-2 token mixer shared by the Mamba-2 hybrids (`bamba`, and the families built on it),
and how the families that use Bamba's ``mamba_*`` config keys build it.

in_proj -> z ‖ xBC ‖ dt; causal depthwise conv + SiLU over xBC; the SSD state update
(`ops.mamba2`); a gated RMSNorm per group of channels; out_proj. Attribute names follow the Hugging
Face checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`).

Which form of the state update runs. Every state a restore can land on goes through the step
recurrence: a forward that records scan inputs (the prefix cache's range snapshots) or must report
split states (captures, speculative restore points) runs the step form (the C kernel where it
applies, else torch), as decode steps, verify passes and replays do, so a replay rebuilds bit for
bit the state the forward had at that token (tests/models/test_mamba2.py). Where the C kernel
applies (the CPU) every forward takes it, being faster than the chunked form there; elsewhere a
long prompt whose states nobody asked for takes the chunked form (matrix products), whose final
state is then the checkpoint replays start from.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from hybridlm.batch import Batch, Packed
from hybridlm.cache import Mamba2Cache
from hybridlm.models.config import Config
from hybridlm.models.layers import per_segment, scan_segments
from hybridlm.ops.conv import causal_conv1d, causal_conv1d_packed
from hybridlm.ops.linear import Linear
from hybridlm.ops.mamba2 import (
    DEFAULT_CHUNK,
    grouped_gated_norm,
    mamba2_scan,
    mamba2_step_fused,
    mamba2_step_packed,
)
from hybridlm.ops.native import FEW_TOKENS


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm over each of `groups` equal slices of the channels, gated by silu(z): after the gate
    (`x·silu(z)` normalised: Bamba, Granite, Nemotron-H) or before it (Falcon-H1's default), in float32;
    the weight multiplies the float32 result, which is cast to `dtype` once."""

    def __init__(self, dim: int, groups: int, eps: float, norm_before_gate: bool = False):
        super().__init__()
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x, z ``[B, L, dim]`` -> ``[B, L, dim]`` in ``dtype`` (`ops.mamba2.grouped_gated_norm`)."""
        return grouped_gated_norm(x, z, self.weight, self.groups, self.eps, self.norm_before_gate, dtype)


class Mamba2Mixer(nn.Module):
    """Mamba-2 token mixer.

    Scan inputs (what `Mamba2Cache` logs for replay): the pre-conv xBC rows [B, L, conv_dim] and the
    raw time steps dt [B, L, H]; everything after them is `mix`.

    Args:
        hidden: model width; heads, head_dim: H and P (``inner = H·P``); groups, state_size: G and N
        of the grouped B / C; kernel: conv taps; dt_limit: Δ's clamp (``time_step_limit``);
        conv_bias / proj_bias: the conv's and projections' biases; norm_before_gate: see
        `GroupedGatedRMSNorm`.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        head_dim: int,
        groups: int,
        state_size: int,
        kernel: int,
        *,
        eps: float,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        conv_bias: bool = True,
        proj_bias: bool = False,
        norm_before_gate: bool = False,
        norm_groups: int | None = None,
    ):
        super().__init__()
        self.heads, self.head_dim, self.groups, self.state_size = heads, head_dim, groups, state_size
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state_size
        self.kernel = kernel
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GroupedGatedRMSNorm(self.inner, norm_groups or groups, eps, norm_before_gate)
        self.out_proj = Linear(self.inner, hidden, bias=proj_bias)

    def make_cache(self, batch_size: int, dtype, device) -> Mamba2Cache:
        return Mamba2Cache(
            batch_size, self.conv_dim, self.kernel, self.heads, self.head_dim, self.state_size,
            self.replay, dtype, device,
        )

    def mix(self, xbc, dt, conv_tail, state, query_lens=None, splits=(), inplace=False, step=True):
        """Conv + state update over scan inputs.

        xbc [B, L, conv_dim], dt [B, L, H] -> (y [B, L, H, P] float32, conv_tail, state, boundary)
        where boundary[i] = (tail, state) after `splits[i]` tokens; `step` picks the step form (else
        the chunked one).
        """
        b, length, _ = xbc.shape
        conv, tail, tails = causal_conv1d(
            xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_tail, activation="silu",
            query_lens=query_lens, splits=splits,
        )
        # The C step kernel runs wherever it applies, asked for the step form or not: on the CPU it
        # beats the chunked form's matrix products (a Nemotron-H-8B-shaped layer on 2 AVX2 cores, 64 and
        # 512 tokens: 39 against 85-240 µs a token), so only its fallback (torch, other devices)
        # chooses by `step`.
        fused = mamba2_step_fused(
            conv, dt, -self.A_log.float().exp(), self.D, state, dt_bias=self.dt_bias, heads=self.heads,
            head_dim=self.head_dim, groups=self.groups, state_size=self.state_size, dt_limit=self.dt_limit,
            query_lens=query_lens, splits=splits, inplace=inplace,
        )
        if fused is not None:
            y, state, states = fused
            return y, tail, state, list(zip(tails, states, strict=True))
        gn = self.groups * self.state_size
        x, B, C = conv.split([self.inner, gn, gn], dim=-1)
        y, state, states = mamba2_scan(
            x.reshape(b, length, self.heads, self.head_dim),
            dt,
            -self.A_log.float().exp(),
            B.reshape(b, length, self.groups, self.state_size),
            C.reshape(b, length, self.groups, self.state_size),
            self.D,
            state,
            dt_bias=self.dt_bias,
            dt_limit=self.dt_limit,
            query_lens=query_lens,
            splits=splits,
            chunk_size=1 if step else DEFAULT_CHUNK,
            inplace=inplace,
        )
        return y, tail, state, list(zip(tails, states, strict=True))

    @torch.no_grad()
    def replay(self, conv_tail, state, xbc, dt):
        _, tail, state, _ = self.mix(xbc, dt, conv_tail, state, inplace=True)
        return tail, state

    def forward(self, x: torch.Tensor, batch: Batch, cache: Mamba2Cache) -> torch.Tensor:
        """x [B, L, hidden] -> [B, L, hidden]; advances `cache` by the batch's real tokens."""
        mask = batch.token_mask()
        if mask is not None:
            x = x * mask[..., None].to(x.dtype)
        return self.out_proj(self.mixed(self.project(x), batch, cache, x.dtype))

    def mixed(self, projected: torch.Tensor, batch: Batch, cache: Mamba2Cache, dtype) -> torch.Tensor:
        """z ‖ xBC ‖ dt [B, L, inner + conv_dim + H] -> the gated scan output [B, L, inner] in `dtype`;
        advances `cache`."""
        z, xbc, dt = projected.split([self.inner, self.conv_dim, self.heads], dim=-1)
        y = per_segment(batch, cache, self.scan, xbc, dt, packed=partial(self.scan_packed, batch, cache))
        b, length, _ = projected.shape
        return self.gate(y.reshape(b, length, self.inner), z, dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, hidden] -> z ‖ xBC ‖ dt [B, L, inner + conv_dim + H]."""
        return self.in_proj(x)

    def gate(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The scan output y [B, L, inner] (float32) gated by z -> [B, L, inner] in `dtype`."""
        return self.norm(y, z, dtype)

    def scan(self, batch: Batch, cache: Mamba2Cache, xbc, dt) -> torch.Tensor:
        """Conv + state update of this forward's scan inputs from `cache`'s state -> y [B, L, H, P]
        float32; the cache takes the new state, its captures and (while recording) the inputs."""
        return self.scan_history(batch, cache, cache.get(batch), xbc, dt)

    def scan_history(self, batch: Batch, cache: Mamba2Cache, hist, xbc, dt) -> torch.Tensor:
        """`scan` from `hist`, what `cache.get(batch)` returned for this forward."""
        lens = batch.query_lens if batch.padded else None
        length = xbc.shape[1]
        step = length <= FEW_TOKENS or hist.record or bool(hist.splits)
        y, tail, state, boundary = self.mix(
            xbc, dt, hist.conv_tail, hist.state, lens, hist.splits, inplace=True, step=step
        )
        cache.put(
            batch, tail, state, boundary,
            inputs=xbc if hist.record else None,
            gates=dt if hist.record else None,
        )
        return y

    def scan_packed(
        self, batch: Packed, caches: list[Mamba2Cache], few: list[int], xbc, dt, constants=None
    ) -> torch.Tensor:
        """Segments `few` of a packed batch (xbc [1, T, conv_dim], dt [1, T, H]) in one conv call and
        one step-kernel call, each segment from and into its own cache's conv tail and state (advanced
        in place) -> y [1, T, H, P] float32 with their rows set (`scan_segments`). `constants`: A =
        -exp(A_log), dt_bias and D in float32 where the caller holds them (a decode plan), else
        computed here."""
        if constants is None:
            constants = -self.A_log.float().exp(), self.dt_bias, self.D
        a, dt_bias, d = constants

        def kernels(hists, starts, lens):
            splits = [h.splits for h in hists]
            conv = causal_conv1d_packed(
                xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, [h.conv_tail for h in hists], starts,
                lens, splits, activation="silu",
            )
            return conv, conv and mamba2_step_packed(
                conv[0], dt, a, d, [h.state for h in hists], starts, lens, splits,
                dt_bias=dt_bias, heads=self.heads, head_dim=self.head_dim, groups=self.groups,
                state_size=self.state_size, dt_limit=self.dt_limit,
            )

        empty = lambda: xbc.new_empty(1, xbc.shape[1], self.heads, self.head_dim, dtype=torch.float32)
        return scan_segments(batch, caches, few, xbc, dt, kernels, self.scan_history, empty)


def time_step_limit(c: Config) -> tuple[float, float]:
    """Δ's clamp; absent or null in the config means none. transformers 5 writes a non-finite bound
    as ``{"__float__": "Infinity"}`` (JSON has no infinity), older configs as the literal ``Infinity``."""
    limit = c.get("time_step_limit") or (0.0, math.inf)
    return tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in limit)


def mamba_head_dim(c: Config, inner: int) -> int:
    """`mamba_d_head`; "auto" or absent means the `inner` channels split evenly over the heads."""
    head = c.get("mamba_d_head", "auto")
    return inner // c.mamba_n_heads if head in (None, "auto") else head


def mamba2_mixer(c: Config) -> Mamba2Mixer:
    """The Mamba-2 mixer of a Bamba or Granite 4.0-H layer, from the config's ``mamba_*`` keys."""
    d = c.hidden_size
    return Mamba2Mixer(
        d, c.mamba_n_heads, mamba_head_dim(c, int(c.mamba_expand * d)), c.mamba_n_groups, c.mamba_d_state,
        c.mamba_d_conv, eps=c.rms_norm_eps, dt_limit=time_step_limit(c),
        conv_bias=c.get("mamba_conv_bias", True), proj_bias=c.get("mamba_proj_bias", False),
    )
