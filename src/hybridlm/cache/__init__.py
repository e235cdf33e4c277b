"""Per-layer caches behind one snapshot / restore / split / merge contract."""

from hybridlm.cache.base import LayerCache, Snapshot
from hybridlm.cache.kv import AttentionHistory, KVCache, RowsSnapshot, SlidingKVCache
from hybridlm.cache.latent import LatentCache
from hybridlm.cache.recurrent import ConvCache, Mamba2Cache, RecurrentCache, RecurrentHistory, ScanSnapshot

__all__ = [
    "AttentionHistory",
    "ConvCache",
    "KVCache",
    "LatentCache",
    "LayerCache",
    "Mamba2Cache",
    "RecurrentCache",
    "RecurrentHistory",
    "RowsSnapshot",
    "ScanSnapshot",
    "SlidingKVCache",
    "Snapshot",
]
