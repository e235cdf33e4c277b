"""`PrefixCache`: one trie for every conversation, one live path in the model's caches.

`begin(tokens)` restores the longest stored prefix — ending at any token, for every layer kind —
into the live caches and returns a `Session`; the engine prefills the rest and decodes through
the session, which records the tokens fed; `session.close()` attaches what was computed (also
for a cancelled request) and keeps the byte budgets.

Tiers: snapshots live in host RAM under `ram_budget`; with a `DiskTier`, nodes are demoted to one
safetensors file each instead of being deleted, loaded back (promoted) when a restore uses them, and
a new PrefixCache over the same directory and model rebuilds the trie from the files.

Draft companion: with `draft=` (a speculative draft model), a second PrefixCache over the draft model
keeps the draft's snapshots in a trie of its own (RAM only, no disk tier) and each session opens a
draft session beside the target's (`session.draft`), so a hit restores the draft model's caches too
and the drafter feeds only what they lack. The target plans exactly as without it; the draft gets
only the RAM the target's snapshots leave in `ram_budget` (its nodes are evicted first).

Hidden log: a session whose every forward was handed the target's final-normed hidden states
(`advance(ids, hidden)`, an MTP drafter is reading them) stores them in the nodes it attaches
(`Node.hidden`, counted in the RAM budget); a hit whose restored prefix has them for every position
hands them to the session (`Session.hidden`), so an MTP head can rebuild its context. The disk tier
does not keep them (a demoted node's hidden log is dropped).

Rooms, one job each, that `PrefixCache` is built from (sharing the state its `__init__` declares):
`walk.py` matches and restores on begin and records on close; `accounting.py` counts bytes against
the budget; `eviction.py` is the policy that keeps it; `tiers.py` moves nodes between RAM and disk.
`session.py` holds what they share (`Session`, `Slot`, capture plan and costs, byte counts). This
file holds the construction and the slots of live caches.

Restore of layer l to target t along path nodes n_0..n_k (each covering [start, end)): start from
the deepest node whose start the cache can already reach — a live rewind inside the common prefix
with the live path, or the previous node's snapshot if it stands alone at its end (a recurrent
checkpoint, sliding rows covering the window) — then restore each node to its end, the last to t
(recurrent layers replay their scan-input log for the last stretch).
"""

from __future__ import annotations

import threading

from hybridlm.cache.base import LayerCache
from hybridlm.cache.kv import KVCache
from hybridlm.prefix.accounting import Accounting
from hybridlm.prefix.disk import DiskTier
from hybridlm.prefix.eviction import Eviction
from hybridlm.prefix.session import CacheStats, CapturePlan, Session, Slot, capture_costs, common_prefix
from hybridlm.prefix.store import StoreTier
from hybridlm.prefix.tiers import Tiers
from hybridlm.prefix.trie import Trie
from hybridlm.prefix.walk import Walk

# Importers of the cache reach its session types and helpers here too.
__all__ = ["CacheStats", "CapturePlan", "PrefixCache", "Session", "Slot", "capture_costs", "common_prefix"]


class PrefixCache(Walk, Accounting, Eviction, Tiers):
    """The shared trie plus the live caches of one model: `max_sessions` slots of live caches, one per
    open session (a begin beyond them closes the oldest open session).

    ram_budget: bytes of snapshots held in host memory (None: unbounded). disk: an optional
    `DiskTier` (a directory with its own byte budget) for demoted nodes; the files it already holds
    for this model are adopted on construction (restart reuse). store: an optional `StoreTier` (a
    Valkey / Redis server shared by replicas): a prefix the trie lacks is read from it before a
    restore, and what a session computed is written to it after. draft: a speculative draft model
    (`CausalLM`) whose caches sessions restore too (`Session.draft`), within the same `ram_budget`.

    The RAM budget holds at every instant: whatever adds snapshot bytes makes room first (see
    "accounting"). `lock` guards the trie: the engine thread holds it while it changes the cache,
    and a reader on another thread (/metrics) takes it to see a consistent total.
    """

    def __init__(
        self,
        model,
        ram_budget: int | None = None,
        plan: CapturePlan | None = None,
        disk: DiskTier | None = None,
        draft=None,
        store: StoreTier | None = None,
    ):
        self.model = model
        self.lock = threading.RLock()
        self.parent: PrefixCache | None = None  # set on a draft companion: the target's cache
        self.costs = capture_costs(model)
        self.max_sessions = 1
        self.slots: list[Slot] = [self._new_slot()]
        self._current = self.slots[0]
        self._begun = 0
        self.layers = [i for i, c in enumerate(self.caches) if c is not None]
        self.trie = Trie()
        # What each trie node counts against the RAM budget (`budgeted`), and their sum: kept as nodes
        # change (`_recount`), so the budget checks every forward makes cost O(1), not a walk of the
        # whole trie (thousands of nodes after hours of traffic).
        self._counted: dict[int, int] = {}
        self._trie_bytes = 0
        self._released = 0  # bytes nodes stopped counting, ever (`released_bytes`)
        self._compacted: set[int] = set()  # nodes whose snapshots compacting cannot shrink any more
        self.ram_budget = ram_budget
        self.plan = plan or CapturePlan()
        self.stats = CacheStats()
        self.disk = disk
        self.store = store
        self.draft = None if draft is None else PrefixCache(draft, ram_budget, self.plan)
        if self.draft is not None:
            self.draft.parent, self.draft.lock = self, self.lock
        if disk is not None:
            self._adopt()
            self.enforce_budget()

    def _new_slot(self) -> Slot:
        caches = self.model.make_caches(1)
        for cache in caches:
            if cache is not None:
                cache.record = True
                if isinstance(cache, KVCache):
                    cache.shares_restores = True  # sessions restoring one node read its rows once
        slot = Slot(caches)
        stateful = [c for c in caches if c is not None]
        if stateful:  # the first stateful layer is reached first in every forward
            stateful[0].on_forward = lambda tokens: self._before_forward(slot, tokens)
        return slot

    @property
    def caches(self) -> list[LayerCache | None]:
        """The live caches of the slot used last (with one slot: the live caches)."""
        return self._current.caches

    @property
    def live(self) -> list[int]:
        """The tokens `caches` hold."""
        return self._current.live

    def reserve(self, sessions: int) -> None:
        """Allow `sessions` open sessions at once (an engine running that many sequences); slots are
        made when first needed. The draft companion follows."""
        self.max_sessions = max(self.max_sessions, sessions)
        if self.draft is not None:
            self.draft.reserve(sessions)

    def _slot_for(self, keep: list[int]) -> Slot:
        """A slot without an open session, preferring the one whose live path shares most with `keep`
        (its rewind is free); a new slot while below `max_sessions`; else the oldest open session is
        closed and its slot taken."""
        idle = [s for s in self.slots if s.session is None]
        if idle:
            best = max(idle, key=lambda s: common_prefix(s.live, keep))
            if common_prefix(best.live, keep) > 0 or len(self.slots) >= self.max_sessions:
                return best
        if len(self.slots) < self.max_sessions:
            self.slots.append(self._new_slot())
            return self.slots[-1]
        if idle:
            return idle[0]
        oldest = min(self.slots, key=lambda s: s.opened)
        oldest.session.close()
        return oldest
