"""The float64 oracle of the delta-rule tests (Gated DeltaNet and KDA): the recurrence token by token,
written from its definition and sharing nothing with `ops.gated_delta` / `ops.kda`."""

from __future__ import annotations

import torch


def reference(q, k, v, g, beta, state, scale=None):
    """The recurrence token by token in float64: (o [B, L, H, Dv], final state [B, H, Dk, Dv]).
    ``g`` is ``[B, L, H]`` (one log decay per head, Gated DeltaNet) or ``[B, L, H, Dk]`` (one per key
    channel, KDA)."""
    q, k, v, g, beta, S = (x.double() for x in (q, k, v, g, beta, state))
    if g.dim() == 3:
        g = g[..., None]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(*v.shape, dtype=torch.float64)
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]
        kv = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S
