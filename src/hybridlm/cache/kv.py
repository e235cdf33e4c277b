"""Attention caches: `KVCache` (full attention) and `SlidingKVCache` (sliding-window attention).

Both keep keys/values in one buffer `[B, H, capacity, D]` whose row i holds absolute position
`start_pos + i`. The full cache never trims (`start_pos` stays 0); the sliding cache drops rows
that no future query can see when it needs room, so it holds at most `window - 1 + L + step`
rows. Snapshots are rows too, and start *lazy*: they name a range of the live buffer and own no
bytes until a write (or a trim) is about to destroy that range, when they copy it out.

Copy-on-write: caches forked from one sequence (`share`, `attach`) read the rows before a split
point from one read-only `SharedRows` buffer and hold their own rows after it (the buffer then
starts at `start_pos` = the split). The split is the fork offset rounded down to the attention
kernel's key block, a function of the forked sequence alone. A write below the split detaches
(the cache copies the shared rows into a buffer of its own first).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache, Snapshot, tensor_bytes
from hybridlm.ops.attention import KEY_BLOCK


class AttentionHistory(NamedTuple):
    """What an attention layer sees: keys/values [B, H, T, D] at absolute positions
    [key_start, key_start + T), and the window its mask must enforce (None: causal only). With a
    `prefix` (keys, values) [B, H, P, D] (a shared read-only buffer's rows), the prefix holds
    [key_start, key_start + P) and keys/values the positions after it."""

    keys: torch.Tensor
    values: torch.Tensor
    key_start: int
    window: int | None
    prefix: tuple[torch.Tensor, torch.Tensor] | None = None

    def after(self, start: int) -> AttentionHistory:
        """The history without the positions before `start` (no copy)."""
        cut = start - self.key_start
        if cut <= 0:
            return self
        if self.prefix is None or cut >= self.prefix[0].shape[2]:
            own = cut - (0 if self.prefix is None else self.prefix[0].shape[2])
            return AttentionHistory(self.keys[:, :, own:], self.values[:, :, own:], start, self.window)
        prefix = (self.prefix[0][:, :, cut:], self.prefix[1][:, :, cut:])
        return AttentionHistory(self.keys, self.values, start, self.window, prefix)


class SharedRows:
    """Read-only key/value rows of positions [start, end), shared by the caches forked from one
    sequence (`KVCache.share`); `holders` counts the caches reading them. Nothing writes to `k`, `v`
    once shared: a cache that must change a row below `end` copies them first (`KVCache._detach`)."""

    def __init__(self, start: int, k: torch.Tensor, v: torch.Tensor):
        self.start, self.end = start, start + k.shape[2]
        self.k, self.v = k, v
        self.holders = 0

    @property
    def nbytes(self) -> int:
        """Bytes kept alive: the whole buffers `k`, `v` view (the frozen buffer of the sequence that
        shared them, its growth slack included)."""
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()


class RowsSnapshot(Snapshot):
    """Key/value rows of `[rows_start, end)` for a snapshot covering `[start, end)`.

    `rows_start > start` only for sliding snapshots compacted to the rows the window needs.
    While `owner` is set the rows live in the owner's buffer (lazy, 0 bytes owned).
    """

    def __init__(self, start: int, end: int, rows_start: int, window: int | None, owner=None, k=None, v=None):
        self.start, self.end, self.rows_start, self.window = start, end, rows_start, window
        self.owner: KVCache | None = owner
        self.k, self.v = k, v

    kind = "rows"

    def to_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a store needs to rebuild this snapshot: JSON-able fields (kind, start, end, rows_start,
        window) and tensors {"k", "v"}, the rows of `[rows_start, end)` as [B, H, end - rows_start, D].
        A lazy snapshot's rows are copied out of the live buffer (compact clones, unaccounted and
        transient); the snapshot itself is left as it was."""
        self._check_open()
        k, v = self.rows(self.rows_start, self.end)
        if self.lazy:
            k, v = k.clone(), v.clone()
        fields = {
            "kind": self.kind,
            "start": self.start,
            "end": self.end,
            "rows_start": self.rows_start,
            "window": self.window,
        }
        return fields, {"k": k, "v": v}

    @classmethod
    def from_state(cls, fields: dict, tensors: dict[str, torch.Tensor]) -> RowsSnapshot:
        """The inverse of `to_state` (takes ownership of the tensors)."""
        return cls(
            fields["start"],
            fields["end"],
            fields["rows_start"],
            fields["window"],
            k=tensors["k"],
            v=tensors["v"],
        )

    @property
    def lazy(self) -> bool:
        return self.owner is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.lazy else tensor_bytes(self.k, self.v)

    def window_low(self, target: int) -> int:
        """First position a query at `target` can see."""
        return 0 if self.window is None else max(0, target - self.window + 1)

    def reaches(self, target: int) -> bool:
        if not self.start <= target <= self.end:
            return False
        return self.rows_start == self.start or self.window_low(target) >= self.rows_start

    def standalone(self, target: int) -> bool:
        return self.reaches(target) and self.window_low(target) >= self.rows_start

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of positions [lo, hi) (views; callers copy)."""
        if self.lazy:
            return self.owner.rows(lo, hi)
        return self.k[:, :, lo - self.rows_start : hi - self.rows_start], self.v[
            :, :, lo - self.rows_start : hi - self.rows_start
        ]

    def materialize(self) -> None:
        """Copy the rows out of the owner's buffer."""
        if not self.lazy:
            return
        k, v = self.owner.rows(self.rows_start, self.end)
        self.owner._lazy.remove(self)
        self.k, self.v, self.owner = k.clone(), v.clone(), None
        if self.on_grow is not None:
            self.on_grow(self.nbytes)

    def _release(self) -> None:
        if self.lazy:
            self.owner._lazy.remove(self)
            self.owner = None
        self.k = self.v = None


def held_bytes(caches) -> int:
    """Bytes the caches keep alive, each shared buffer counted once (None entries count 0)."""
    held = [c.shared for c in caches if getattr(c, "shared", None) is not None]
    shared = {s.k.untyped_storage().data_ptr(): s.nbytes for s in held}  # a re-share views the same buffer
    return sum(c.nbytes for c in caches if c is not None) + sum(shared.values())


class KVCache(LayerCache):
    """Append-only keys/values of a full-attention layer; capacity grows in steps of `step` rows."""

    window: int | None = None

    def __init__(self, batch_size: int = 1, step: int = 256):
        super().__init__(batch_size)
        self.step = step
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.start_pos = 0
        self.valid_from = 0
        self._lazy: list[RowsSnapshot] = []
        self.shared: SharedRows | None = None  # rows before `start_pos`, read-only (copy-on-write)

    # ---- storage -------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of this cache's own buffer (the shared rows it reads are its holders' together:
        `held_bytes` counts each shared buffer once)."""
        return tensor_bytes(self.k, self.v)

    @property
    def first_held(self) -> int:
        """The first position whose row the cache holds (shared or own)."""
        return self.start_pos if self.shared is None else self.shared.start

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of positions [lo, hi): views, or a concatenation (a copy) when they span the split."""
        if self.shared is not None and lo < self.start_pos and lo < hi:
            shared = self.shared
            if lo < shared.start:
                raise IndexError(f"rows [{lo}, {hi}) are not held (shared rows start at {shared.start})")
            i, j = lo - shared.start, hi - shared.start
            sk, sv = shared.k[:, :, i:j], shared.v[:, :, i:j]
            if hi <= self.start_pos:
                return sk, sv
            ok, ov = self.rows(self.start_pos, hi)
            return torch.cat([sk, ok], dim=2), torch.cat([sv, ov], dim=2)
        if lo >= hi and self.k is None and self.shared is not None:  # no rows, no own buffer
            return self.shared.k[:, :, :0], self.shared.v[:, :, :0]
        i, j = lo - self.start_pos, hi - self.start_pos
        if lo >= hi and self.k is not None:  # no rows: wherever they would be
            i = j = 0
        if i < 0 or j > self.capacity:
            raise IndexError(f"rows [{lo}, {hi}) are not held (buffer holds from {self.start_pos})")
        return self.k[:, :, i:j], self.v[:, :, i:j]

    # ---- copy-on-write ---------------------------------------------------------------------
    def share(self, block: int = KEY_BLOCK) -> SharedRows | None:
        """Make the rows before `offset` rounded down to `block` a read-only `SharedRows` that forks
        of this cache `attach` to (this cache reads them from there too), or None when there are
        none to share. The rows become shared without a copy: the current buffer is frozen (only the
        shared views keep it) and this cache continues in a new buffer holding the rows after the
        split (fewer than `block` rows are copied)."""
        end = self.offset
        split = end // block * block
        if self.shared is not None and self.shared.end == split:
            return self.shared
        first = max(self.first_held, self.valid_from)
        if split <= first:
            return None
        keep_hi = max([end, *(s.end for s in self._lazy)])  # lazy snapshots may name rows past `end`
        k, v = self.rows(first, split)
        shared = SharedRows(first, k, v)
        tail_k, tail_v = self.rows(split, min(keep_hi, self.start_pos + self.capacity))
        self._release_shared()
        self._attach_shared(shared)
        self._own_rows(split, tail_k.clone(), tail_v.clone())
        return shared

    def attach(self, shared: SharedRows, source: KVCache) -> None:
        """Become a fork of `source` (which `share`d `shared`): read the shared rows, copy the
        source's own rows up to its offset; this cache's previous state is dropped."""
        self.free()
        self._attach_shared(shared)
        self.valid_from = source.valid_from
        end = source.offset
        self._own_rows(shared.end, *source.rows(shared.end, end))
        self.offsets = [end] * self.batch_size
        self._clear_schedule_after_restore()

    def _attach_shared(self, shared: SharedRows) -> None:
        shared.holders += 1
        self.shared = shared

    def _release_shared(self) -> None:
        if self.shared is not None:
            self.shared.holders -= 1
            self.shared = None

    def _detach(self) -> None:
        """Copy the shared rows into a buffer of this cache's own (before a write below the split)."""
        lo = self.shared.start
        hi = max([self.offset, self.start_pos, *(s.end for s in self._lazy)])
        hi = min(hi, self.start_pos + self.capacity) if self.k is not None else self.start_pos
        k, v = self.rows(lo, hi)
        k, v = k.clone(), v.clone()
        self._release_shared()
        self._own_rows(lo, k, v)

    def _own_rows(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the own buffer by one holding `k`, `v` [B, H, n, D] as the rows of positions
        [start, start + n) (no buffer when n = 0). `k`, `v` must not view the old buffer."""
        self.k = self.v = None
        self.start_pos = start
        n = k.shape[2]
        if n:
            self._ensure(start + n, k, v)
            self.k[:, :, :n] = k
            self.v[:, :, :n] = v

    def _copy_out_lazy(self, lo: int, hi: int) -> None:
        """Lazy snapshots whose rows intersect [lo, hi) copy out before those rows change."""
        for snap in [s for s in self._lazy if max(s.rows_start, lo) < min(s.end, hi)]:
            snap.materialize()

    def _make_room(self, lo: int, hi: int) -> None:
        """Make buffer rows for positions [lo, hi) writable."""

    def _ensure(self, hi: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        need = hi - self.start_pos
        if need <= self.capacity:
            return
        cap = -(-need // self.step) * self.step
        b, h = like_k.shape[:2]
        k = torch.zeros(b, h, cap, like_k.shape[3], dtype=like_k.dtype, device=like_k.device)
        v = torch.zeros(b, h, cap, like_v.shape[3], dtype=like_v.dtype, device=like_v.device)
        if self.k is not None:
            k[:, :, : self.capacity] = self.k
            v[:, :, : self.capacity] = self.v
        self.k, self.v = k, v

    def _write(self, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rows [lo, lo + n) for every row of the batch."""
        hi = lo + k.shape[2]
        if self.shared is not None and lo < self.start_pos:
            self._detach()
        self._make_room(lo, hi)
        self._copy_out_lazy(lo, hi)
        self._ensure(hi, k, v)
        i = lo - self.start_pos
        self.k[:, :, i : i + k.shape[2]] = k
        self.v[:, :, i : i + k.shape[2]] = v

    # ---- the model-facing view -----------------------------------------------------------
    def update(self, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> AttentionHistory:
        """Store k, v [B, H, L, D] at each row's offset; return the history the layer attends over."""
        length = k.shape[2]
        self._forward_begins(max(batch.query_lens))
        old = self.offsets
        if len(set(old)) == 1:
            self._write(old[0], k, v)
        else:
            lo = min(old)
            if self.shared is not None and lo < self.start_pos:
                self._detach()
            self._make_room(lo, max(old) + length)
            self._copy_out_lazy(lo, max(old) + length)
            self._ensure(max(old) + length, k, v)
            for b, o in enumerate(old):
                i = o - self.start_pos
                self.k[b, :, i : i + length] = k[b]
                self.v[b, :, i : i + length] = v[b]
        self.offsets = [o + n for o, n in zip(old, batch.query_lens, strict=True)]
        if self._scheduled:
            self._capture(old[0], self.offset)
        hi = max(old) + length
        first = self.first_held
        lo = first if self.window is None else max(first, min(old) - self.window + 1)
        spanned = self._scheduled and self._capture_from < self.start_pos  # by a range capture to come
        if self.shared is not None and self.window is not None and lo >= self.start_pos and not spanned:
            self._drop_shared()  # no query reads the shared rows any more
        if lo < self.start_pos:  # the kernel walks the shared rows then the own rows as one buffer
            shared = self.shared
            prefix = (shared.k[:, :, lo - shared.start :], shared.v[:, :, lo - shared.start :])
            keys, values = self.rows(self.start_pos, hi)
            return AttentionHistory(keys, values, lo, self.window, prefix)
        keys, values = self.rows(lo, hi)
        return AttentionHistory(keys, values, lo, self.window)

    def _drop_shared(self) -> None:
        """Stop reading the shared rows (lazy snapshots naming them copy out first)."""
        self._copy_out_lazy(self.shared.start, self.shared.end)
        self._release_shared()

    def _capture(self, old: int, new: int) -> None:
        for o in self._crossed(old, new):
            start = self._capture_from
            self._keep_capture(self._lazy_snapshot(start, o))
            self._capture_from = o

    def _lazy_snapshot(self, start: int, end: int) -> RowsSnapshot:
        # Rows before `valid_from` are not on this path (a restore from a snapshot alone): never name them.
        rows_start = min(end, max(start, self.first_held, self.valid_from))
        snap = RowsSnapshot(start, end, rows_start, self.window, owner=self)
        self._lazy.append(snap)
        return snap

    # ---- snapshot contract ---------------------------------------------------------------
    def snapshot(self, start: int) -> RowsSnapshot:
        end = self.offset
        if not 0 <= start <= end:
            raise ValueError(f"snapshot start {start} outside [0, {end}]")
        return self._lazy_snapshot(start, end)

    def _holds(self, lo: int, hi: int) -> bool:
        """True when the live buffer holds valid rows for positions [lo, hi)."""
        return hi <= self.offset and (lo >= hi or lo >= max(self.first_held, self.valid_from))

    def can_rewind(self, target: int) -> bool:
        low = 0 if self.window is None else max(0, target - self.window + 1)
        return 0 <= target <= self.offset and self._holds(low, target)

    def restore(self, snap: RowsSnapshot | None, target: int) -> bool:
        if snap is None:
            if not self.can_rewind(target):
                return False
            # (an empty window lets a rewind reach below valid_from: what follows is written anew)
            self.valid_from = min(self.valid_from, target)
            self.offsets = [target] * self.batch_size
            self._clear_schedule_after_restore()
            return True
        snap._check_open()
        if not snap.reaches(target):
            return False
        low = snap.window_low(target)
        from_cache_hi = min(snap.rows_start, target)
        if low < from_cache_hi and not (self.offset >= snap.start and self._holds(low, from_cache_hi)):
            return False
        if snap.owner is not self:
            copy_lo = max(low, snap.rows_start)
            if copy_lo < target:
                k, v = snap.rows(copy_lo, target)
                self._write(copy_lo, k.clone() if snap.lazy else k, v.clone() if snap.lazy else v)
        if low >= from_cache_hi:
            # The snapshot alone supplied the window: rows before it are not on this path.
            self.valid_from = max(low, snap.rows_start)
        self.offsets = [target] * self.batch_size
        self._clear_schedule_after_restore()
        return True

    def split(self, snap: RowsSnapshot, at: int) -> tuple[RowsSnapshot, RowsSnapshot]:
        snap._check_open()
        if not snap.start <= at <= snap.end:
            raise ValueError(f"split point {at} outside [{snap.start}, {snap.end}]")
        if snap.lazy:
            owner = snap.owner
            left = RowsSnapshot(snap.start, at, min(snap.rows_start, at), snap.window, owner=owner)
            right = RowsSnapshot(at, snap.end, max(snap.rows_start, at), snap.window, owner=owner)
            owner._lazy.extend([left, right])
        else:
            cut = max(0, at - snap.rows_start)
            left = RowsSnapshot(
                snap.start,
                at,
                min(snap.rows_start, at),
                snap.window,
                k=snap.k[:, :, :cut].clone(),
                v=snap.v[:, :, :cut].clone(),
            )
            right = RowsSnapshot(
                at,
                snap.end,
                max(snap.rows_start, at),
                snap.window,
                k=snap.k[:, :, cut:].clone(),
                v=snap.v[:, :, cut:].clone(),
            )
        left.on_grow = right.on_grow = snap.on_grow
        snap.free()
        return left, right

    def merge(self, parent: RowsSnapshot, child: RowsSnapshot) -> RowsSnapshot:
        parent._check_open()
        child._check_open()
        if parent.end != child.start:
            raise ValueError(f"cannot merge [{parent.start}, {parent.end}) with [{child.start}, {child.end})")
        if child.rows_start > child.start or parent.rows_start == parent.end:
            # The child was compacted (or the parent holds no rows): the parent's rows add nothing.
            parent.free()
            merged = RowsSnapshot(parent.start, child.end, child.rows_start, child.window)
            merged.owner, merged.k, merged.v = child.owner, child.k, child.v
            if child.lazy:
                child.owner._lazy.append(merged)
        elif parent.lazy and child.lazy and parent.owner is child.owner:
            merged = RowsSnapshot(
                parent.start, child.end, parent.rows_start, parent.window, owner=parent.owner
            )
            parent.owner._lazy.append(merged)
            parent.free()
        else:
            # torch.cat copies: no need to materialize (and report growth of) snapshots being consumed.
            pk, pv = parent.rows(parent.rows_start, parent.end)
            ck, cv = child.rows(child.rows_start, child.end)
            merged = RowsSnapshot(
                parent.start,
                child.end,
                parent.rows_start,
                parent.window,
                k=torch.cat([pk, ck], dim=2),
                v=torch.cat([pv, cv], dim=2),
            )
            parent.free()
        merged.on_grow = parent.on_grow or child.on_grow
        child.free()
        return merged

    def free(self) -> None:
        if self.k is not None or self.shared is not None:  # else lazy snapshots name no rows
            for snap in list(self._lazy):
                snap.materialize()
        self.k = self.v = None
        self._release_shared()
        self.offsets = [0] * self.batch_size
        self.start_pos = self.valid_from = 0


class SlidingKVCache(KVCache):
    """Keys/values of a sliding-window layer: keeps the last `window - 1` rows before the write
    position (plus the rows being written), so memory is bounded by `window - 1 + L + step`."""

    def __init__(self, window: int, batch_size: int = 1, step: int = 256):
        super().__init__(batch_size, step)
        self.window = window

    def compact(self, snap: RowsSnapshot) -> RowsSnapshot:
        """A point checkpoint: keep only the rows the window needs at `snap.end` (restores only
        to `end`); takes ownership of `snap`."""
        keep = max(snap.rows_start, snap.end - self.window + 1)
        if keep == snap.rows_start:
            return snap
        k, v = snap.rows(keep, snap.end)
        out = RowsSnapshot(snap.start, snap.end, keep, self.window, k=k.clone(), v=v.clone())
        out.on_grow = snap.on_grow
        snap.free()
        return out

    def _make_room(self, lo: int, hi: int) -> None:
        if lo < self.start_pos:
            # Writing below the buffer (a restore whose snapshot alone supplies the window, or a rewind
            # whose window is empty) needs none of the held rows: restart the buffer at `lo` (lazy
            # snapshots copy out first).
            self._copy_out_lazy(self.start_pos, self.start_pos + self.capacity)
            self.start_pos = lo
            return
        if hi - self.start_pos <= self.capacity:
            return
        new_start = max(self.start_pos, lo - self.window + 1)
        if self._scheduled:
            # Range captures still to come span [capture_from, o): keep their rows in the buffer.
            new_start = min(new_start, max(self.start_pos, self._capture_from))
        if new_start == self.start_pos:
            return
        self._copy_out_lazy(self.start_pos, new_start)
        keep = max(0, self.start_pos + self.capacity - new_start)
        if keep:
            shift = new_start - self.start_pos
            self.k[:, :, :keep] = self.k[:, :, shift : shift + keep].clone()
            self.v[:, :, :keep] = self.v[:, :, shift : shift + keep].clone()
        self.start_pos = new_start
