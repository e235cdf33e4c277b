"""The prefix cache's eviction policy (`Eviction`): keeping the RAM budget (`enforce_budget`, `make_room`)
with nodes off the live paths first, then on them: demoted to the disk tier while it has room,
compacted (scan-input logs to point checkpoints, `_compact`), demoted displacing colder disk nodes,
and deleted last, least valuable leaves first (`_delete`; worth per byte: `RamBudget.value`);
keeping the disk budget by deleting its least valuable nodes; never touching what an open session
reads (`Slots.locked`).

Owned by `PrefixCache` (cache.py); it decides what goes, the tiers carry it out.
"""

from __future__ import annotations

import heapq
import time

from hybridlm.prefix.accounting import RamBudget
from hybridlm.prefix.disk import DiskTier
from hybridlm.prefix.session import CacheStats, budgeted
from hybridlm.prefix.slots import Slots
from hybridlm.prefix.tiers import Tiers
from hybridlm.prefix.trie import Node, Trie


class Eviction:
    """Compaction, demotion and deletion under the budgets. draft: the draft companion's policy, which
    keeps what the target's snapshots leave of the RAM budget after this one has kept it."""

    def __init__(
        self,
        lock,
        trie: Trie,
        slots: Slots,
        budget: RamBudget,
        tiers: Tiers,
        stats: CacheStats,
        layers: list[int],
        disk: DiskTier | None,
        draft: Eviction | None = None,
    ):
        self.lock = lock
        self.trie = trie
        self.slots = slots
        self.budget = budget
        self.tiers = tiers
        self.stats = stats
        self.layers = layers
        self.disk = disk
        self.draft = draft

    def keep_budget(self) -> None:
        """After a prefill forward (its reservation released): evict as `enforce_budget` does if what
        is counted exceeds the budget (it does not when the captures fitted their reservation; cheap
        then); if the running prefills' captures alone exceed it, they drop their scan-input logs."""
        with self.lock:
            if self.budget.bound is not None and self.budget.over():
                self.make_room(0)

    def make_room(
        self, nbytes: int, keep: frozenset[int] = frozenset(), delete: bool = True, captures: bool = True
    ) -> bool:
        """Evict (as `enforce_budget` does, never the nodes with ids in `keep`; without `delete` only
        by demoting and compacting) and, if need be and `captures`, compact the running prefills'
        captures, until `nbytes` more fit the RAM budget beside what is counted and reserved; False
        when they cannot (then nothing more should be added)."""
        with self.lock:
            if self.budget.bound is None:
                return True
            self.enforce_budget(reserve=nbytes, keep=keep, delete=delete)
            if captures and self.budget.over(nbytes):
                for slot in self.slots:
                    for i in self.layers:
                        slot.caches[i].compact_captures()
            return not self.budget.over(nbytes)

    def enforce_budget(
        self, reserve: int = 0, keep: frozenset[int] = frozenset(), delete: bool = True
    ) -> None:
        """Keep the snapshots inside both budgets; in RAM, with room for `reserve` more bytes beside
        what the forwards in flight reserved, never evicting the nodes with ids in `keep` (without
        `delete`: as far as demoting and compacting go).

        RAM, cheapest loss first, off the live path and then on it (its state is still in the live
        caches; only future reuse is at stake): demote nodes into free disk space (nothing is lost),
        drop scan-input logs (interior offsets become unreachable, ends stay), demote nodes in place
        of less valuable disk leaves, delete (what the disk could not take). Least valuable nodes go
        first at every step. (That order was measured against compacting first and against
        demoting first: docs/architecture.md, "Prefix trie".) Disk: delete the least valuable disk
        leaves (a disk node with RAM nodes below it goes with its subtree, only if no disk leaf is
        left)."""
        with self.lock:
            self._enforce(reserve, keep, delete)

    def _enforce(self, reserve: int, keep: frozenset[int], delete: bool = True) -> None:
        if self.budget.bound is not None:
            room = self.budget.limit() - reserve - self.budget.reserved_bytes
            total = self.budget.nbytes
            if total > room:  # what is protected takes walks of the slots' paths and of the trie
                protected = self.slots.live_path()
                keep = keep | self.slots.locked()
            for on_live_path in (False, True):
                if total <= room:
                    break
                eligible = lambda n, p=on_live_path: (n.id in protected) == p and n.id not in keep
                total = self._demote(total, eligible, room, displace=False)
                total = self._compact(total, eligible, room)
                total = self._demote(total, eligible, room, displace=True)
                if delete:
                    total = self._delete(total, eligible, room)
        if self.disk is not None:
            now = time.monotonic()
            while self.disk.nbytes > self.disk.budget:
                stored = [n for n in self.trie.nodes() if n.on_disk]
                leaves = [n for n in stored if not n.children]
                victim = min(leaves or stored, key=lambda n: self.budget.value(n, now))
                self.stats.disk_evicted_nodes += self.tiers.remove_subtree(victim)
        if self.draft is not None:
            # The draft's snapshots only save draft prefill: they get what the target's leave
            # (`RamBudget.limit`).
            self.draft._enforce(reserve, frozenset(), delete)

    def _compact(self, total: int, eligible, room: int) -> int:
        """Compact RAM nodes' snapshots (`LayerCache.compact`), least valuable first, until `total`
        bytes fit `room`; returns the new total."""
        now = time.monotonic()
        caches = self.slots.caches
        # Nodes compacted before have nothing left to drop: at the budget, where every forward makes
        # room, going through them all again (and their idle readers' `unread`) would be wasted.
        nodes = [n for n in self.trie.nodes() if n.id not in self.budget.compacted and not n.on_disk]
        for node in sorted(nodes, key=lambda n: self.budget.value(n, now)):
            if total <= room:
                break
            if not eligible(node):
                continue
            before = self.budget.counted(node)
            windows = [getattr(c, "window", None) for c, s in zip(caches, node.snaps, strict=True) if s]
            if any(windows):
                self.slots.unread(node)  # sliding rows compact into new tensors: the read ones would stay
            node.snaps = [None if s is None else caches[i].compact(s) for i, s in enumerate(node.snaps)]
            self.budget.recount(node)
            self.budget.compacted.add(node.id)
            if self.budget.counted(node) < before:
                self.stats.compacted_snapshots += 1
                total -= before - self.budget.counted(node)
        return total

    def _demote(self, total: int, eligible, room: int, displace: bool) -> int:
        """Move RAM nodes to disk, least valuable first, until `total` fits `room`; only into free
        disk space unless `displace` (then less valuable disk leaves make room)."""
        if self.disk is None or total <= room:
            return total
        now = time.monotonic()
        nodes = [n for n in self.trie.nodes() if eligible(n) and not n.on_disk and self.budget.counted(n)]
        for node in sorted(nodes, key=lambda n: self.budget.value(n, now)):
            if total <= room:
                break
            before = budgeted(node)
            if self.tiers.demote(node, now, displace):
                total -= before
        return total

    def _delete(self, total: int, eligible, room: int) -> int:
        """Delete RAM nodes, least valuable first, until `total` fits `room`: leaves first, then
        nodes with only disk nodes below them (those go too: the disk could not take them).

        One walk of the trie, then a heap of the candidates (RAM nodes with no RAM node below): the
        candidates' subtrees are disjoint, so a deletion changes no other candidate's key and can
        only make its ancestors candidates. Ties go to the node met first in `Trie.nodes` order, as
        a fresh walk per deletion would pick (walking the trie for every victim cost a server at its
        budget a fifth of its engine time)."""
        if total <= room:
            return total
        now = time.monotonic()
        nodes = list(self.trie.nodes())
        order = {n.id: i for i, n in enumerate(nodes)}
        ram_below: dict[int, bool] = {}
        for n in reversed(nodes):  # children before parents
            ram_below[n.id] = any(not c.on_disk or ram_below[c.id] for c in n.children.values())

        def candidate(n: Node) -> tuple | None:
            if not eligible(n) or n.on_disk or ram_below[n.id]:
                return None
            return bool(n.children), self.budget.value(n, now), order[n.id], n

        heap = [entry for n in nodes if (entry := candidate(n)) is not None]
        heapq.heapify(heap)
        while total > room and heap:
            victim = heapq.heappop(heap)[-1]
            total -= budgeted(victim)
            self.stats.evicted_nodes += self.tiers.remove_subtree(victim)
            node = victim.parent
            # Up from the victim while nodes lose their last RAM node below (a RAM node stays RAM
            # below its own parent, so the walk stops at the first one).
            while node is not None and node is not self.trie.root:
                below = any(not c.on_disk or ram_below[c.id] for c in node.children.values())
                if below == ram_below[node.id]:
                    break
                ram_below[node.id] = below
                if (entry := candidate(node)) is not None:
                    heapq.heappush(heap, entry)
                if not node.on_disk:
                    break
                node = node.parent
        return total
