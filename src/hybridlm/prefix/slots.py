"""The prefix cache's slots of live caches: one set of B = 1 caches of the model per open session,
the one a new session takes (`take`: the idle slot sharing most with its prompt, a new one while
fewer than `max_sessions` exist, else the oldest session's), and what the slots read of the trie:
the live paths they protect from eviction (`live_path`), the nodes whose rows open sessions read
(`locked`), and idle slots letting go of rows about to be freed (`unread`).

Owned by `PrefixCache` (cache.py); below the budget, the tiers and the eviction policy, which ask it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from hybridlm.cache.base import LayerCache
from hybridlm.cache.kv import KVCache
from hybridlm.prefix.session import Session, Slot, common_prefix
from hybridlm.prefix.trie import Node, Trie


class Slots:
    """The live caches of one model, `max_sessions` slots at most; iterating yields every `Slot`.

    on_forward(slot, tokens) is called as a forward of `tokens` tokens reaches a slot's first stateful
    layer, before any capture (the budget's room for the captures it will take)."""

    def __init__(self, model, trie: Trie, on_forward: Callable[[Slot, int], None]):
        self.model = model
        self.trie = trie
        self.on_forward = on_forward
        self.max_sessions = 1
        self._slots: list[Slot] = [self._new()]
        self.current = self._slots[0]  # the slot used last
        self._begun = 0

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    @property
    def caches(self) -> list[LayerCache | None]:
        """The live caches of the slot used last (with one slot: the live caches)."""
        return self.current.caches

    def _new(self) -> Slot:
        caches = self.model.make_caches(1)
        for cache in caches:
            if cache is not None:
                cache.record = True
                if isinstance(cache, KVCache):
                    cache.shares_restores = True  # sessions restoring one node read its rows once
        slot = Slot(caches)
        stateful = [c for c in caches if c is not None]
        if stateful:  # the first stateful layer is reached first in every forward
            stateful[0].on_forward = lambda tokens: self.on_forward(slot, tokens)
        return slot

    def reserve(self, sessions: int) -> None:
        """Allow `sessions` open sessions at once; slots are made when first needed."""
        self.max_sessions = max(self.max_sessions, sessions)

    def take(self, keep: list[int]) -> Slot:
        """A slot without an open session, preferring the one whose live path shares most with `keep`
        (its rewind is free); a new slot while below `max_sessions`; else the oldest open session is
        closed and its slot taken. It becomes the current slot."""
        self.current = self._pick(keep)
        return self.current

    def _pick(self, keep: list[int]) -> Slot:
        idle = [s for s in self._slots if s.session is None]
        if idle:
            best = max(idle, key=lambda s: common_prefix(s.live, keep))
            if common_prefix(best.live, keep) > 0 or len(self._slots) >= self.max_sessions:
                return best
        if len(self._slots) < self.max_sessions:
            self._slots.append(self._new())
            return self._slots[-1]
        if idle:
            return idle[0]
        oldest = min(self._slots, key=lambda s: s.opened)
        oldest.session.close()
        return oldest

    def open(self, slot: Slot, session: Session) -> None:
        """`session` now uses `slot` (the newest open session: the last a full house closes)."""
        slot.session = session
        self._begun += 1
        slot.opened = self._begun

    def _read_sources(self, busy: bool) -> set[int]:
        """Ids of the trie snapshots whose rows slots read as segments (copy-on-write restores): slots
        with an open session (`busy`), or idle ones."""
        return {
            id(seg.source)
            for slot in self._slots
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

    def unread(self, node: Node) -> None:
        """Before `node`'s snapshots are freed or replaced: idle slots reading their rows drop their
        live state (they would keep the rows alive outside the budget; the trie still has the rest)."""
        ours = {id(s) for s in node.snaps if getattr(s, "readers", 0)}
        if not ours or not ours & self._read_sources(busy=False):
            return
        for slot in self._slots:
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
        return {n.id for slot in self._slots for n in self.trie.match(slot.live)[0]}
