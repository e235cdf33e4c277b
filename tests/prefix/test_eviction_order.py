"""`Eviction._delete`, the RAM budget's last resort, against a brute-force oracle: on random tries of
RAM and disk nodes it deletes the same nodes in the same order as re-walking the trie for every victim
(the least valuable eligible RAM node with no RAM node below, leaves first, ties to the node met first
in `Trie.nodes` order), and stops as soon as the total fits."""

from __future__ import annotations

import types

from hypothesis import given, settings
from hypothesis import strategies as st

import hybridlm.prefix.eviction as cache_mod
from hybridlm.prefix.eviction import Eviction
from hybridlm.prefix.trie import Node, Trie

# Per node: (parent: index of an earlier node or -1 for the root, on disk, value, bytes, eligible).
# Few distinct values, so ties happen.
NODE = st.tuples(st.integers(-1, 40), st.booleans(), st.sampled_from([0.5, 1.0, 2.0]), st.integers(1, 5),
                 st.booleans())


def build(spec) -> tuple[Trie, list[Node]]:
    trie, nodes = Trie(), []
    for i, (parent, on_disk, _, _, _) in enumerate(spec):
        above = trie.root if parent < 0 or parent >= i else nodes[parent]
        node = Node([i], above.end, parent=above, file=f"{i}.bin" if on_disk else None)
        above.children[i] = node
        nodes.append(node)
    return trie, nodes


def oracle(spec, total: int, room: int) -> list[int]:
    """The deletion order of a fresh walk per victim (the implementation before the heap)."""
    trie, nodes = build(spec)
    index = {n.id: i for i, n in enumerate(nodes)}
    order = []
    while total > room:
        ram_below: dict[int, bool] = {}
        for n in reversed(list(trie.nodes())):
            ram_below[n.id] = any(not c.on_disk or ram_below[c.id] for c in n.children.values())
        victims = [n for n in trie.nodes() if spec[index[n.id]][4] and not n.on_disk and not ram_below[n.id]]
        if not victims:
            break
        victim = min(victims, key=lambda n: (bool(n.children), spec[index[n.id]][2]))
        total -= spec[index[victim.id]][3]
        order.append(index[victim.id])
        remove_subtree(trie, victim)
    return order


def remove_subtree(trie: Trie, node: Node) -> int:
    below = [node]
    for n in below:
        below.extend(n.children.values())
    for n in reversed(below):
        trie.remove_leaf(n)
    return len(below)


@settings(max_examples=300, deadline=None)
@given(spec=st.lists(NODE, min_size=1, max_size=30), room=st.integers(0, 40))
def test_deletion_order_equals_a_fresh_walk_per_victim(spec, room):
    total = sum(size for _, on_disk, _, size, _ in spec if not on_disk)
    want = oracle(spec, total, room)
    trie, nodes = build(spec)
    index = {n.id: i for i, n in enumerate(nodes)}
    got: list[int] = []

    def removed(node: Node) -> int:
        got.append(index[node.id])
        return remove_subtree(trie, node)

    fake = types.SimpleNamespace(
        trie=trie,
        stats=types.SimpleNamespace(evicted_nodes=0),
        budget=types.SimpleNamespace(value=lambda n, now: spec[index[n.id]][2]),
        tiers=types.SimpleNamespace(remove_subtree=removed),
    )
    size = lambda n: 0 if n.on_disk else spec[index[n.id]][3]  # noqa: E731
    original, cache_mod.budgeted = cache_mod.budgeted, size
    try:
        left = Eviction._delete(fake, total, lambda n: spec[index[n.id]][4], room)
    finally:
        cache_mod.budgeted = original
    assert got == want
    assert left == total - sum(spec[i][3] for i in got)
