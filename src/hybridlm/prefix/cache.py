"""`PrefixCache`: one trie for every conversation, one live path in the model's caches.

`begin(tokens)` restores the longest stored prefix — ending at any token, for every layer kind —
into the live caches and returns a `Session`; the engine prefills the rest and decodes through
the session, which records the tokens fed; `session.close()` attaches what was computed (also
for a cancelled request) and keeps the byte budget.

Restore of layer l to target t along path nodes n_0..n_k (each covering [start, end)): start from
the deepest node whose start the cache can already reach — a live rewind inside the common prefix
with the live path, or the previous node's snapshot if it stands alone at its end (a recurrent
checkpoint, sliding rows covering the window) — then restore each node to its end, the last to t
(recurrent layers replay their scan-input log for the last stretch).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from hybridlm.cache.base import LayerCache, Snapshot
from hybridlm.cache.recurrent import ScanCache
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
    """Counters for /metrics."""

    hits: int = 0
    misses_no_prefix: int = 0
    misses_unrestorable: int = 0
    evicted_nodes: int = 0
    compacted_snapshots: int = 0


@dataclass
class CapturePlan:
    """Where restore points go inside a prompt (absolute offsets are derived per request).

    cadence: a checkpoint every `cadence` tokens bounds replay; tail: checkpoints this many tokens
    before the prompt end, where chat templates later rewrite history."""

    cadence: int = 512
    tail: tuple[int, ...] = (1, 8, 32)

    def offsets(self, start: int, prompt_len: int) -> list[int]:
        points = set(range(start - start % self.cadence + self.cadence, prompt_len, self.cadence))
        points.add(prompt_len)
        points.update(prompt_len - t for t in self.tail)
        return sorted(p for p in points if start < p <= prompt_len)


@dataclass
class Session:
    """One request's use of the live caches: restored to `cached`, then advanced by the engine."""

    owner: PrefixCache
    prompt: list[int]
    cached: int
    replayed: int
    restore_ms: float
    fed: list[int] = field(default_factory=list)
    closed: bool = False

    @property
    def caches(self) -> list[LayerCache | None]:
        return self.owner.caches

    @property
    def offset(self) -> int:
        return len(self.fed)

    @property
    def remaining(self) -> list[int]:
        """Prompt tokens still to prefill (at least one: it seeds decoding)."""
        return self.prompt[self.offset :]

    def advance(self, ids: list[int]) -> None:
        """Record tokens just fed through the model (call after each forward)."""
        self.fed.extend(ids)

    def close(self) -> None:
        """Attach what this session computed to the trie and keep the budget."""
        if not self.closed:
            self.closed = True
            self.owner._close(self)


class PrefixCache:
    """The shared trie plus the live caches of one model (one session at a time).

    ram_budget: bytes of snapshots held in host memory (None: unbounded).
    """

    def __init__(self, model, ram_budget: int | None = None, plan: CapturePlan | None = None):
        self.model = model
        self.caches: list[LayerCache | None] = model.make_caches(1)
        for cache in self.caches:
            if cache is not None:
                cache.record = True
        self.layers = [i for i, c in enumerate(self.caches) if c is not None]
        self.trie = Trie()
        self.live: list[int] = []
        self.ram_budget = ram_budget
        self.plan = plan or CapturePlan()
        self.stats = CacheStats()
        self._session: Session | None = None

    # ---- accounting ----------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes owned by snapshots in the trie (lazy rows of the live buffers count 0)."""
        return sum(node.nbytes for node in self.trie.nodes())

    @property
    def node_count(self) -> int:
        return sum(1 for _ in self.trie.nodes())

    # ---- begin: match and restore --------------------------------------------------------
    def begin(self, tokens: list[int]) -> Session:
        """Restore the longest stored prefix of `tokens` (keeping ≥ 1 token to evaluate)."""
        if not tokens:
            raise ValueError("a session needs at least one token")
        if self._session is not None and not self._session.closed:
            self._session.close()
        t0 = time.perf_counter()
        keep = tokens[: len(tokens) - 1]
        path, matched = self.trie.match(keep)
        common = common_prefix(self.live, keep)
        target, replayed = self._restore_best(path, matched, common)
        if target > 0:
            self.stats.hits += 1
        elif matched > 0:
            self.stats.misses_unrestorable += 1
        else:
            self.stats.misses_no_prefix += 1
        if target < matched:
            log.info("prefix matched %d tokens but restored %d", matched, target)
        self.live = list(tokens[:target])
        now = time.monotonic()
        for node in path:
            if node.start < target:
                node.touch(now)
        restore_ms = (time.perf_counter() - t0) * 1e3
        session = Session(self, list(tokens), target, replayed, restore_ms, list(self.live))
        self._session = session
        offsets = self.plan.offsets(target, len(tokens))
        for i in self.layers:
            self.caches[i].prepare_snapshots(offsets, ranges=True)
        return session

    def _restore_best(self, path: list[Node], matched: int, common: int) -> tuple[int, int]:
        """Restore every layer to the largest reachable target ≤ max(matched, common), where the
        trie path agrees with the prompt up to `matched` and the live caches up to `common`;
        returns (target, replayed)."""
        want = max(matched, common)
        candidates = sorted({want, matched, common, *(n.end for n in path if n.end < want), 0}, reverse=True)
        for t in candidates:
            plans = [self._plan(i, path, t, matched, common) for i in self.layers]
            if all(p is not None for p in plans):
                replayed = 0
                for i, steps in zip(self.layers, plans, strict=True):
                    replayed = max(replayed, self._execute(i, steps))
                return t, replayed
        raise AssertionError("offset 0 is always reachable")

    def _plan(self, layer: int, path: list[Node], t: int, matched: int, common: int):
        """Restore steps [(snapshot | None | RESET, target)] bringing layer `layer` to `t`, or None."""
        cache = self.caches[layer]
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

    def _execute(self, layer: int, steps) -> int:
        """Run restore steps; returns tokens recovered by replay."""
        cache = self.caches[layer]
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
    def _close(self, session: Session) -> None:
        caches = self.caches
        end = session.offset
        # Every stateful layer was scheduled the same offsets, so their captures share bounds.
        captures = {i: caches[i].take_snapshots() for i in self.layers}
        bounds = [session.cached] + [s.end for s in captures.get(self.layers[0], [])] if self.layers else []
        pieces = [
            [captures[i][k] if i in captures else None for i in range(len(caches))]
            for k in range(len(bounds) - 1)
        ]
        if self.layers and end > bounds[-1]:
            last = bounds[-1]
            pieces.append([c.snapshot(last) if c is not None else None for c in caches])
            bounds.append(end)
        self.live = list(session.fed)
        self._insert(session.fed, bounds, pieces)
        self._session = None
        self.enforce_budget()

    def _insert(self, fed: list[int], bounds: list[int], pieces: list[list[Snapshot | None]]) -> None:
        """Attach pieces [bounds[k], bounds[k+1]) of `fed` below what the trie already stores."""
        path, stored = self.trie.match(fed)
        if path and path[-1].start < stored < path[-1].end:
            parent = self.trie.split(path[-1], stored, self.caches)
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
            parent = self.trie.attach(parent, fed[lo:hi], snaps)

    def live_path(self) -> set[int]:
        """Ids of the nodes on the live path (protected from eviction)."""
        path, _ = self.trie.match(self.live)
        return {n.id for n in path}

    def enforce_budget(self) -> None:
        """Keep the snapshots inside the budget, cheapest loss first: drop scan-input logs of nodes
        off the live path (their interior offsets become unreachable, their ends stay), delete
        leaves off the live path, then the same on the live path (its state is still in the
        live caches; only future reuse is lost). Least valuable nodes go first."""
        if self.ram_budget is None:
            return
        total = self.nbytes
        protected = self.live_path()
        for on_live_path in (False, True):
            if total <= self.ram_budget:
                return
            total = self._compact(total, lambda n, p=on_live_path: (n.id in protected) == p)
            total = self._delete_leaves(total, lambda n, p=on_live_path: (n.id in protected) == p)

    def _compact(self, total: int, eligible) -> int:
        now = time.monotonic()
        for node in sorted(self.trie.nodes(), key=lambda n: self._value(n, now)):
            if total <= self.ram_budget:
                break
            if not eligible(node):
                continue
            before = node.nbytes
            node.snaps = [None if s is None else self.caches[i].compact(s) for i, s in enumerate(node.snaps)]
            if node.nbytes < before:
                self.stats.compacted_snapshots += 1
                total -= before - node.nbytes
        return total

    def _delete_leaves(self, total: int, eligible) -> int:
        now = time.monotonic()
        while total > self.ram_budget:
            leaves = [n for n in self.trie.nodes() if not n.children and eligible(n)]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: self._value(n, now))
            total -= victim.nbytes
            self.trie.remove_leaf(victim)
            self.stats.evicted_nodes += 1
        return total

    @staticmethod
    def _value(node: Node, now: float) -> float:
        """Recompute work saved per byte held, decayed by idle time: tokens / bytes / (1 + idle/5min)."""
        return len(node.tokens) / max(node.nbytes, 1) / (1.0 + (now - node.last_used) / 300.0)


def _free_all(snaps: list[Snapshot | None]) -> None:
    for snap in snaps:
        if snap is not None:
            snap.free()
