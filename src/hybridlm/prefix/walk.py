"""The prefix cache's walk: matching a prompt against the trie and restoring the live caches to the
longest stored prefix (`begin`, `_restore_best`, `_plan`, `_execute`), forking a session for the
n choices of a request (`fork`), and recording what a session computed into the trie when it closes
(`_close`, `_insert`) or dropping it (`_abandon`). With a shared store, a prefix the trie lacks is
imported before the match and what a session computed is published after its close.

A part of `PrefixCache` (cache.py), which owns the trie, the slots and the lock.
"""

from __future__ import annotations

import logging
import time

import torch

from hybridlm.cache.base import LayerCache, Snapshot, tensor_bytes
from hybridlm.cache.fork import fork_caches
from hybridlm.cache.recurrent import ScanCache
from hybridlm.prefix.session import (
    RESET,
    Session,
    Slot,
    attached,
    common_prefix,
    free_all,
    hidden_prefix,
    snap_bytes,
)
from hybridlm.prefix.store import import_longer, publish_path
from hybridlm.prefix.trie import Node

# One logger for the whole prefix cache, as before it was split into rooms.
log = logging.getLogger("hybridlm.prefix.cache")


class Walk:
    """Match and restore on begin; record on close (a part of `PrefixCache`)."""

    def begin(self, tokens: list[int], draft: bool = False) -> Session:
        """Restore the longest stored prefix of `tokens` (keeping ≥ 1 token to evaluate); with
        `draft` and a draft companion, also the draft model's caches (`Session.draft`)."""
        if not tokens:
            raise ValueError("a session needs at least one token")
        with self.lock:
            return self._begin(tokens, draft)

    def _begin(self, tokens: list[int], draft: bool) -> Session:
        t0 = time.perf_counter()
        keep = tokens[: len(tokens) - 1]
        if self.store is not None:
            import_longer(self, keep)
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
        session = Session(self, slot, list(tokens), target, replayed, restore_ms, list(slot.live))
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
        choice's continuation attaches below the prompt's node when its session closes."""
        with self.lock:
            self._store_captures(session)
            slot = self.slots.take(session.fed)
            fork_caches(session.caches, slot.caches)
            slot.live = list(session.fed)
            end = len(session.fed)
            fork = Session(self, slot, list(session.prompt), end, 0, 0.0, list(session.fed), stored=end)
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
        if session is None or session.closed or self.budget.bound is None:
            return
        with self.lock:
            slot.reserved = 0  # a previous forward's captures, if any, are counted by now
            first = slot.caches[self.layers[0]]
            ends = [o for o in first.capture_ends(tokens) if o <= len(session.prompt)]
            room = self.budget.span_cost(first.capture_start, ends) if ends else 0
            if ends and not self.eviction.make_room(room, captures=False):
                self._store_captures(session)  # no room beside them: make them nodes the budget can demote
            while ends:
                full = self.budget.span_cost(first.capture_start, ends)
                # Whole: by demoting and compacting; by deleting too if it takes at most half the budget
                # (a bigger one would delete the session's own earlier nodes). Else compact.
                tries = [(False, False), (False, 2 * full <= self.budget.limit()), (True, True)]
                for lean, delete in tries:
                    need = self.budget.span_cost(first.capture_start, ends, lean)
                    if self.eviction.make_room(need, delete=delete):
                        for i in self.layers:
                            slot.caches[i].lean = lean
                        slot.reserved = need
                        return
                for i in self.layers:
                    slot.caches[i].unschedule(ends[:1])
                ends = ends[1:]

    def _store_captures(self, session: Session) -> None:
        """Attach the captures `session` has taken to the trie now (as `_close` would): from there the
        budget can demote them to disk or weigh them against other nodes, and other requests can
        restore from them. Only its prompt's restore points, and only between forwards."""
        slot = session.slot
        if not self.layers or slot.caches[self.layers[0]].capture_start > len(session.prompt):
            return  # a verify or drafter schedule of its own is under way: nothing of the session's
        captures = {i: slot.caches[i].take_captures() for i in self.layers}
        ends = [s.end for s in captures[self.layers[0]]]
        if not ends:
            return
        bounds = [session.stored, *ends]
        empty = [None] * len(ends)
        pieces = [[captures.get(i, empty)[k] for i in range(len(slot.caches))] for k in range(len(ends))]
        hidden = None
        if session.hidden_log:  # the log keeps the rows of the positions not stored yet
            rows, cut = torch.cat(session.hidden_log), ends[-1] - session.stored
            hidden, session.hidden_log = rows[:cut], [rows[cut:]]
        self._insert(session.prompt[: ends[-1]], bounds, pieces, hidden)
        session.stored = ends[-1]
        slot.live = session.prompt[: ends[-1]]  # on the live path: its state is in the live caches

    def _drop_hidden(self, session: Session) -> None:
        """Drop the hidden states of the nodes `session` stored so far."""
        with self.lock:
            for node in self.trie.match(session.prompt[: session.stored])[0]:
                if node.start >= session.cached:
                    node.hidden = None
                    self.budget.recount(node)

    def _close(self, session: Session) -> None:
        with self.lock:
            self._close_locked(session)
        if self.store is not None:
            publish_path(self, session.fed)

    def _close_locked(self, session: Session) -> None:
        slot = session.slot
        slot.reserved = 0
        self._store_captures(session)
        caches = slot.caches
        end = session.offset
        # The last piece (from the last capture to the end) and the hidden log are new bytes: room
        # first, while the captures still count as pending; what finds none is not kept.
        ends = [s.end for s in caches[self.layers[0]].captures()] if self.layers else []
        piece = self.budget.span_cost(ends[-1] if ends else session.stored, [end]) if self.layers else 0
        rows = tensor_bytes(*session.hidden_log) if session.hidden_log else 0
        last_piece = keep_rows = False
        if self.layers and end > (ends[-1] if ends else session.stored):
            if rows and self.eviction.make_room(piece + rows):
                last_piece = keep_rows = True
            else:
                last_piece = self.eviction.make_room(piece)
        elif rows:
            keep_rows = self.eviction.make_room(rows)
        hidden = torch.cat(session.hidden_log) if keep_rows else None
        # Every stateful layer was scheduled the same offsets, so their captures share bounds.
        captures = {i: caches[i].take_snapshots() for i in self.layers}
        bounds = [session.stored] + [s.end for s in captures.get(self.layers[0], [])] if self.layers else []
        pieces = [
            [captures[i][k] if i in captures else None for i in range(len(caches))]
            for k in range(len(bounds) - 1)
        ]
        if last_piece:
            pieces.append([c.snapshot(bounds[-1]) if c is not None else None for c in caches])
            bounds.append(end)
        elif hidden is not None:
            hidden = hidden[: bounds[-1] - session.stored]
        slot.live = list(session.fed)
        self._insert(session.fed, bounds, pieces, hidden)
        slot.session = None
        self.eviction.enforce_budget()

    def _abandon(self, session: Session) -> None:
        with self.lock:
            slot = session.slot
            slot.reserved = 0
            for i in self.layers:
                for snap in slot.caches[i].take_snapshots():
                    snap.free()
                slot.caches[i].free()
                slot.caches[i].record = True
            slot.live = []
            slot.session = None

    def _insert(
        self,
        fed: list[int],
        bounds: list[int],
        pieces: list[list[Snapshot | None]],
        hidden: torch.Tensor | None = None,
    ) -> None:
        """Attach pieces [bounds[k], bounds[k+1]) of `fed` below what the trie already stores;
        hidden: [bounds[-1] - bounds[0], d] the hidden log of those positions, or None."""
        path, stored = self.trie.match(fed)
        if path and stored < path[-1].end and path[-1].on_disk:
            # Splitting an edge on disk loads it: room first, beside the pieces in hand (counted
            # nowhere now); without room the pieces are not kept.
            held = sum(snap_bytes(s) for piece in pieces for s in piece if s is not None)
            held += 0 if hidden is None else tensor_bytes(hidden)
            if not self.eviction.make_room(path[-1].file_bytes + held, keep=frozenset(n.id for n in path)):
                for piece in pieces:
                    free_all(piece)
                return
            if not attached(path[-1]) or not self.tiers.load(path[-1]):
                # The edge to split is gone (deleted to make room, or unreadable): attach below what
                # the trie still holds instead.
                path, stored = self.trie.match(fed)
        if path and path[-1].start < stored < path[-1].end:
            parent = self.trie.split(path[-1], stored, self.caches)
            self.budget.recount(parent, path[-1])
        else:
            parent = path[-1] if path and stored == path[-1].end else self.trie.root
        for k, snaps in enumerate(pieces):
            lo, hi = bounds[k], bounds[k + 1]
            if hi <= stored:
                free_all(snaps)
                continue
            if lo < stored:
                kept = []
                for i, snap in enumerate(snaps):
                    if snap is None:
                        kept.append(None)
                        continue
                    left, right = self.caches[i].split(snap, stored)
                    left.free()
                    kept.append(right)
                snaps, lo = kept, stored
            if lo != parent.end:
                # Nodes this session's prefix ran through were evicted while the live caches kept
                # their state: the trie has nothing for [parent.end, lo) to hang these pieces from.
                for rest in (snaps, *pieces[k + 1 :]):
                    free_all(rest)
                break
            rows = None if hidden is None else hidden[lo - bounds[0] : hi - bounds[0]].clone()
            parent = self.trie.attach(parent, fed[lo:hi], snaps, rows)
            self.budget.recount(parent)
