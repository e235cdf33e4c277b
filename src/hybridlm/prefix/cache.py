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

Parts, one job each, that `PrefixCache` owns: objects it makes on construction, each handed the
parts it works with, all made before it, so references point one way: `slots.py` the slots of live
caches and what they read of the trie (`Slots`); `accounting.py` the bytes counted against the RAM
budget (`RamBudget`); `tiers.py` moving nodes between RAM and disk, and out of the trie (`Tiers`);
`eviction.py` the policy that keeps the budgets (`Eviction`); `record.py` what sessions compute,
into the trie, and the shared store's edges (`Recorder`); `restore.py` begin and fork (`Restorer`,
also handed the cache itself: its sessions' owner). A forward reaching a slot's caches calls the
recorder through the cache (the slots come first). `session.py` holds what they share (`Session`,
`Slot`, capture plan and costs, byte counts). This file holds the construction and the surface the
engine, the sessions, the server and /metrics use.

Restore of layer l to target t along path nodes n_0..n_k (each covering [start, end)): start from
the deepest node whose start the cache can already reach — a live rewind inside the common prefix
with the live path, or the previous node's snapshot if it stands alone at its end (a recurrent
checkpoint, sliding rows covering the window) — then restore each node to its end, the last to t
(recurrent layers replay their scan-input log for the last stretch).
"""

from __future__ import annotations

import threading

from hybridlm.cache.base import LayerCache
from hybridlm.prefix.accounting import RamBudget
from hybridlm.prefix.disk import DiskTier
from hybridlm.prefix.eviction import Eviction
from hybridlm.prefix.record import Recorder
from hybridlm.prefix.restore import Restorer
from hybridlm.prefix.session import CacheStats, CapturePlan, Session, Slot, capture_costs, common_prefix
from hybridlm.prefix.slots import Slots
from hybridlm.prefix.store import StoreTier
from hybridlm.prefix.tiers import Tiers
from hybridlm.prefix.trie import Trie

# Importers of the cache reach its session types and helpers here too.
__all__ = ["CacheStats", "CapturePlan", "PrefixCache", "Session", "Slot", "capture_costs", "common_prefix"]


class PrefixCache:
    """The shared trie plus the live caches of one model: `reserve(n)` slots of live caches, one per
    open session (a begin beyond them closes the oldest open session).

    ram_budget: bytes of snapshots held in host memory (None: unbounded). disk: an optional
    `DiskTier` (a directory with its own byte budget) for demoted nodes; the files it already holds
    for this model are adopted on construction (restart reuse). store: an optional `StoreTier` (a
    Valkey / Redis server shared by replicas): a prefix the trie lacks is read from it before a
    restore, and what a session computed is written to it after. draft: a speculative draft model
    (`CausalLM`) whose caches sessions restore too (`Session.draft`), within the same `ram_budget`.
    parent: set on that draft companion only (the target's cache, made with `draft=`).

    The RAM budget holds at every instant: whatever adds snapshot bytes makes room first (see
    `RamBudget`). `lock` guards the trie: the engine thread holds it while it changes the cache,
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
        parent: PrefixCache | None = None,
    ):
        self.model = model
        # A draft companion shares its target's lock: one holder changes either trie at a time.
        self.lock = threading.RLock() if parent is None else parent.lock
        costs = capture_costs(model)
        self.trie = Trie()
        # A forward reaching a slot's caches makes room for its captures first (`before_forward`); the
        # recorder is made below, from these slots, hence the late lookup.
        self.slots = Slots(model, self.trie, lambda slot, tokens: self.recorder.before_forward(slot, tokens))
        self.layers = [i for i, c in enumerate(self.caches) if c is not None]
        target = None if parent is None else parent.budget
        self.budget = RamBudget(self.lock, self.slots, self.layers, costs, ram_budget, target)
        self.plan = plan or CapturePlan()
        self.stats = CacheStats()
        self.disk = disk
        self.store = store
        self.tiers = Tiers(model, self.trie, self.slots, self.budget, self.stats, self.layers, disk)
        self.draft = None if draft is None else PrefixCache(draft, ram_budget, self.plan, parent=self)
        if self.draft is not None:
            self.budget.draft = self.draft.budget
        self.eviction = Eviction(
            self.lock,
            self.trie,
            self.slots,
            self.budget,
            self.tiers,
            self.stats,
            self.layers,
            disk,
            None if self.draft is None else self.draft.eviction,
        )
        self.recorder = Recorder(
            model,
            self.lock,
            self.trie,
            self.slots,
            self.budget,
            self.eviction,
            self.tiers,
            self.layers,
            store,
        )
        self.restorer = Restorer(
            self,
            self.trie,
            self.slots,
            self.recorder,
            self.eviction,
            self.tiers,
            self.stats,
            self.plan,
            self.layers,
            store,
            self.draft,
        )
        if disk is not None:
            self.tiers.adopt()
            self.eviction.enforce_budget()

    def begin(self, tokens: list[int], draft: bool = False) -> Session:
        """Restore the longest stored prefix of `tokens` (keeping ≥ 1 token to evaluate); with
        `draft` and a draft companion, also the draft model's caches (`Session.draft`)."""
        if not tokens:
            raise ValueError("a session needs at least one token")
        with self.lock:
            return self.restorer.begin(tokens, draft)

    def fork(self, session: Session) -> Session:
        """A session for another choice of `session`'s request (n > 1), whose prefill has just ended,
        in a slot of its own brought to the same state (`Restorer.fork`)."""
        with self.lock:
            return self.restorer.fork(session)

    def _close(self, session: Session) -> None:
        """`Session.close`: attach what `session` computed to the trie (`Recorder.close`)."""
        self.recorder.close(session)

    def _abandon(self, session: Session) -> None:
        """`Session.abandon`: drop what `session` computed (`Recorder.abandon`)."""
        self.recorder.abandon(session)

    def _drop_hidden(self, session: Session) -> None:
        """`Session.advance` without hidden states: drop those of the nodes `session` stored so far."""
        self.recorder.drop_hidden(session)

    def keep_budget(self) -> None:
        """`Session.advance` after a prefill forward: evict if what is counted exceeds the RAM budget
        (`Eviction.keep_budget`)."""
        self.eviction.keep_budget()

    def enforce_budget(
        self, reserve: int = 0, keep: frozenset[int] = frozenset(), delete: bool = True
    ) -> None:
        """Keep the snapshots inside both budgets, with room for `reserve` more bytes in RAM, never
        evicting the nodes with ids in `keep` (without `delete`: as far as demoting and compacting go);
        see `Eviction.enforce_budget`."""
        self.eviction.enforce_budget(reserve, keep, delete)

    def persist(self) -> int:
        """Write every node held in RAM to the disk tier, most valuable first, as far as the disk
        budget allows (e.g. at shutdown, so that a restart over the same directory reuses them).
        Returns the number of nodes written."""
        return self.tiers.persist()

    @property
    def caches(self) -> list[LayerCache | None]:
        """The live caches of the slot used last (with one slot: the live caches)."""
        return self.slots.caches

    @property
    def live(self) -> list[int]:
        """The tokens `caches` hold."""
        return self.slots.current.live

    def reserve(self, sessions: int) -> None:
        """Allow `sessions` open sessions at once (an engine running that many sequences); slots are
        made when first needed. The draft companion follows."""
        self.slots.reserve(sessions)
        if self.draft is not None:
            self.draft.reserve(sessions)

    def live_path(self) -> set[int]:
        """Ids of the nodes on every slot's live path (protected from eviction)."""
        return self.slots.live_path()

    @property
    def ram_budget(self) -> int | None:
        """Bytes of snapshots held in host memory (None: unbounded); set it, then `enforce_budget`."""
        return self.budget.ram_budget

    @ram_budget.setter
    def ram_budget(self, nbytes: int | None) -> None:
        self.budget.ram_budget = nbytes

    @property
    def nbytes(self) -> int:
        """Bytes counted against the RAM budget: the trie's RAM snapshots (lazy ones at the size of
        their rows) plus the running prefills' captures not yet kept."""
        return self.budget.nbytes

    @property
    def ram_bytes(self) -> int:
        """Bytes counted against the RAM budget: `nbytes` plus the draft companion's."""
        return self.budget.ram_bytes

    @property
    def pending_bytes(self) -> int:
        """Bytes of captures the running requests have taken and not yet handed to the trie."""
        return self.budget.pending_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes the running requests hold outside the RAM budget (the draft companion's included)."""
        return self.budget.pinned_bytes

    @property
    def released_bytes(self) -> int:
        """Bytes the trie (and its draft companion's) stopped counting since it was made, ever growing."""
        return self.budget.released_bytes

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
