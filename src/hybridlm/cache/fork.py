"""Forking a sequence's caches: the `n > 1` samples of one prompt each continue from the state its
prefill left, sharing its KV rows (copy-on-write) and holding a copy of its recurrent / conv state."""

from __future__ import annotations

from collections.abc import Sequence

from hybridlm.cache.base import LayerCache
from hybridlm.cache.kv import KVCache
from hybridlm.cache.recurrent import ScanCache, ScanSnapshot


def fork_caches(
    caches: Sequence[LayerCache | None], fresh: list[LayerCache | None]
) -> list[LayerCache | None]:
    """Bring `fresh` (empty caches of the same model, e.g. `make_caches(1)`) to the live state of
    `caches`, at the same offsets; `caches` keep their state, captures and input logs. Returns `fresh`.

    KV and sliding layers share the rows before the offset rounded down to the attention kernel's
    key block (`KVCache.share`: read-only for every holder, the source included) and copy the few
    after it; recurrent and conv layers copy their state as a checkpoint (small, and rewritten by the
    first decode step anyway). Decode then computes every row of a fork exactly as it would on the
    original caches.
    """
    for src, dst in zip(caches, fresh, strict=True):
        if src is None:
            continue
        end = src.offset
        if isinstance(src, KVCache) and type(dst) is type(src) and src.share():
            dst.attach(src)
            continue
        if isinstance(src, ScanCache):
            # A checkpoint naming the live tensors (restore copies them): `snapshot` would reset the
            # source's input log, which its prefix-cache session still needs.
            snap = ScanSnapshot(end, end, tail=src.conv_tail, state=src.state)
        else:
            snap = src.snapshot(0)
        try:
            if not dst.restore(snap, end):
                raise RuntimeError(f"{type(src).__name__} could not be forked at offset {end}")
        finally:
            snap.free()
    return fresh
