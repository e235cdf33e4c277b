"""The contract every per-layer cache implements (docs/architecture.md, "Per-layer caches").

A cache holds the state of one stateful layer for B rows. `offset` counts logical tokens held.
Snapshots capture a token range `[start, end)` and can bring a cache back to any offset they
reach (`restore`); `split` and `merge` re-cut them along trie edges. Snapshot operations are
defined for caches whose rows share one offset (B = 1 in practice: sessions are per request).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the given tensors' elements (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Snapshot(ABC):
    """State of one layer over `[start, end)`.

    `nbytes` counts bytes this snapshot owns (a lazy snapshot that still names a range of a live
    buffer owns none). `on_grow(delta)`, when set, is told each time the snapshot starts owning
    more bytes (a lazy snapshot copying out), so an owner can keep its accounting exact.
    """

    start: int
    end: int
    on_grow: Callable[[int], None] | None = None
    closed: bool = False

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    @abstractmethod
    def reaches(self, target: int) -> bool:
        """True when `restore` can bring a cache to `target` from this snapshot alone or from the
        cache sitting at `start` (the trie restores parents first)."""

    @abstractmethod
    def standalone(self, target: int) -> bool:
        """True when `restore(self, target)` yields the right state whatever the cache holds
        (no rows or state before `start` needed)."""

    def free(self) -> None:
        if self.closed:
            raise RuntimeError("snapshot freed twice")
        self.closed = True
        self._release()

    @abstractmethod
    def _release(self) -> None: ...

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("snapshot used after free")


class LayerCache(ABC):
    """Per-layer cache: live state plus capture scheduling.

    Capture scheduling: `prepare_snapshots(offsets)` before one or more forwards; every scheduled
    offset a write crosses yields a snapshot covering `[previous capture or prepare offset, o)`,
    taken inside the forward that crossed it; `take_snapshots()` returns them in order.

    `on_forward(tokens)`, when set, is called as a forward of `tokens` tokens first reaches this
    cache, before it takes any capture: an owner budgeting capture memory makes room there (or
    `unschedule`s captures, or sets `lean`: captures are then taken in their `compact` form) — see
    `capture_ends`.
    """

    def __init__(self, batch_size: int):
        self.offsets = [0] * batch_size
        self._scheduled: list[int] = []
        self._capture_from = 0
        self._captures: list[Snapshot] = []
        self.record = False
        self.on_forward: Callable[[int], None] | None = None
        self.lean = False

    @property
    def batch_size(self) -> int:
        return len(self.offsets)

    @property
    def offset(self) -> int:
        """Tokens held; defined when every row holds the same number."""
        first = self.offsets[0]
        if any(o != first for o in self.offsets):
            raise ValueError(f"rows are at different offsets {self.offsets}")
        return first

    def prepare_snapshots(self, offsets: list[int], ranges: bool = False) -> None:
        """Schedule captures at `offsets` (absolute, > current offset). `ranges` asks for
        range-restorable captures (recurrent layers then record their scan inputs)."""
        now = self.offset
        bad = [o for o in offsets if o <= now]
        if bad:
            raise ValueError(f"capture offsets {bad} are not after the current offset {now}")
        self._scheduled = sorted(set(offsets))
        self._capture_from = now
        self.record = ranges or self.record

    @property
    def capture_start(self) -> int:
        """Where the next capture begins (the previous capture's end, or the prepare offset)."""
        return self._capture_from

    def capture_ends(self, tokens: int) -> list[int]:
        """Scheduled offsets a forward of `tokens` more tokens crosses: each ends a capture, the first
        beginning at `capture_start`, each next one where the one before ended."""
        now = max(self.offsets)
        return [o for o in self._scheduled if now < o <= now + tokens]

    def unschedule(self, offsets: list[int]) -> None:
        """Take no captures at `offsets` (the next capture then spans them)."""
        self._scheduled = [o for o in self._scheduled if o not in offsets]

    def _forward_begins(self, tokens: int) -> None:
        if self.on_forward is not None:
            self.on_forward(tokens)

    def _keep_capture(self, snap: Snapshot) -> None:
        self._captures.append(self.compact(snap) if self.lean else snap)

    def take_snapshots(self) -> list[Snapshot]:
        """Captures made since `prepare_snapshots`, oldest first; clears the schedule."""
        caps, self._captures, self._scheduled = self._captures, [], []
        return caps

    def take_captures(self) -> list[Snapshot]:
        """Captures made since `prepare_snapshots`, oldest first; the schedule goes on."""
        caps, self._captures = self._captures, []
        return caps

    def captures(self) -> tuple[Snapshot, ...]:
        """Captures made since `prepare_snapshots`, not yet taken (their owner counts their bytes)."""
        return tuple(self._captures)

    def compact_captures(self) -> None:
        """Replace the captures not yet taken by their `compact` forms (e.g. to fit a memory budget)."""
        self._captures = [self.compact(s) for s in self._captures]

    def give_back(self, snaps: list[Snapshot]) -> None:
        """Put captures taken with `take_snapshots` back, before any made since, for their owner to
        take: a forward that schedules restore points of its own sets the others aside meanwhile."""
        self._captures[:0] = snaps

    def _crossed(self, old: int, new: int) -> list[int]:
        """Scheduled offsets in (old, new], removed from the schedule."""
        hit = [o for o in self._scheduled if old < o <= new]
        if hit:
            self._scheduled = [o for o in self._scheduled if o > new]
        return hit

    def _clear_schedule_after_restore(self) -> None:
        self._scheduled = []
        self._capture_from = self.offset

    @abstractmethod
    def snapshot(self, start: int) -> Snapshot:
        """Capture `[start, offset)`."""

    @abstractmethod
    def can_rewind(self, target: int) -> bool:
        """True when `restore(None, target)` would succeed (a dry run: changes nothing)."""

    @abstractmethod
    def restore(self, snap: Snapshot | None, target: int) -> bool:
        """Bring the cache to `target` using `snap` (None: rewind the live state). Returns False
        and changes nothing when `target` is unreachable."""

    @abstractmethod
    def split(self, snap: Snapshot, at: int) -> tuple[Snapshot, Snapshot]:
        """Cut `snap` into `[start, at)` and `[at, end)`; takes ownership of `snap`."""

    @abstractmethod
    def merge(self, parent: Snapshot, child: Snapshot) -> Snapshot:
        """Join adjacent snapshots into `[parent.start, child.end)`; takes ownership of both."""

    def compact(self, snap: Snapshot) -> Snapshot:
        """A cheaper form of `snap` that still restores to its end (a point checkpoint); takes
        ownership of `snap`. Kinds with nothing to drop return it unchanged."""
        return snap

    @abstractmethod
    def free(self) -> None:
        """Release the live state (lazy snapshots of it copy out first)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of live state owned by this cache."""
