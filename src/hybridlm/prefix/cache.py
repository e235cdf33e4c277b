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

Restore of layer l to target t along path nodes n_0..n_k (each covering [start, end)): start from
the deepest node whose start the cache can already reach — a live rewind inside the common prefix
with the live path, or the previous node's snapshot if it stands alone at its end (a recurrent
checkpoint, sliding rows covering the window) — then restore each node to its end, the last to t
(recurrent layers replay their scan-input log for the last stretch).
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from dataclasses import dataclass, field

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache, Snapshot, tensor_bytes
from hybridlm.cache.fork import fork_caches
from hybridlm.cache.kv import KVCache, RowsSnapshot, held_bytes
from hybridlm.cache.recurrent import ScanCache, ScanSnapshot
from hybridlm.prefix.disk import CorruptFile, DiskTier, StoredNode, StoredSnapshot, monotonic_of, wall_clock
from hybridlm.prefix.store import StoreTier, import_longer, publish_path
from hybridlm.prefix.trie import Node, Trie

log = logging.getLogger(__name__)

RESET = "reset"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class CacheStats:
    """Counters for /metrics (bytes and node counts per tier are properties of `PrefixCache`).

    evicted_nodes: deleted for the RAM budget; disk_writes: nodes demoted to disk instead; disk_reads:
    nodes loaded back; disk_evicted_nodes: deleted for the disk budget (or to make room on it);
    disk_errors: files found unusable (ignored at start-up, or failing when read)."""

    hits: int = 0
    misses_no_prefix: int = 0
    misses_unrestorable: int = 0
    evicted_nodes: int = 0
    compacted_snapshots: int = 0
    disk_writes: int = 0
    disk_written_bytes: int = 0
    disk_reads: int = 0
    disk_read_bytes: int = 0
    disk_evicted_nodes: int = 0
    disk_errors: int = 0


@dataclass
class CapturePlan:
    """Where restore points go inside a prompt (absolute offsets are derived per request).

    cadence: a checkpoint every `cadence` tokens bounds replay; tail: checkpoints this many tokens
    before the prompt end, where chat templates later rewrite history."""

    cadence: int = 256
    tail: tuple[int, ...] = (1, 8, 32)

    def offsets(self, start: int, prompt_len: int) -> list[int]:
        points = set(range(start - start % self.cadence + self.cadence, prompt_len, self.cadence))
        points.add(prompt_len)
        points.update(prompt_len - t for t in self.tail)
        return sorted(p for p in points if start < p <= prompt_len)


@dataclass(frozen=True)
class CaptureCost:
    """What a snapshot of one stateful layer covering `span` tokens counts against the RAM budget at
    most: `fixed` (a checkpoint: conv tail, recurrent state) + `per_token` × span (KV rows, scan-input
    log); `lean_per_token` for its compact form (`LayerCache.compact`: no log; sliding rows at most
    the span). Exact for a snapshot with every part; less for one that lacks some."""

    fixed: int
    per_token: int
    lean_per_token: int

    def bytes(self, span: int, lean: bool = False) -> int:
        return self.fixed + (self.lean_per_token if lean else self.per_token) * span


def capture_costs(model) -> dict[int, CaptureCost]:
    """Each stateful layer's `CaptureCost`, measured once on `model` itself (whatever its cache kinds,
    shapes and dtypes): fresh caches take range captures of 1 and 2 tokens from a 3-token forward,
    then compact them."""
    caches = model.make_caches(1)
    layers = [i for i, c in enumerate(caches) if c is not None]
    for i in layers:
        caches[i].prepare_snapshots([1, 3], ranges=True)
    with torch.no_grad():
        model(Batch.single([0, 0, 0], device=model.device), caches)
    costs = {}
    for i in layers:
        one, two = caches[i].take_snapshots()
        full = [_snap_bytes(one), _snap_bytes(two)]
        one, two = caches[i].compact(one), caches[i].compact(two)
        lean = [_snap_bytes(one), _snap_bytes(two)]
        per_token, lean_per_token = max(full[1] - full[0], 0), max(lean[1] - lean[0], 0)
        fixed = max(full[0] - per_token, lean[0] - lean_per_token, 0)
        costs[i] = CaptureCost(fixed, per_token, lean_per_token)
        one.free()
        two.free()
        caches[i].free()
    return costs


@dataclass
class Slot:
    """One set of live caches and the tokens they hold (a root→frontier path of the trie); `session`
    is the open session using them (None: idle, its live path kept for a later rewind)."""

    caches: list[LayerCache | None]
    live: list[int] = field(default_factory=list)
    session: Session | None = None
    opened: int = 0  # when its session began (begin count): the oldest is closed when none is free
    reserved: int = 0  # bytes its forward in flight may still capture (made room for beforehand)


@dataclass
class Session:
    """One request's use of a slot's live caches: restored to `cached`, then advanced by the engine."""

    owner: PrefixCache
    slot: Slot
    prompt: list[int]
    cached: int
    replayed: int
    restore_ms: float
    fed: list[int] = field(default_factory=list)
    closed: bool = False
    draft: Session | None = None  # the draft companion's session, its caches restored to `draft.offset`
    # [cached, d] the target's hidden states at the restored positions, when the trie has them all.
    hidden: torch.Tensor | None = None
    # The hidden states of the positions fed since `stored`, while every forward came with them.
    hidden_log: list[torch.Tensor] | None = field(default_factory=list)
    stored: int = -1  # the trie holds its captures up to here (set to `cached` by begin)

    @property
    def caches(self) -> list[LayerCache | None]:
        return self.slot.caches

    @property
    def offset(self) -> int:
        return len(self.fed)

    @property
    def remaining(self) -> list[int]:
        """Prompt tokens still to prefill (at least one: it seeds decoding)."""
        return self.prompt[self.offset :]

    def advance(self, ids: list[int], hidden: torch.Tensor | None = None) -> None:
        """Record tokens just fed through the model (call after each forward); hidden: [len(ids), d]
        the target's final-normed hidden states there, if computed (stored with the nodes only when
        every forward of the session came with them)."""
        self.fed.extend(ids)
        self.slot.reserved = 0  # its captures are in `pending_bytes` now
        if self.offset <= len(self.prompt):  # prefill: its forwards take captures
            self.owner.keep_budget()
        if hidden is None or len(hidden) != len(ids):
            if self.hidden_log is not None and self.stored > self.cached:
                self.owner._drop_hidden(self)  # all of the session's nodes have them, or none
            self.hidden_log = None
        elif self.hidden_log is not None:
            self.hidden_log.append(hidden)

    def close(self) -> None:
        """Attach what this session computed to the trie and keep the budget."""
        if not self.closed:
            self.closed = True
            if self.draft is not None:
                self.draft.close()
            self.owner._close(self)

    def abandon(self) -> None:
        """Drop this session's work and reset the live caches (after a failed forward, whose
        layers may stand at different offsets); the trie keeps everything stored before."""
        if not self.closed:
            self.closed = True
            if self.draft is not None:
                self.draft.abandon()
            self.owner._abandon(self)


class PrefixCache:
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

    # ---- slots ---------------------------------------------------------------------------
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

    # ---- accounting ----------------------------------------------------------------------
    # The RAM budget holds at every instant, during requests too: everything that adds counted bytes
    # makes room for an upper bound of them first (evicting, compacting, or adding less).
    # - A forward's captures: as it reaches a slot's first stateful layer (`_before_forward`, before
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
    @property
    def nbytes(self) -> int:
        """Bytes counted against the RAM budget: the trie's RAM snapshots (lazy ones at the size of
        their rows) plus the running prefills' captures not yet kept."""
        with self.lock:
            return self._trie_bytes + self.pending_bytes

    def _recount(self, *nodes: Node) -> None:
        """Update what `nodes` count against the RAM budget after their snapshots, hidden log or tier
        changed (a node out of the trie counts 0). Every change to a trie node's snapshots goes
        through here: a snapshot's count never changes on its own (a lazy one counts its rows' size
        before its copy-out as after)."""
        for node in nodes:
            self._compacted.discard(node.id)
            now = budgeted(node) if _attached(node) else 0
            before = self._counted.pop(node.id, 0)
            self._trie_bytes += now - before
            self._released += max(0, before - now)
            if now:
                self._counted[node.id] = now

    @property
    def released_bytes(self) -> int:
        """Bytes the trie (and its draft companion's) stopped counting since it was made: snapshots
        freed, compacted or moved to disk, as a count that only grows (`engine.memory.HeapTrimmer`
        reads it)."""
        return self._released + (0 if self.draft is None else self.draft.released_bytes)

    def _counted_bytes(self, node: Node) -> int:
        """What `node` counts against the RAM budget now (`budgeted(node)`, kept by `_recount`)."""
        return self._counted.get(node.id, 0)

    def _session_captures(self, slot: Slot) -> tuple[list[Snapshot], list[Snapshot]]:
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
            return sum(_snap_bytes(s) for slot in self.slots for s in self._session_captures(slot)[0])

    @property
    def pinned_bytes(self) -> int:
        """Bytes the running requests hold outside the RAM budget: every slot's live caches, working
        restore points and hidden log (and the draft companion's); KV rows slots share (forks of one
        prompt, copy-on-write) are counted once."""
        with self.lock:
            own = held_bytes([c for slot in self.slots for c in slot.caches])
            for slot in self.slots:
                own += sum(_snap_bytes(s) for s in self._session_captures(slot)[1])
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

    def _limit(self) -> int:
        """What this cache's snapshots may count: the RAM budget, or for a draft companion what its
        target's snapshots and reservations leave of it."""
        if self.parent is None:
            return self.ram_budget
        target = self.parent
        return max(0, target.ram_budget - target.nbytes - sum(slot.reserved for slot in target.slots))

    def span_cost(self, start: int, ends: list[int], lean: bool = False) -> int:
        """Most bytes the captures ending at `ends` (the first beginning at `start`) count, over
        every stateful layer (`lean`: in their compact form)."""
        spans = [b - a for a, b in zip([start, *ends], ends, strict=False)]
        return sum(self.costs[i].bytes(n, lean) for i in self.layers for n in spans)

    def make_room(
        self, nbytes: int, keep: frozenset[int] = frozenset(), delete: bool = True, captures: bool = True
    ) -> bool:
        """Evict (as `enforce_budget` does, never the nodes with ids in `keep`; without `delete` only
        by demoting and compacting) and, if need be and `captures`, compact the running prefills'
        captures, until `nbytes` more fit the RAM budget beside what is counted and reserved; False
        when they cannot (then nothing more should be added)."""
        with self.lock:
            if self._budget() is None:
                return True
            self.enforce_budget(reserve=nbytes, keep=keep, delete=delete)
            if captures and self._over(nbytes):
                for slot in self.slots:
                    for i in self.layers:
                        slot.caches[i].compact_captures()
            return not self._over(nbytes)

    def _budget(self) -> int | None:
        return self.ram_budget if self.parent is None else self.parent.ram_budget

    def _over(self, extra: int = 0) -> bool:
        """Whether counted + reserved + `extra` bytes exceed what this cache may hold."""
        counted = self.ram_bytes if self.parent is None else self.nbytes
        return counted + self.reserved_bytes + extra > self._limit()

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
        if session is None or session.closed or self._budget() is None:
            return
        with self.lock:
            slot.reserved = 0  # a previous forward's captures, if any, are counted by now
            first = slot.caches[self.layers[0]]
            ends = [o for o in first.capture_ends(tokens) if o <= len(session.prompt)]
            if ends and not self.make_room(self.span_cost(first.capture_start, ends), captures=False):
                self._store_captures(session)  # no room beside them: make them nodes the budget can demote
            while ends:
                full = self.span_cost(first.capture_start, ends)
                # Whole: by demoting and compacting; by deleting too if it takes at most half the budget
                # (a bigger one would delete the session's own earlier nodes). Else compact.
                tries = [(False, False), (False, 2 * full <= self._limit()), (True, True)]
                for lean, delete in tries:
                    need = self.span_cost(first.capture_start, ends, lean)
                    if self.make_room(need, delete=delete):
                        for i in self.layers:
                            slot.caches[i].lean = lean
                        slot.reserved = need
                        return
                for i in self.layers:
                    slot.caches[i].unschedule(ends[:1])
                ends = ends[1:]

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

    # ---- begin: match and restore --------------------------------------------------------
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
        slot = self._current = self._slot_for(keep)
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
        session.hidden = _hidden_prefix(path, target)
        slot.session = session
        self._begun += 1
        slot.opened = self._begun
        if draft and self.draft is not None:
            session.draft = self.draft.begin(tokens)
        offsets = self.plan.offsets(target, len(tokens))
        for i in self.layers:
            slot.caches[i].prepare_snapshots(offsets, ranges=True)
            slot.caches[i].lean = False
        # Nodes loaded from disk (and rows copied out of the live buffers) may have grown RAM.
        self.enforce_budget()
        return session

    def fork(self, session: Session) -> Session:
        """A session for another choice of `session`'s request (n > 1), whose prefill has just
        ended: a slot of its own brought to the same state (`fork_caches`: KV rows shared copy-on-
        write, recurrent state copied). The prompt's restore points go to the trie first, so every
        choice's continuation attaches below the prompt's node when its session closes."""
        with self.lock:
            self._store_captures(session)
            slot = self._current = self._slot_for(session.fed)
            fork_caches(session.caches, slot.caches)
            slot.live = list(session.fed)
            end = len(session.fed)
            fork = Session(self, slot, list(session.prompt), end, 0, 0.0, list(session.fed), stored=end)
            slot.session = fork
            self._begun += 1
            slot.opened = self._begun
            for i in self.layers:
                slot.caches[i].prepare_snapshots([], ranges=True)
                slot.caches[i].lean = False
            self.enforce_budget()  # rows copied out of the slot's buffers count now
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
                if not self.make_room(node.file_bytes, keep=on_path):
                    keep = keep[: node.start]
                    break
                # Making room on disk may have deleted it (a disk leaf worth less): match again.
                if not _attached(node) or not self._load(node):
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

    # ---- close: attach and evict ---------------------------------------------------------
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
                    self._recount(node)

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
        piece = self.span_cost(ends[-1] if ends else session.stored, [end]) if self.layers else 0
        rows = tensor_bytes(*session.hidden_log) if session.hidden_log else 0
        last_piece = keep_rows = False
        if self.layers and end > (ends[-1] if ends else session.stored):
            if rows and self.make_room(piece + rows):
                last_piece = keep_rows = True
            else:
                last_piece = self.make_room(piece)
        elif rows:
            keep_rows = self.make_room(rows)
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
        self.enforce_budget()

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
            held = sum(_snap_bytes(s) for piece in pieces for s in piece if s is not None)
            held += 0 if hidden is None else tensor_bytes(hidden)
            if not self.make_room(path[-1].file_bytes + held, keep=frozenset(n.id for n in path)):
                for piece in pieces:
                    _free_all(piece)
                return
            if not _attached(path[-1]) or not self._load(path[-1]):
                # The edge to split is gone (deleted to make room, or unreadable): attach below what
                # the trie still holds instead.
                path, stored = self.trie.match(fed)
        if path and path[-1].start < stored < path[-1].end:
            parent = self.trie.split(path[-1], stored, self.caches)
            self._recount(parent, path[-1])
        else:
            parent = path[-1] if path and stored == path[-1].end else self.trie.root
        for k, snaps in enumerate(pieces):
            lo, hi = bounds[k], bounds[k + 1]
            if hi <= stored:
                _free_all(snaps)
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
                    _free_all(rest)
                break
            rows = None if hidden is None else hidden[lo - bounds[0] : hi - bounds[0]].clone()
            parent = self.trie.attach(parent, fed[lo:hi], snaps, rows)
            self._recount(parent)

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

    # ---- the disk tier -------------------------------------------------------------------
    def persist(self) -> int:
        """Write every node held in RAM to the disk tier, most valuable first, as far as the disk
        budget allows (e.g. at shutdown, so that a restart over the same directory reuses them).
        Returns the number of nodes written."""
        if self.disk is None:
            return 0
        now = time.monotonic()
        nodes = sorted(
            (n for n in self.trie.nodes() if not n.on_disk), key=lambda n: self._value(n, now), reverse=True
        )
        return sum(self._store(node, now, displace=True) for node in nodes)

    def _store(self, node: Node, now: float, displace: bool) -> bool:
        """Demote `node`: write its snapshots to one file and keep stand-ins in the trie. It goes into
        free disk space, or with `displace` in place of less valuable disk nodes. False (nothing
        changed) when there is no such room or the write fails."""
        tokens = [t for n in node.path() for t in n.tokens]
        snaps = {i: node.snaps[i] for i in self.layers}
        floor = lambda nbytes: self._value(node, now, nbytes) if displace else -math.inf
        room = lambda nbytes, evict: self._disk_room(nbytes, floor(nbytes), now, evict)
        stored = self.disk.write(tokens, node.start, wall_clock(node.last_used), snaps, room)
        if stored is None:
            return False
        self._unread(node)
        _free_all(node.snaps)
        node.hidden = None  # the disk tier keeps snapshots only
        node.snaps = [
            StoredSnapshot(stored.layers[i]) if i in stored.layers else None for i in range(len(node.snaps))
        ]
        node.file, node.file_bytes = stored.name, stored.nbytes
        self._recount(node)
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
                n.on_disk and self._value(n, now) < floor and all(cheap[c.id] for c in n.children.values())
            )
        reclaimable = sum(n.file_bytes for n in order if cheap[n.id])
        if self.disk.nbytes - reclaimable + nbytes > budget:
            return False
        while evict and self.disk.nbytes + nbytes > budget:
            leaves = [n for n in self.trie.nodes() if cheap.get(n.id) and not n.children]
            self._remove_leaf(min(leaves, key=lambda n: self._value(n, now)))
            self.stats.disk_evicted_nodes += 1
        return True

    def _load(self, node: Node) -> bool:
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
            self._remove_subtree(node)
            return False
        self.stats.disk_reads += 1
        self.stats.disk_read_bytes += node.file_bytes
        _free_all(node.snaps)
        self.disk.delete(node.file)
        node.snaps = [snaps.get(i) for i in range(len(self.caches))]
        node.file, node.file_bytes = None, 0
        self._recount(node)
        return True

    def _adopt(self) -> None:
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
                cache = self.caches[i]
                kind = RowsSnapshot.kind if isinstance(cache, KVCache) else ScanSnapshot.kind
                if fields["kind"] != kind or (fields["start"], fields["end"]) != (stored.start, end):
                    return f"layer {i} is not the model's layer or does not cover the edge"
                if kind == RowsSnapshot.kind and fields["window"] != cache.window:
                    return f"layer {i} has another window"
            stubs = [
                StoredSnapshot(stored.layers[i]) if i in stored.layers else None
                for i in range(len(self.caches))
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
        self._recount(node)
        node.last_used = monotonic_of(stored.last_used)
        return None


def _attached(node: Node) -> bool:
    """Whether `node` is still in the trie (a removed node is unlinked from its parent)."""
    return node.parent is not None and node.parent.children.get(node.tokens[0]) is node


def _hidden_prefix(path: list[Node], target: int) -> torch.Tensor | None:
    """[target, d] the hidden states of positions [0, target) from the nodes of `path` (which start at
    0 and are consecutive), or None when one of them has no hidden log or they end before `target`."""
    rows, end = [], 0
    for node in path:
        if end >= target:
            break
        if node.hidden is None:
            return None
        rows.append(node.hidden[: min(node.end, target) - node.start])
        end = min(node.end, target)
    return torch.cat(rows) if rows and end == target else None


def _snap_bytes(snap: Snapshot) -> int:
    """What `snap` counts against the RAM budget: the bytes it owns, or — lazy, naming rows of a live
    buffer — the bytes it will own once those rows are overwritten (so that copy-out, which happens
    inside a forward, never raises the total)."""
    if isinstance(snap, RowsSnapshot) and snap.lazy:
        return tensor_bytes(*snap.rows(snap.rows_start, snap.end))
    return snap.nbytes


def budgeted(node: Node) -> int:
    """What a trie node counts against the RAM budget (0 on the disk tier)."""
    if node.on_disk:
        return 0
    hidden = 0 if node.hidden is None else tensor_bytes(node.hidden)
    return hidden + sum(_snap_bytes(s) for s in node.snaps if s is not None)


def _free_all(snaps: list[Snapshot | None]) -> None:
    for snap in snaps:
        if snap is not None:
            snap.free()
