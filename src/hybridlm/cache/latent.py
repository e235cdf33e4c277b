"""`LatentCache`: the cache of a multi-head latent attention (MLA) layer.

MLA compresses every token's keys and values into one latent row (`kv_lora_rank` values after the
layer's norm) plus a decoupled key of `qk_rope_head_dim` values shared by all heads (rotated where
the family has rotary positions: Ling; Kimi's MLA has none). Both are rows that do not depend on
later tokens, so the cache is the KV cache itself with one "head": keys [B, 1, T, rank] hold the
latents and values [B, 1, T, rope] the shared key rows. Every part of the KV contract carries over
unchanged: range snapshots restorable at any token, lazy copies, split / merge, copy-on-write
sharing, packing and the disk / store serialization of `RowsSnapshot`. Per token and layer it holds
(rank + rope) values instead of 2 · heads · head_dim: for Kimi-Linear-48B (rank 512, rope 64, bf16)
1152 bytes, against 16 KiB for its 32 heads' expanded keys and values of 128.
"""

from __future__ import annotations

import torch

from hybridlm.batch import Batch
from hybridlm.cache.kv import KVCache


class LatentCache(KVCache):
    """KV cache of an MLA layer: latent rows as keys, shared rotary-key rows as values."""

    def update_latent(
        self, batch: Batch, latent: torch.Tensor, k_rot: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store latent [B, 1, L, rank] and k_rot [B, 1, L, rope] at each row's offset; return every
        held row of both, (latent [B, 1, T, rank], k_rot [B, 1, T, rope]), and the position of the
        first, as the layer attends over them (shared segments joined in a transient copy)."""
        hist = self.update(batch, latent, k_rot)
        if hist.prefix:
            lat = torch.cat([k for k, _ in hist.prefix] + [hist.keys], dim=2)
            rot = torch.cat([v for _, v in hist.prefix] + [hist.values], dim=2)
        else:
            lat, rot = hist.keys, hist.values
        return lat, rot, hist.key_start
