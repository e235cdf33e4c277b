"""Attention caches: `KVCache` (full attention) and `SlidingKVCache` (sliding-window attention).

Both keep keys/values in one buffer `[B, H, capacity, D]` whose row i holds absolute position
`start_pos + i`. The full cache never trims (`start_pos` stays 0); the sliding cache drops rows
that no future query can see when it needs room, so it holds at most `window - 1 + L + step`
rows. Snapshots are rows too, and start *lazy*: they name a range of the live buffer and own no
bytes until a write (or a trim) is about to destroy that range, when they copy it out.

Copy-on-write: a cache may read its first rows from an ordered list of read-only `SharedRows`
segments (consecutive positions, the last ending at `start_pos`) and hold its own rows after them.
Segments come from a fork (`share`, `attach`: the rows before the fork offset rounded down to the
attention kernel's key block, a function of the forked sequence alone) and from restoring trie
snapshots (`restore` names a snapshot's rows instead of copying them; a lazy snapshot is frozen
first). A write below `start_pos` cuts the segments there (`_cut`: the rows below stay shared, the
rows from the write on become the cache's own).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache, Snapshot, tensor_bytes
from hybridlm.ops.attention import KEY_BLOCK, KeySegment


class AttentionHistory(NamedTuple):
    """What an attention layer sees: keys/values [B, H, T, D] at absolute positions
    [key_start, key_start + T), and the window its mask must enforce (None: causal only). With
    `prefix` segments ((keys, values) [B, H, P_i, D] each: shared read-only rows, in order), the
    segments hold [key_start, key_start + ΣP_i) and keys/values the positions after them."""

    keys: torch.Tensor
    values: torch.Tensor
    key_start: int
    window: int | None
    prefix: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def after(self, start: int) -> AttentionHistory:
        """The history without the positions before `start` (no copy)."""
        if start <= self.key_start:
            return self
        pos, prefix = self.key_start, []
        for k, v in self.prefix:
            n = k.shape[2]
            if pos + n > start:
                cut = max(0, start - pos)
                prefix.append((k[:, :, cut:], v[:, :, cut:]))
            pos += n
        cut = max(0, start - pos)
        keys, values = self.keys[:, :, cut:], self.values[:, :, cut:]
        return AttentionHistory(keys, values, start, self.window, tuple(prefix))


class SharedRows:
    """Read-only key/value rows of positions [start, end) that several caches read (copy-on-write
    segments): a forked sequence's frozen buffer (`KVCache.share`) or a trie snapshot's rows
    (`source`, restored by `KVCache.restore`). `holders` counts the caches reading them. Nothing
    writes to `k`, `v`: a cache that must change a row below `end` cuts its segments (`KVCache._cut`).
    The tensors stay alive while a holder reads them, whatever happens to `source` (evicted, paged to
    disk, split): only the accounting changes (`held_bytes`)."""

    def __init__(self, start: int, k: torch.Tensor, v: torch.Tensor, source: RowsSnapshot | None = None):
        self.start, self.end = start, start + k.shape[2]
        self.k, self.v = k, v
        self.pair = KeySegment(k, v)  # what attention reads (its kernel fields computed once)
        self.source = source
        self.holders = 0

    @property
    def nbytes(self) -> int:
        """Bytes kept alive: the whole buffers `k`, `v` view (a frozen buffer's growth slack included)."""
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    @property
    def storage(self) -> int:
        """Identity of the buffer viewed (segments cut from one buffer share it)."""
        return self.k.untyped_storage().data_ptr()

    @property
    def in_trie(self) -> bool:
        """Whether a trie snapshot still owns (and the RAM budget counts) these rows' buffer."""
        src = self.source
        return src is not None and not src.closed and src.k is not None and (
            src.k.untyped_storage().data_ptr() == self.storage
        )

    def hold(self) -> SharedRows:
        self.holders += 1
        if self.source is not None:
            self.source.readers += 1
        return self

    def release(self) -> None:
        self.holders -= 1
        if self.source is not None:
            self.source.readers -= 1

    def head(self, end: int) -> SharedRows:
        """The rows before `end` (a view of the same buffer, not yet held)."""
        n = end - self.start
        return SharedRows(self.start, self.k[:, :, :n], self.v[:, :, :n], self.source)


class RowsSnapshot(Snapshot):
    """Key/value rows of `[rows_start, end)` for a snapshot covering `[start, end)`.

    `rows_start > start` only for sliding snapshots compacted to the rows the window needs.
    While `owner` is set the rows live in the owner's buffer (lazy, 0 bytes owned).
    """

    def __init__(self, start: int, end: int, rows_start: int, window: int | None, owner=None, k=None, v=None):
        self.start, self.end, self.rows_start, self.window = start, end, rows_start, window
        self.owner: KVCache | None = owner
        self.k, self.v = k, v
        self.readers = 0  # live caches reading `k`, `v` as a segment (`SharedRows.source`)

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
    """Bytes the caches keep alive, each shared buffer counted once (None entries count 0) and
    segments a trie snapshot owns not at all (the RAM budget counts those)."""
    shared = {}
    for c in caches:
        for seg in getattr(c, "segments", ()):
            if not seg.in_trie:
                shared[seg.storage] = seg.nbytes
    return sum(c.nbytes for c in caches if c is not None) + sum(shared.values())


_END = 1 << 62  # past every position


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
        # Rows before `start_pos`, read-only (copy-on-write): consecutive, the last ending at start_pos.
        self.segments: list[SharedRows] = []
        # Whether `restore` reads a snapshot's rows as a segment instead of copying them (the prefix
        # cache's slots: trie snapshots that several sessions restore).
        self.shares_restores = False

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
        return self.segments[0].start if self.segments else self.start_pos

    def _pieces(self, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of the rows of positions [lo, hi) (lo < hi), one per segment or buffer they span."""
        held_hi = self.start_pos + self.capacity
        if lo < self.first_held or hi > held_hi:
            raise IndexError(f"rows [{lo}, {hi}) are not held (held: [{self.first_held}, {held_hi}))")
        out = []
        for seg in self.segments:
            a, b = max(lo, seg.start) - seg.start, min(hi, seg.end) - seg.start
            if a < b:  # a whole segment (the common case) needs no new view every step
                whole = a == 0 and b == seg.end - seg.start
                out.append(seg.pair if whole else (seg.k[:, :, a:b], seg.v[:, :, a:b]))
        a, b = max(lo, self.start_pos) - self.start_pos, hi - self.start_pos
        if a < b:
            out.append((self.k[:, :, a:b], self.v[:, :, a:b]))
        return out

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of positions [lo, hi): views, or a concatenation (a copy) when they span segments."""
        if lo >= hi:  # no rows: wherever they would be
            if self.k is not None:
                return self.k[:, :, :0], self.v[:, :, :0]
            if self.segments:
                return self.segments[-1].k[:, :, :0], self.segments[-1].v[:, :, :0]
            raise IndexError("no rows are held")
        pieces = self._pieces(lo, hi)
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([k for k, _ in pieces], dim=2), torch.cat([v for _, v in pieces], dim=2)

    # ---- copy-on-write ---------------------------------------------------------------------
    def share(self, block: int = KEY_BLOCK) -> bool:
        """Make the own rows before `offset` rounded down to `block` a read-only segment that forks
        of this cache `attach` to (this cache reads them from there too); False when the cache then
        reads no segments (nothing to share). The rows become shared without a copy: the current
        buffer is frozen (only the segment's views keep it) and this cache continues in a new buffer
        holding the rows after the split (fewer than `block` rows are copied, plus rows lazy snapshots
        name past the offset)."""
        end = self.offset
        split = end // block * block
        lo = max(self.start_pos, self.valid_from)
        if split > lo and self.k is not None:
            self._copy_out_lazy(self.first_held, lo)  # rows below valid_from: not on this path, not kept
            if lo > self.start_pos:
                self._drop_segments(lo)
            keep_hi = max([end, *(s.end for s in self._lazy)])  # lazy snapshots may name rows past `end`
            k, v = self.rows(lo, split)
            tail_k, tail_v = self.rows(split, min(keep_hi, self.start_pos + self.capacity))
            self.segments.append(SharedRows(lo, k, v).hold())
            self._own_rows(split, tail_k.clone(), tail_v.clone())
        return bool(self.segments)

    def attach(self, source: KVCache) -> None:
        """Become a fork of `source` (which `share`d its rows): read its segments, copy its own rows
        up to its offset; this cache's previous state is dropped."""
        self.free()
        self.segments = [seg.hold() for seg in source.segments]
        self.valid_from = source.valid_from
        end = source.offset
        self._own_rows(source.start_pos, *source.rows(source.start_pos, end))
        self.offsets = [end] * self.batch_size
        self._clear_schedule_after_restore()

    def _drop_segments(self, upto: int) -> None:
        """Stop reading the segments that end at or before `upto` (lazy snapshots naming them copy out)."""
        gone = [s for s in self.segments if s.end <= upto]
        if gone:
            self._copy_out_lazy(gone[0].start, gone[-1].end)
            for seg in gone:
                seg.release()
            self.segments = self.segments[len(gone) :]

    def _cut(self, lo: int) -> None:
        """Before a write at `lo` < `start_pos`: the segment rows below `lo` stay shared; the rows from
        `lo` up to the offsets (and those lazy snapshots name) are copied into a new own buffer."""
        held_hi = self.start_pos + self.capacity
        copy_lo = max(lo, self.first_held)  # (a sliding write below every held row restarts the buffer)
        hi = max([copy_lo, *self.offsets, *(s.end for s in self._lazy)])
        k, v = self.rows(copy_lo, min(hi, held_hi))
        k, v = k.clone(), v.clone()
        kept = []
        for seg in self.segments:
            if seg.end <= lo:
                kept.append(seg)
                continue
            seg.release()
            if seg.start < lo:
                kept.append(seg.head(lo).hold())
        self.segments = kept
        self._own_rows(copy_lo, k, v)

    def _adopt(self, snap: RowsSnapshot, lo: int, hi: int, low: int) -> bool:
        """Restore rows [lo, hi) of `snap` (which a query at `hi` reads from `low` on) by reading them
        as a segment, without a copy; False (nothing changed) when the cache's own rows below `lo` are
        needed (then the caller copies). A lazy snapshot is frozen first (its rows copied out of the
        other cache's buffer once, for every reader: the budget counts it at that size already)."""
        if low < lo and self.start_pos < lo:
            return False
        covered = low < lo  # the segments hold [low, lo): keep them up to lo
        self._copy_out_lazy(lo if covered else self.first_held, _END)
        if snap.lazy:
            snap.materialize()
        kept = []
        for seg in self.segments:
            seg.release()
            if covered and seg.start < lo:
                kept.append((seg if seg.end <= lo else seg.head(lo)).hold())
        k, v = snap.rows(lo, hi)
        self.segments = [*kept, SharedRows(lo, k, v, source=snap).hold()]
        self.k = self.v = None
        self.start_pos = hi
        return True

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
        if self.segments and lo < self.start_pos:
            self._cut(lo)
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
            if self.segments and lo < self.start_pos:
                self._cut(lo)
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
        if self.segments and self.window is not None:
            # No query reads the segments below the window (unless a range capture to come spans them).
            self._drop_segments(min(lo, self._capture_from) if self._scheduled else lo)
        # The kernel walks the segments then the own rows as one buffer.
        pieces = self._pieces(lo, hi)
        return AttentionHistory(*pieces[-1], lo, self.window, tuple(pieces[:-1]))

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
            shared = self.shares_restores and copy_lo < target and self._adopt(snap, copy_lo, target, low)
            if copy_lo < target and not shared:
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
        if self.k is not None or self.segments:  # else lazy snapshots name no rows
            for snap in list(self._lazy):
                snap.materialize()
        self.k = self.v = None
        for seg in self.segments:
            seg.release()
        self.segments = []
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
        self._drop_segments(new_start)  # all of them: they end at start_pos, below the window
        self._copy_out_lazy(self.start_pos, new_start)
        keep = max(0, self.start_pos + self.capacity - new_start)
        if keep:
            shift = new_start - self.start_pos
            self.k[:, :, :keep] = self.k[:, :, shift : shift + keep].clone()
            self.v[:, :, :keep] = self.v[:, :, shift : shift + keep].clone()
        self.start_pos = new_start
