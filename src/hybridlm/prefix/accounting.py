"""The prefix cache's byte accounting (`RamBudget`): what the trie, the sessions' pending captures and
the pinned live state count against the RAM budget (the trie's part kept incrementally by `recount`),
what a cache may hold (`limit`, `over`: a draft companion gets what its target leaves), what captures
will cost (`span_cost`), what a node is worth per byte (`value`), and the counts /metrics reads.

Owned by `PrefixCache` (cache.py); it reads the slots and nothing above them: the eviction policy
that keeps the budget asks it.
"""

from __future__ import annotations

from hybridlm.cache.base import Snapshot, tensor_bytes
from hybridlm.cache.kv import held_bytes
from hybridlm.prefix.session import CaptureCost, Slot, attached, budgeted, snap_bytes
from hybridlm.prefix.slots import Slots
from hybridlm.prefix.trie import Node


class RamBudget:
    """Bytes counted against the RAM budget, and the checks made before adding more.

    ram_budget: bytes the snapshots may count (None: unbounded). target: set on a draft companion's
    budget, the target's: the draft gets what the target's snapshots and reservations leave of the
    target's `ram_budget`. draft: the draft companion's budget, whose bytes the target's totals
    include."""

    # The RAM budget holds at every instant, during requests too: everything that adds counted bytes
    # makes room for an upper bound of them first (evicting, compacting, or adding less).
    # - A forward's captures: as it reaches a slot's first stateful layer (`before_forward`, before
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

    def __init__(
        self,
        lock,
        slots: Slots,
        layers: list[int],
        costs: dict[int, CaptureCost],
        ram_budget: int | None,
        target: RamBudget | None = None,
    ):
        self.lock = lock
        self.slots = slots
        self.layers = layers
        self.costs = costs
        self.ram_budget = ram_budget
        self.target = target
        self.draft: RamBudget | None = None
        # What each trie node counts against the RAM budget (`budgeted`), and their sum: kept as nodes
        # change (`recount`), so the budget checks every forward makes cost O(1), not a walk of the
        # whole trie (thousands of nodes after hours of traffic).
        self._counted: dict[int, int] = {}
        self._trie_bytes = 0
        self._released = 0  # bytes nodes stopped counting, ever (`released_bytes`)
        # Nodes whose snapshots compacting cannot shrink any more: the eviction policy adds them once
        # compacted; a change to a node's snapshots (`recount`) takes it out again.
        self.compacted: set[int] = set()

    def recount(self, *nodes: Node) -> None:
        """Update what `nodes` count against the RAM budget after their snapshots, hidden log or tier
        changed (a node out of the trie counts 0). Every change to a trie node's snapshots goes
        through here: a snapshot's count never changes on its own (a lazy one counts its rows' size
        before its copy-out as after)."""
        for node in nodes:
            self.compacted.discard(node.id)
            now = budgeted(node) if attached(node) else 0
            before = self._counted.pop(node.id, 0)
            self._trie_bytes += now - before
            self._released += max(0, before - now)
            if now:
                self._counted[node.id] = now

    def counted(self, node: Node) -> int:
        """What `node` counts against the RAM budget now, in bytes (`budgeted(node)`, kept by
        `recount`)."""
        return self._counted.get(node.id, 0)

    def value(self, node: Node, now: float, nbytes: int | None = None) -> float:
        """Recompute work saved per byte held, decayed by idle time: tokens / bytes / (1 + idle/5min),
        `now` in `time.monotonic` seconds. Bytes are the node's tier's (its file on disk, what it
        counts in RAM) unless given."""
        if nbytes is None:
            nbytes = node.file_bytes if node.on_disk else self.counted(node)
        return len(node.tokens) / max(nbytes, 1) / (1.0 + (now - node.last_used) / 300.0)

    @property
    def nbytes(self) -> int:
        """Bytes counted against the RAM budget: the trie's RAM snapshots (lazy ones at the size of
        their rows) plus the running prefills' captures not yet kept."""
        with self.lock:
            return self._trie_bytes + self.pending_bytes

    @property
    def released_bytes(self) -> int:
        """Bytes the trie (and its draft companion's) stopped counting since it was made: snapshots
        freed, compacted or moved to disk, as a count that only grows (`engine.memory.HeapTrimmer`
        reads it)."""
        return self._released + (0 if self.draft is None else self.draft.released_bytes)

    def _captures(self, slot: Slot) -> tuple[list[Snapshot], list[Snapshot]]:
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
            return sum(snap_bytes(s) for slot in self.slots for s in self._captures(slot)[0])

    @property
    def pinned_bytes(self) -> int:
        """Bytes the running requests hold outside the RAM budget: every slot's live caches, working
        restore points and hidden log (and the draft companion's); KV rows slots share (forks of one
        prompt, copy-on-write) are counted once."""
        with self.lock:
            own = held_bytes([c for slot in self.slots for c in slot.caches])
            for slot in self.slots:
                own += sum(snap_bytes(s) for s in self._captures(slot)[1])
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

    @property
    def bound(self) -> int | None:
        """The RAM budget in force, in bytes (a draft companion's is its target's); None: unbounded."""
        return self.ram_budget if self.target is None else self.target.ram_budget

    def limit(self) -> int:
        """Bytes this cache's snapshots may count: the RAM budget, or for a draft companion what its
        target's snapshots and reservations leave of it."""
        if self.target is None:
            return self.ram_budget
        target = self.target
        return max(0, target.ram_budget - target.nbytes - sum(slot.reserved for slot in target.slots))

    def over(self, extra: int = 0) -> bool:
        """Whether counted + reserved + `extra` bytes exceed what this cache may hold."""
        counted = self.ram_bytes if self.target is None else self.nbytes
        return counted + self.reserved_bytes + extra > self.limit()

    def span_cost(self, start: int, ends: list[int], lean: bool = False) -> int:
        """Most bytes the captures ending at `ends` (the first beginning at `start`) count, over
        every stateful layer (`lean`: in their compact form)."""
        spans = [b - a for a, b in zip([start, *ends], ends, strict=False)]
        return sum(self.costs[i].bytes(n, lean) for i in self.layers for n in spans)
