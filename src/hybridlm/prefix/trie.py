"""The compressed token trie: nodes own one snapshot per stateful layer covering their edge, and
optionally the target's hidden states there (for an MTP head's context).

Pure data structure (no model, no live caches): matching, splitting an edge, attaching a chain
of new nodes, removing leaves. `PrefixCache` (prefix/cache.py) drives it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from hybridlm.cache.base import LayerCache, Snapshot

_ids = itertools.count()


@dataclass(eq=False)
class Node:
    """Edge `tokens` = positions [start, start + len(tokens)); `snaps[l]` covers the same range for
    stateful layer l (None for stateless layers; the root has no edge and no snapshots). `hidden`
    [len(tokens), d]: the target's final-normed hidden states at the edge's positions, when they were
    recorded (an MTP drafter was reading them), else None.

    A node on the disk tier has `file` set (its file's name, `file_bytes` its size) and holds
    stand-ins (`StoredSnapshot`, 0 RAM bytes) in `snaps` until it is loaded back."""

    tokens: list[int]
    start: int
    parent: Node | None = None
    snaps: list[Snapshot | None] = field(default_factory=list)
    children: dict[int, Node] = field(default_factory=dict)
    last_used: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=lambda: next(_ids))
    file: str | None = None
    file_bytes: int = 0
    hidden: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        """RAM bytes owned by the snapshots and the hidden log (0 on the disk tier)."""
        hidden = 0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()
        return hidden + sum(s.nbytes for s in self.snaps if s is not None)

    @property
    def on_disk(self) -> bool:
        return self.file is not None

    def path(self) -> list[Node]:
        """Nodes from the root's first child down to this node."""
        out, node = [], self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def touch(self, now: float) -> None:
        node = self
        while node is not None:
            node.last_used = now
            node = node.parent


class Trie:
    def __init__(self) -> None:
        self.root = Node([], 0)

    def match(self, tokens: list[int]) -> tuple[list[Node], int]:
        """Longest stored prefix of `tokens`: (nodes whose edges it enters, its length). The last
        node may be entered only partly."""
        node, pos, path = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            edge = child.tokens
            k = 0
            limit = min(len(edge), len(tokens) - pos)
            while k < limit and edge[k] == tokens[pos + k]:
                k += 1
            path.append(child)
            pos += k
            if k < len(edge):
                break
            node = child
        return path, pos

    def split(self, node: Node, at: int, caches: list[LayerCache | None]) -> Node:
        """Cut `node`'s edge at absolute position `at` (start < at < end); returns the upper part
        (a new node ending at `at`), whose single child is `node` (now starting at `at`)."""
        if not node.start < at < node.end:
            raise ValueError(f"split at {at} outside ({node.start}, {node.end})")
        k = at - node.start
        upper_snaps, lower_snaps = [], []
        for cache, snap in zip(caches, node.snaps, strict=True):
            if snap is None:
                upper_snaps.append(None)
                lower_snaps.append(None)
            else:
                a, b = cache.split(snap, at)
                upper_snaps.append(a)
                lower_snaps.append(b)
        upper = Node(node.tokens[:k], node.start, node.parent, upper_snaps, last_used=node.last_used)
        if node.hidden is not None:
            upper.hidden, node.hidden = node.hidden[:k].clone(), node.hidden[k:].clone()
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.start, node.snaps, node.parent = node.tokens[k:], at, lower_snaps, upper
        upper.children[node.tokens[0]] = node
        return upper

    def attach(
        self,
        parent: Node,
        tokens: list[int],
        snaps: list[Snapshot | None],
        hidden: torch.Tensor | None = None,
    ) -> Node:
        """Add a child edge under `parent` (its first token must be new among the children); hidden:
        [len(tokens), d] or None."""
        if not tokens:
            raise ValueError("an edge needs at least one token")
        if tokens[0] in parent.children:
            raise ValueError("siblings never share a first token")
        if hidden is not None and len(hidden) != len(tokens):
            raise ValueError(f"a hidden log of {len(hidden)} rows for an edge of {len(tokens)} tokens")
        child = Node(list(tokens), parent.end, parent, snaps, hidden=hidden)
        parent.children[tokens[0]] = child
        return child

    def remove_leaf(self, node: Node) -> None:
        """Unlink a leaf and free its snapshots."""
        if node.children:
            raise ValueError("only leaves are removed")
        del node.parent.children[node.tokens[0]]
        for snap in node.snaps:
            if snap is not None and not snap.closed:
                snap.free()
        node.snaps, node.hidden = [], None

    def nodes(self):
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
