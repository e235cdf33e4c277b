"""The prefix cache's tier movement (`Tiers`): nodes demoted from RAM to the disk tier (`demote`, with
room made on disk by `_disk_room`), loaded back when a restore needs them (`load`), written at
shutdown (`persist`), the disk's files adopted into the trie at start-up (`adopt`, `_place`), and
nodes removed from whichever tier holds them (`remove_leaf`, `remove_subtree`: a file deleted, or
snapshots freed). The shared store (`StoreTier`) is read and written by the recorder.

Owned by `PrefixCache` (cache.py); the eviction policy decides what moves, this carries it out.
"""

from __future__ import annotations

import logging
import math
import time

from hybridlm.cache.kv import KVCache, RowsSnapshot
from hybridlm.cache.recurrent import ScanSnapshot
from hybridlm.prefix.accounting import RamBudget
from hybridlm.prefix.disk import CorruptFile, DiskTier, StoredNode, StoredSnapshot, monotonic_of, wall_clock
from hybridlm.prefix.session import CacheStats, free_all
from hybridlm.prefix.slots import Slots
from hybridlm.prefix.trie import Node, Trie

# One logger for the whole prefix cache, as before it was split into parts.
log = logging.getLogger("hybridlm.prefix.cache")


class Tiers:
    """Where trie nodes live, RAM or disk (`disk`: the disk tier, or None), and their moves between
    the two and out of the trie."""

    def __init__(
        self,
        model,
        trie: Trie,
        slots: Slots,
        budget: RamBudget,
        stats: CacheStats,
        layers: list[int],
        disk: DiskTier | None,
    ):
        self.model = model
        self.trie = trie
        self.slots = slots
        self.budget = budget
        self.stats = stats
        self.layers = layers
        self.disk = disk

    def persist(self) -> int:
        """Write every node held in RAM to the disk tier, most valuable first, as far as the disk
        budget allows (e.g. at shutdown, so that a restart over the same directory reuses them).
        Returns the number of nodes written."""
        if self.disk is None:
            return 0
        now = time.monotonic()
        nodes = sorted(
            (n for n in self.trie.nodes() if not n.on_disk),
            key=lambda n: self.budget.value(n, now),
            reverse=True,
        )
        return sum(self.demote(node, now, displace=True) for node in nodes)

    def demote(self, node: Node, now: float, displace: bool) -> bool:
        """Demote `node`: write its snapshots to one file and keep stand-ins in the trie. It goes into
        free disk space, or with `displace` in place of less valuable disk nodes. False (nothing
        changed) when there is no such room or the write fails."""
        tokens = [t for n in node.path() for t in n.tokens]
        snaps = {i: node.snaps[i] for i in self.layers}
        floor = lambda nbytes: self.budget.value(node, now, nbytes) if displace else -math.inf
        room = lambda nbytes, evict: self._disk_room(nbytes, floor(nbytes), now, evict)
        stored = self.disk.write(tokens, node.start, wall_clock(node.last_used), snaps, room)
        if stored is None:
            return False
        self.slots.unread(node)
        free_all(node.snaps)
        node.hidden = None  # the disk tier keeps snapshots only
        node.snaps = [
            StoredSnapshot(stored.layers[i]) if i in stored.layers else None for i in range(len(node.snaps))
        ]
        node.file, node.file_bytes = stored.name, stored.nbytes
        self.budget.recount(node)
        self.stats.disk_writes += 1
        self.stats.disk_written_bytes += stored.nbytes
        return True

    def _disk_room(self, nbytes: int, floor: float, now: float, evict: bool) -> bool:
        """Whether `nbytes` more fit the disk budget once disk nodes less valuable than `floor` are
        deleted (leaves first); with `evict`, delete them, least valuable first, until it fits."""
        budget = self.disk.budget
        if self.disk.nbytes + nbytes <= budget:
            return True
        # A disk node can go only after everything below it: those whose whole subtree is cheap disk nodes.
        order = list(self.trie.nodes())
        cheap: dict[int, bool] = {}
        for n in reversed(order):
            cheap[n.id] = (
                n.on_disk
                and self.budget.value(n, now) < floor
                and all(cheap[c.id] for c in n.children.values())
            )
        reclaimable = sum(n.file_bytes for n in order if cheap[n.id])
        if self.disk.nbytes - reclaimable + nbytes > budget:
            return False
        while evict and self.disk.nbytes + nbytes > budget:
            leaves = [n for n in self.trie.nodes() if cheap.get(n.id) and not n.children]
            self.remove_leaf(min(leaves, key=lambda n: self.budget.value(n, now)))
            self.stats.disk_evicted_nodes += 1
        return True

    def load(self, node: Node) -> bool:
        """Promote a disk node: read its file back into RAM snapshots and delete the file (a node
        lives in one tier). A file that fails is dropped with its subtree (logged); returns False."""
        try:
            snaps = self.disk.read(node.file, self.model.device)
            if sorted(snaps) != self.layers or any(
                (s.start, s.end) != (node.start, node.end) for s in snaps.values()
            ):
                raise CorruptFile("its snapshots do not cover this node")
        except CorruptFile as e:
            self.stats.disk_errors += 1
            log.warning(
                "prefix cache: %s is unusable (%s); dropped it and the nodes below it",
                self.disk.directory / node.file,
                e,
            )
            self.remove_subtree(node)
            return False
        self.stats.disk_reads += 1
        self.stats.disk_read_bytes += node.file_bytes
        free_all(node.snaps)
        self.disk.delete(node.file)
        node.snaps = [snaps.get(i) for i in range(len(self.slots.caches))]
        node.file, node.file_bytes = None, 0
        self.budget.recount(node)
        return True

    def adopt(self) -> None:
        """Rebuild the trie from the disk tier's files for this model (all nodes on disk, none live).
        Files of another model or format, and unreadable ones, are ignored and kept (they are not
        provably ours); this model's files that cannot be used (cut short, their parent's file
        missing, their edge already held by another file, layers that do not match) are deleted.
        One warning sums up what was ignored."""
        found, ignored = self.disk.scan()
        for stored in found:  # parents before children
            problem = self._place(stored)
            if problem is not None:
                self.disk.delete(stored.name)
                ignored.append(f"{stored.name}: {problem}; deleted")
        self.stats.disk_errors += len(ignored)
        if ignored:
            shown = "; ".join(ignored[:5]) + ("; ..." if len(ignored) > 5 else "")
            log.warning(
                "prefix cache: ignored %d file(s) in %s: %s", len(ignored), self.disk.directory, shown
            )

    def _place(self, stored: StoredNode) -> str | None:
        """Attach a file's node to the trie, on disk; returns why it cannot be, or None."""
        end = len(stored.tokens)
        if not 0 <= stored.start < end:
            return "empty edge"
        if sorted(stored.layers) != self.layers:
            return "its layers are not the model's"
        try:
            for i, fields in stored.layers.items():
                cache = self.slots.caches[i]
                kind = RowsSnapshot.kind if isinstance(cache, KVCache) else ScanSnapshot.kind
                if fields["kind"] != kind or (fields["start"], fields["end"]) != (stored.start, end):
                    return f"layer {i} is not the model's layer or does not cover the edge"
                if kind == RowsSnapshot.kind and fields["window"] != cache.window:
                    return f"layer {i} has another window"
            stubs = [
                StoredSnapshot(stored.layers[i]) if i in stored.layers else None
                for i in range(len(self.slots.caches))
            ]
        except (KeyError, TypeError, ValueError) as e:
            return f"unreadable layer fields ({e!r})"
        path, matched = self.trie.match(stored.tokens[: stored.start])
        parent = path[-1] if path else self.trie.root
        if matched != stored.start or parent.end != stored.start:
            return "its parent is not stored"
        if stored.tokens[stored.start] in parent.children:
            return "another file holds its edge"
        node = self.trie.attach(parent, stored.tokens[stored.start :], stubs)
        node.file, node.file_bytes = stored.name, stored.nbytes
        self.budget.recount(node)
        node.last_used = monotonic_of(stored.last_used)
        return None

    def remove_leaf(self, node: Node) -> None:
        if node.on_disk:
            self.disk.delete(node.file)
        else:
            self.slots.unread(node)
        self.trie.remove_leaf(node)
        self.budget.recount(node)

    def remove_subtree(self, node: Node) -> int:
        """Delete `node` and every node below it (snapshots freed, files deleted); returns how many."""
        below = [node]
        for n in below:
            below.extend(n.children.values())
        for n in reversed(below):  # children before parents: each is a leaf when removed
            self.remove_leaf(n)
        return len(below)
