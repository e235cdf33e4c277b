"""What the parts of the prefix cache share: a `Session` (one request's use of a slot of live caches)
and its `Slot`, the capture plan and what captures cost, and what nodes and snapshots count against
the RAM budget. Below `cache.py` and its parts; imports none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache, Snapshot, tensor_bytes
from hybridlm.cache.kv import RowsSnapshot
from hybridlm.prefix.trie import Node

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
        full = [snap_bytes(one), snap_bytes(two)]
        one, two = caches[i].compact(one), caches[i].compact(two)
        lean = [snap_bytes(one), snap_bytes(two)]
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

    owner: Any  # the `PrefixCache` it belongs to (advance, close and abandon call back into it)
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


def attached(node: Node) -> bool:
    """Whether `node` is still in the trie (a removed node is unlinked from its parent)."""
    return node.parent is not None and node.parent.children.get(node.tokens[0]) is node


def hidden_prefix(path: list[Node], target: int) -> torch.Tensor | None:
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


def snap_bytes(snap: Snapshot) -> int:
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
    return hidden + sum(snap_bytes(s) for s in node.snaps if s is not None)


def free_all(snaps: list[Snapshot | None]) -> None:
    for snap in snaps:
        if snap is not None:
            snap.free()
