"""The prefix cache's recorder (`Recorder`): what a session computes goes into the trie. Room is made
for a forward's captures before it takes them (`before_forward`); the prompt's restore points are
attached between forwards when the budget needs them there (`store_captures`, also before a fork);
a closing session attaches its captures and last piece (`close`, `insert`) or an abandoned one
drops them (`abandon`). With a shared store, the edges of a longer prefix another replica computed
are read into the trie before a restore (`import_longer`), and a closed session's path is
published to it (`publish_path`).

Owned by `PrefixCache` (cache.py); the restorer asks it before a begin and a fork.
"""

from __future__ import annotations

import torch

from hybridlm.cache.base import Snapshot, tensor_bytes
from hybridlm.prefix.accounting import RamBudget
from hybridlm.prefix.eviction import Eviction
from hybridlm.prefix.session import Session, Slot, attached, free_all, snap_bytes
from hybridlm.prefix.slots import Slots
from hybridlm.prefix.store import StoreTier, common_length, layer_fields, prefix_keys
from hybridlm.prefix.tiers import Tiers
from hybridlm.prefix.trie import Trie


class Recorder:
    """Records into the trie what sessions compute (their captures, their last pieces) and the edges
    the shared store holds (`store`: that tier, or None), and publishes what was recorded to it."""

    def __init__(
        self,
        model,
        lock,
        trie: Trie,
        slots: Slots,
        budget: RamBudget,
        eviction: Eviction,
        tiers: Tiers,
        layers: list[int],
        store: StoreTier | None,
    ):
        self.model = model
        self.lock = lock
        self.trie = trie
        self.slots = slots
        self.budget = budget
        self.eviction = eviction
        self.tiers = tiers
        self.layers = layers
        self.store = store

    def before_forward(self, slot: Slot, tokens: int) -> None:
        """A forward of `tokens` tokens reaches `slot`'s caches: room is made for the captures it will
        take (when there is none beside the session's earlier captures, those go to the trie first,
        `store_captures`, where the budget can demote them) — whole if demoting and compacting
        other nodes makes it (their scan-input logs are worth less than any node), else in their
        compact form (`LayerCache.lean`: no scan-input log, so they restore only to their ends),
        deleting nodes as `Eviction.enforce_budget` does. Captures that fit neither way are
        unscheduled in every layer (the next capture spans them), the earliest first: restore points
        near the prompt's end matter most."""
        session = slot.session
        if session is None or session.closed or self.budget.bound is None:
            return
        with self.lock:
            slot.reserved = 0  # a previous forward's captures, if any, are counted by now
            first = slot.caches[self.layers[0]]
            ends = [o for o in first.capture_ends(tokens) if o <= len(session.prompt)]
            if ends and not self.eviction.make_room(
                self.budget.span_cost(first.capture_start, ends), captures=False
            ):
                self.store_captures(session)  # no room beside them: make them nodes the budget can demote
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

    def store_captures(self, session: Session) -> None:
        """Attach the captures `session` has taken to the trie now (as `close` would): from there the
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
        self.insert(session.prompt[: ends[-1]], bounds, pieces, hidden)
        session.stored = ends[-1]
        slot.live = session.prompt[: ends[-1]]  # on the live path: its state is in the live caches

    def drop_hidden(self, session: Session) -> None:
        """Drop the hidden states of the nodes `session` stored so far."""
        with self.lock:
            for node in self.trie.match(session.prompt[: session.stored])[0]:
                if node.start >= session.cached:
                    node.hidden = None
                    self.budget.recount(node)

    def close(self, session: Session) -> None:
        """Attach what `session` computed to the trie and keep the budget; then publish its path to
        the shared store, outside the lock."""
        with self.lock:
            self._close_locked(session)
        if self.store is not None:
            self.publish_path(session.fed)

    def _close_locked(self, session: Session) -> None:
        slot = session.slot
        slot.reserved = 0
        self.store_captures(session)
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
        self.insert(session.fed, bounds, pieces, hidden)
        slot.session = None
        self.eviction.enforce_budget()

    def abandon(self, session: Session) -> None:
        """Drop what `session` computed and reset its slot's live caches (the trie keeps what it
        stored before)."""
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

    def insert(
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
            parent = self.trie.split(path[-1], stored, self.slots.caches)
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
                    left, right = self.slots.caches[i].split(snap, stored)
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

    def import_longer(self, keep: list[int]) -> int:
        """Before a restore: when the store holds a longer prefix of `keep` than the trie, read the
        edges the trie lacks and attach them (as a session's pieces are attached), so the ordinary
        restore plan uses them. Edges are read in order up to the first that fails. Returns the number
        of tokens the store added to the trie's match."""
        store = self.store
        _, matched = self.trie.match(keep)
        edges = store.find(keep)
        if not edges:
            return 0
        last = edges[-1]
        reach = last.start + common_length(last.tokens, keep[last.start :])
        if reach <= matched:
            return 0
        wanted = layer_fields(self.slots.caches, self.layers)
        bounds, pieces, fed = [], [], []
        on_path = frozenset(n.id for n in self.trie.match(keep)[0])
        reserved = 0  # the edges read so far are counted nowhere yet: room for them all, and the next
        for edge in edges:
            if edge.end <= matched:
                continue
            reserved += self.budget.span_cost(edge.start, [edge.end])
            if not self.eviction.make_room(reserved, keep=on_path):
                break
            snaps = store.fetch(edge, wanted, self.model.device)
            if snaps is None:
                break
            store.remember(edge.parent, edge.key)
            if not bounds:
                bounds, fed = [edge.start], list(keep[: edge.start])
            pieces.append([snaps.get(i) for i in range(len(self.slots.caches))])
            bounds.append(edge.end)
            fed.extend(edge.tokens)
        if not pieces:
            return 0
        self.insert(fed, bounds, pieces)
        _, now_matched = self.trie.match(keep)
        return max(0, now_matched - matched)

    def publish_path(self, fed: list[int]) -> None:
        """After a session: queue every RAM node along `fed` that the store does not have from this
        replica yet, and tell the router that this replica holds those prefixes."""
        store = self.store
        path, matched = self.trie.match(fed)
        nodes = [n for n in path if n.end <= matched]
        if not nodes:
            return
        keys = prefix_keys(store.fingerprint, fed, [0] + [n.end for n in nodes])
        for node in nodes:
            parent, key = keys[node.start], keys[node.end]
            if node.on_disk or store.known(parent, key):
                continue
            store.put(parent, key, node.start, node.tokens, {i: node.snaps[i] for i in self.layers})
        store.publish([keys[n.end] for n in nodes])
