"""The prefix cache's restorer (`Restorer`): opening sessions. A begin matches the prompt against the
trie and restores a slot's live caches to the longest stored prefix every layer can reach
(`_restore_best`: `_choose` a target, `_plan` each layer's steps, load the disk nodes the plan
uses, `_execute`); a fork brings a slot of its own to the state of a session whose prefill has
just ended (the n choices of a request).

Owned by `PrefixCache` (cache.py); it asks the recorder, the eviction policy and the tiers.
"""

from __future__ import annotations

import logging
import time

from hybridlm.cache.base import LayerCache
from hybridlm.cache.fork import fork_caches
from hybridlm.cache.recurrent import ScanCache
from hybridlm.prefix.eviction import Eviction
from hybridlm.prefix.record import Recorder
from hybridlm.prefix.session import (
    RESET,
    CacheStats,
    CapturePlan,
    Session,
    Slot,
    attached,
    common_prefix,
    hidden_prefix,
)
from hybridlm.prefix.slots import Slots
from hybridlm.prefix.store import StoreTier
from hybridlm.prefix.tiers import Tiers
from hybridlm.prefix.trie import Node, Trie

# One logger for the whole prefix cache, as before it was split into parts.
log = logging.getLogger("hybridlm.prefix.cache")


class Restorer:
    """Begin and fork sessions over the trie's snapshots. owner: what the sessions call back into
    (their `PrefixCache`); draft: the draft companion's `PrefixCache`, or None; store: the shared
    store tier, or None."""

    def __init__(
        self,
        owner,
        trie: Trie,
        slots: Slots,
        recorder: Recorder,
        eviction: Eviction,
        tiers: Tiers,
        stats: CacheStats,
        plan: CapturePlan,
        layers: list[int],
        store: StoreTier | None,
        draft,
    ):
        self.owner = owner
        self.trie = trie
        self.slots = slots
        self.recorder = recorder
        self.eviction = eviction
        self.tiers = tiers
        self.stats = stats
        self.plan = plan
        self.layers = layers
        self.store = store
        self.draft = draft

    def begin(self, tokens: list[int], draft: bool) -> Session:
        """Open a session over `tokens` (at least one), its slot's live caches restored to the longest
        stored prefix of `tokens[:-1]` that every layer can reach; with `draft`, the draft companion's
        session beside it. The caller holds the lock."""
        t0 = time.perf_counter()
        keep = tokens[: len(tokens) - 1]
        if self.store is not None:
            self.recorder.import_longer(keep)
        slot = self.slots.take(keep)
        common = common_prefix(slot.live, keep)
        path, matched, target, replayed = self._restore_best(slot, keep, common)
        if target > 0:
            self.stats.hits += 1
        elif matched > 0:
            self.stats.misses_unrestorable += 1
        else:
            self.stats.misses_no_prefix += 1
        if target < matched:
            log.info("prefix matched %d tokens but restored %d", matched, target)
        slot.live = list(tokens[:target])
        now = time.monotonic()
        for node in path:
            if node.start < target:
                node.touch(now)
        restore_ms = (time.perf_counter() - t0) * 1e3
        session = Session(self.owner, slot, list(tokens), target, replayed, restore_ms, list(slot.live))
        session.stored = target
        session.hidden = hidden_prefix(path, target)
        self.slots.open(slot, session)
        if draft and self.draft is not None:
            session.draft = self.draft.begin(tokens)
        offsets = self.plan.offsets(target, len(tokens))
        for i in self.layers:
            slot.caches[i].prepare_snapshots(offsets, ranges=True)
            slot.caches[i].lean = False
        # Nodes loaded from disk (and rows copied out of the live buffers) may have grown RAM.
        self.eviction.enforce_budget()
        return session

    def fork(self, session: Session) -> Session:
        """A session for another choice of `session`'s request (n > 1), whose prefill has just
        ended: a slot of its own brought to the same state (`fork_caches`: KV rows shared copy-on-
        write, recurrent state copied). The prompt's restore points go to the trie first, so every
        choice's continuation attaches below the prompt's node when its session closes. The caller
        holds the lock."""
        self.recorder.store_captures(session)
        slot = self.slots.take(session.fed)
        fork_caches(session.caches, slot.caches)
        slot.live = list(session.fed)
        end = len(session.fed)
        fork = Session(self.owner, slot, list(session.prompt), end, 0, 0.0, list(session.fed), stored=end)
        self.slots.open(slot, fork)
        for i in self.layers:
            slot.caches[i].prepare_snapshots([], ranges=True)
            slot.caches[i].lean = False
        self.eviction.enforce_budget()  # rows copied out of the slot's buffers count now
        return fork

    def _restore_best(self, slot: Slot, keep: list[int], common: int) -> tuple[list[Node], int, int, int]:
        """Restore every layer to the largest reachable target ≤ max(matched, common), where the
        trie agrees with `keep` up to `matched` and the live caches up to `common`; returns (path,
        matched, target, replayed). Planning works on disk nodes' stand-ins; the nodes the chosen
        plan uses are then loaded (promoted to RAM) and the plan made again on the real snapshots
        (same reachability, so the same plan). A node that fails to load is dropped with its
        subtree, which changes the match: start over. Room in the RAM budget is made for the nodes
        before they are loaded (their files' sizes bound their snapshots'); where it cannot be, the
        restore stops short of the first node that does not fit."""
        while True:
            path, matched = self.trie.match(keep)
            target, plans = self._choose(slot, path, matched, common)
            used = {id(snap) for steps in plans for snap, _ in steps}
            stored = [n for n in path if n.on_disk and any(id(s) in used for s in n.snaps)]
            if not stored:
                replayed = 0
                for i, steps in zip(self.layers, plans, strict=True):
                    replayed = max(replayed, self._execute(slot.caches[i], i, steps))
                return path, matched, target, replayed
            on_path = frozenset(n.id for n in path)
            for node in stored:
                if not self.eviction.make_room(node.file_bytes, keep=on_path):
                    keep = keep[: node.start]
                    break
                # Making room on disk may have deleted it (a disk leaf worth less): match again.
                if not attached(node) or not self.tiers.load(node):
                    break

    def _choose(self, slot: Slot, path: list[Node], matched: int, common: int) -> tuple[int, list]:
        """The largest target ≤ max(matched, common) every layer can reach, and each layer's plan."""
        want = max(matched, common)
        candidates = sorted({want, matched, common, *(n.end for n in path if n.end < want), 0}, reverse=True)
        for t in candidates:
            plans = [self._plan(slot.caches[i], i, path, t, matched, common) for i in self.layers]
            if all(p is not None for p in plans):
                return t, plans
        raise AssertionError("offset 0 is always reachable")

    def _plan(self, cache: LayerCache, layer: int, path: list[Node], t: int, matched: int, common: int):
        """Restore steps [(snapshot | None | RESET, target)] bringing layer `layer` (its live `cache`)
        to `t`, or None."""
        if t <= common and cache.can_rewind(t):
            return [(None, t)]
        if t > matched:
            return [(RESET, 0)] if t == 0 else None
        nodes = [n for n in path if n.start < t]
        for j in range(len(nodes) - 1, -1, -1):
            s = nodes[j].start
            if s <= common and cache.can_rewind(s):
                first = (None, s)
            elif j == 0:
                first = (RESET, 0)
            else:
                prev = nodes[j - 1].snaps[layer]
                if not prev.standalone(prev.end):
                    continue
                first = (prev, prev.end)
            steps = [first] + [(n.snaps[layer], min(n.end, t)) for n in nodes[j:]]
            if all(snap.reaches(target) for snap, target in steps[1:]):
                return steps
            return None
        return [(RESET, 0)] if t == 0 else None

    def _execute(self, cache: LayerCache, layer: int, steps) -> int:
        """Run restore steps on layer `layer`'s live `cache`; returns tokens recovered by replay."""
        replayed = 0
        for snap, target in steps:
            if snap is RESET:
                if not cache.restore(None, 0):
                    cache.free()
                continue
            if not cache.restore(snap, target):
                raise AssertionError(f"planned restore to {target} failed on layer {layer}")
            if isinstance(cache, ScanCache) and snap is not None and not snap.standalone(target):
                replayed += target - snap.start
        return replayed
