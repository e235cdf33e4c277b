"""The prefix cache's byte accounting: what the trie, the sessions' pending captures and the
pinned nodes count against the RAM budget (kept incrementally by `_recount`), the room a forward
must make before it captures (`_before_forward`, `make_room`), and the counts /metrics reads.

A part of `PrefixCache` (cache.py).
"""

from __future__ import annotations

from hybridlm.cache.base import Snapshot, tensor_bytes
from hybridlm.cache.kv import held_bytes
from hybridlm.prefix.session import Slot, attached, budgeted, snap_bytes
from hybridlm.prefix.trie import Node


class Accounting:
    """Bytes and nodes per tier, and the budget checks before a forward (a part of `PrefixCache`)."""

    # The RAM budget holds at every instant, during requests too: everything that adds counted bytes
    # makes room for an upper bound of them first (evicting, compacting, or adding less).
    # - A forward's captures: as it reaches a slot's first stateful layer (`_before_forward`, before
    #   any capture), room is made for every capture it will take, at `costs` (measured per layer);
    #   captures that cannot fit are not taken. The reservation ends when `Session.advance` counts
    #   them (`pending_bytes`), and is counted against the others' room meanwhile.
    # - A session's close: the last piece and the hidden log, before they are made.
    # - Loading nodes from disk and importing edges from the store: their size, before the read.
    # - Lazy trie snapshots copying their rows out of a live buffer: counted at that size from the
    #   start (`budgeted`), so the copy-out never raises the total.
    # Outside the budget (`pinned_bytes`): the live caches the running requests work in, their
    # working restore points (speculative verify / drafter), and their hidden logs until stored.
    # Not counted: transient copies inside one operation (a split or merge of a snapshot).
    @property
    def nbytes(self) -> int:
        """Bytes counted against the RAM budget: the trie's RAM snapshots (lazy ones at the size of
        their rows) plus the running prefills' captures not yet kept."""
        with self.lock:
            return self._trie_bytes + self.pending_bytes

    def _recount(self, *nodes: Node) -> None:
        """Update what `nodes` count against the RAM budget after their snapshots, hidden log or tier
        changed (a node out of the trie counts 0). Every change to a trie node's snapshots goes
        through here: a snapshot's count never changes on its own (a lazy one counts its rows' size
        before its copy-out as after)."""
        for node in nodes:
            self._compacted.discard(node.id)
            now = budgeted(node) if attached(node) else 0
            before = self._counted.pop(node.id, 0)
            self._trie_bytes += now - before
            self._released += max(0, before - now)
            if now:
                self._counted[node.id] = now

    @property
    def released_bytes(self) -> int:
        """Bytes the trie (and its draft companion's) stopped counting since it was made: snapshots
        freed, compacted or moved to disk, as a count that only grows (`engine.memory.HeapTrimmer`
        reads it)."""
        return self._released + (0 if self.draft is None else self.draft.released_bytes)

    def _counted_bytes(self, node: Node) -> int:
        """What `node` counts against the RAM budget now (`budgeted(node)`, kept by `_recount`)."""
        return self._counted.get(node.id, 0)

    def _session_captures(self, slot: Slot) -> tuple[list[Snapshot], list[Snapshot]]:
        """(captures of `slot`'s session — its prompt's restore points — , other captures: working
        restore points of a speculative verify or a drafter, which end past the prompt)."""
        ours, working = [], []
        limit = -1 if slot.session is None else len(slot.session.prompt)
        for i in self.layers:
            for snap in slot.caches[i].captures():
                (ours if snap.end <= limit else working).append(snap)
        return ours, working

    @property
    def pending_bytes(self) -> int:
        """Bytes of captures the running requests have taken and not yet handed to the trie."""
        with self.lock:
            return sum(snap_bytes(s) for slot in self.slots for s in self._session_captures(slot)[0])

    @property
    def pinned_bytes(self) -> int:
        """Bytes the running requests hold outside the RAM budget: every slot's live caches, working
        restore points and hidden log (and the draft companion's); KV rows slots share (forks of one
        prompt, copy-on-write) are counted once."""
        with self.lock:
            own = held_bytes([c for slot in self.slots for c in slot.caches])
            for slot in self.slots:
                own += sum(snap_bytes(s) for s in self._session_captures(slot)[1])
                if slot.session is not None and slot.session.hidden_log:
                    own += tensor_bytes(*slot.session.hidden_log)
            return own + (0 if self.draft is None else self.draft.pinned_bytes)

    @property
    def ram_bytes(self) -> int:
        """Bytes counted against the RAM budget: `nbytes` plus the draft companion's."""
        with self.lock:
            return self.nbytes + (0 if self.draft is None else self.draft.nbytes)

    @property
    def reserved_bytes(self) -> int:
        """Bytes the forwards in flight may still capture (room made for them), the draft's included."""
        own = sum(slot.reserved for slot in self.slots)
        return own + (0 if self.draft is None else self.draft.reserved_bytes)

    def _limit(self) -> int:
        """What this cache's snapshots may count: the RAM budget, or for a draft companion what its
        target's snapshots and reservations leave of it."""
        if self.parent is None:
            return self.ram_budget
        target = self.parent
        return max(0, target.ram_budget - target.nbytes - sum(slot.reserved for slot in target.slots))

    def span_cost(self, start: int, ends: list[int], lean: bool = False) -> int:
        """Most bytes the captures ending at `ends` (the first beginning at `start`) count, over
        every stateful layer (`lean`: in their compact form)."""
        spans = [b - a for a, b in zip([start, *ends], ends, strict=False)]
        return sum(self.costs[i].bytes(n, lean) for i in self.layers for n in spans)

    def make_room(
        self, nbytes: int, keep: frozenset[int] = frozenset(), delete: bool = True, captures: bool = True
    ) -> bool:
        """Evict (as `enforce_budget` does, never the nodes with ids in `keep`; without `delete` only
        by demoting and compacting) and, if need be and `captures`, compact the running prefills'
        captures, until `nbytes` more fit the RAM budget beside what is counted and reserved; False
        when they cannot (then nothing more should be added)."""
        with self.lock:
            if self._budget() is None:
                return True
            self.enforce_budget(reserve=nbytes, keep=keep, delete=delete)
            if captures and self._over(nbytes):
                for slot in self.slots:
                    for i in self.layers:
                        slot.caches[i].compact_captures()
            return not self._over(nbytes)

    def _budget(self) -> int | None:
        return self.ram_budget if self.parent is None else self.parent.ram_budget

    def _over(self, extra: int = 0) -> bool:
        """Whether counted + reserved + `extra` bytes exceed what this cache may hold."""
        counted = self.ram_bytes if self.parent is None else self.nbytes
        return counted + self.reserved_bytes + extra > self._limit()

    def _before_forward(self, slot: Slot, tokens: int) -> None:
        """A forward of `tokens` tokens reaches `slot`'s caches: room is made for the captures it will
        take (when there is none beside the session's earlier captures, those go to the trie first,
        `_store_captures`, where the budget can demote them) — whole if demoting and compacting
        other nodes makes it (their scan-input logs are worth less than any node), else in their
        compact form (`LayerCache.lean`: no scan-input log, so they
        restore only to their ends), deleting nodes as `enforce_budget` does. Captures that fit
        neither way are unscheduled in every layer (the next capture spans them), the earliest
        first: restore points near the prompt's end matter most."""
        session = slot.session
        if session is None or session.closed or self._budget() is None:
            return
        with self.lock:
            slot.reserved = 0  # a previous forward's captures, if any, are counted by now
            first = slot.caches[self.layers[0]]
            ends = [o for o in first.capture_ends(tokens) if o <= len(session.prompt)]
            if ends and not self.make_room(self.span_cost(first.capture_start, ends), captures=False):
                self._store_captures(session)  # no room beside them: make them nodes the budget can demote
            while ends:
                full = self.span_cost(first.capture_start, ends)
                # Whole: by demoting and compacting; by deleting too if it takes at most half the budget
                # (a bigger one would delete the session's own earlier nodes). Else compact.
                tries = [(False, False), (False, 2 * full <= self._limit()), (True, True)]
                for lean, delete in tries:
                    need = self.span_cost(first.capture_start, ends, lean)
                    if self.make_room(need, delete=delete):
                        for i in self.layers:
                            slot.caches[i].lean = lean
                        slot.reserved = need
                        return
                for i in self.layers:
                    slot.caches[i].unschedule(ends[:1])
                ends = ends[1:]

    @property
    def disk_bytes(self) -> int:
        """Bytes of this cache's files on the disk tier (0 without one)."""
        return 0 if self.disk is None else self.disk.nbytes

    @property
    def node_count(self) -> int:
        return sum(1 for _ in self.trie.nodes())

    @property
    def ram_nodes(self) -> int:
        return sum(1 for n in self.trie.nodes() if not n.on_disk)

    @property
    def disk_nodes(self) -> int:
        return sum(1 for n in self.trie.nodes() if n.on_disk)
