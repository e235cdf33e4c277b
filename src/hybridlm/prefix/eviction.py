"""The prefix cache's eviction policy: keeping the RAM budget (`_enforce`) with nodes off the live
paths first, then on them: demoted to the disk tier while it has room, compacted (scan-input logs
to point checkpoints, `_compact`), demoted displacing colder disk nodes, and deleted last, least
valuable leaves first (`_delete`, `_value`); keeping the disk budget by deleting its least valuable
nodes; never touching what an open session reads (`locked`, `_read_sources`).

A part of `PrefixCache` (cache.py).
"""

from __future__ import annotations

import heapq
import time

from hybridlm.cache.kv import KVCache
from hybridlm.prefix.session import budgeted
from hybridlm.prefix.trie import Node


class Eviction:
    """Compaction, demotion and deletion under the budget (a part of `PrefixCache`)."""

    def keep_budget(self) -> None:
        """After a prefill forward (its reservation released): evict as `enforce_budget` does if what
        is counted exceeds the budget (it does not when the captures fitted their reservation; cheap
        then); if the running prefills' captures alone exceed it, they drop their scan-input logs."""
        with self.lock:
            if self._budget() is not None and self._over():
                self.make_room(0)

    def _read_sources(self, busy: bool) -> set[int]:
        """Ids of the trie snapshots whose rows slots read as segments (copy-on-write restores): slots
        with an open session (`busy`), or idle ones."""
        return {
            id(seg.source)
            for slot in self.slots
            if (slot.session is not None) == busy
            for c in slot.caches
            if isinstance(c, KVCache)
            for seg in c.segments
            if seg.source is not None
        }

    def locked(self) -> frozenset[int]:
        """Ids of the nodes whose rows a running session reads (never evicted, demoted or compacted:
        their bytes would stay alive, read, outside the budget; like SGLang's locked radix nodes)."""
        sources = self._read_sources(busy=True)
        if not sources:
            return frozenset()
        return frozenset(n.id for n in self.trie.nodes() if any(id(s) in sources for s in n.snaps))

    def _unread(self, node: Node) -> None:
        """Before `node`'s snapshots are freed or replaced: idle slots reading their rows drop their
        live state (they would keep the rows alive outside the budget; the trie still has the rest)."""
        ours = {id(s) for s in node.snaps if getattr(s, "readers", 0)}
        if not ours or not ours & self._read_sources(busy=False):
            return
        for slot in self.slots:
            reads = any(
                id(seg.source) in ours for c in slot.caches if isinstance(c, KVCache) for seg in c.segments
            )
            if slot.session is None and reads:
                for cache in slot.caches:
                    if cache is not None:
                        cache.free()
                        cache.record = True
                slot.live = []

    def live_path(self) -> set[int]:
        """Ids of the nodes on every slot's live path (protected from eviction): the prefixes running
        sequences restored from and the idle slots' frontiers."""
        return {n.id for slot in self.slots for n in self.trie.match(slot.live)[0]}

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
        if self._budget() is not None:
            room = self._limit() - reserve - self.reserved_bytes
            total = self.nbytes
            if total > room:  # what is protected takes walks of the slots' paths and of the trie
                protected = self.live_path()
                keep = keep | self.locked()
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
                victim = min(leaves or stored, key=lambda n: self._value(n, now))
                self.stats.disk_evicted_nodes += self._remove_subtree(victim)
        if self.draft is not None:
            # The draft's snapshots only save draft prefill: they get what the target's leave.
            if self.ram_budget is not None:
                self.draft.ram_budget = max(0, self.ram_budget - self.nbytes)
            self.draft._enforce(reserve, frozenset(), delete)

    def _compact(self, total: int, eligible, room: int) -> int:
        now = time.monotonic()
        # Nodes compacted before have nothing left to drop: at the budget, where every forward makes
        # room, going through them all again (and their idle readers' `_unread`) would be wasted.
        nodes = [n for n in self.trie.nodes() if n.id not in self._compacted and not n.on_disk]
        for node in sorted(nodes, key=lambda n: self._value(n, now)):
            if total <= room:
                break
            if not eligible(node):
                continue
            before = self._counted_bytes(node)
            windows = [getattr(c, "window", None) for c, s in zip(self.caches, node.snaps, strict=True) if s]
            if any(windows):
                self._unread(node)  # sliding rows compact into new tensors: the read ones would stay
            node.snaps = [None if s is None else self.caches[i].compact(s) for i, s in enumerate(node.snaps)]
            self._recount(node)
            self._compacted.add(node.id)
            if self._counted_bytes(node) < before:
                self.stats.compacted_snapshots += 1
                total -= before - self._counted_bytes(node)
        return total

    def _demote(self, total: int, eligible, room: int, displace: bool) -> int:
        """Move RAM nodes to disk, least valuable first, until `total` fits `room`; only into free
        disk space unless `displace` (then less valuable disk leaves make room)."""
        if self.disk is None or total <= room:
            return total
        now = time.monotonic()
        nodes = [n for n in self.trie.nodes() if eligible(n) and not n.on_disk and self._counted_bytes(n)]
        for node in sorted(nodes, key=lambda n: self._value(n, now)):
            if total <= room:
                break
            before = budgeted(node)
            if self._store(node, now, displace):
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
            return bool(n.children), self._value(n, now), order[n.id], n

        heap = [entry for n in nodes if (entry := candidate(n)) is not None]
        heapq.heapify(heap)
        while total > room and heap:
            victim = heapq.heappop(heap)[-1]
            total -= budgeted(victim)
            self.stats.evicted_nodes += self._remove_subtree(victim)
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

    def _value(self, node: Node, now: float, nbytes: int | None = None) -> float:
        """Recompute work saved per byte held, decayed by idle time: tokens / bytes / (1 + idle/5min).
        Bytes are the node's tier's (its file on disk, its snapshots in RAM) unless given."""
        if nbytes is None:
            nbytes = node.file_bytes if node.on_disk else self._counted_bytes(node)
        return len(node.tokens) / max(nbytes, 1) / (1.0 + (now - node.last_used) / 300.0)

    def _remove_leaf(self, node: Node) -> None:
        if node.on_disk:
            self.disk.delete(node.file)
        else:
            self._unread(node)
        self.trie.remove_leaf(node)
        self._recount(node)

    def _remove_subtree(self, node: Node) -> int:
        """Delete `node` and every node below it (snapshots freed, files deleted); returns how many."""
        below = [node]
        for n in below:
            below.extend(n.children.values())
        for n in reversed(below):  # children before parents: each is a leaf when removed
            self._remove_leaf(n)
        return len(below)
