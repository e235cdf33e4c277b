"""Model-free tests of the attention caches' contract (DESIGN.md §3.2): `KVCache` and `SlidingKVCache`
driven directly with `update(Batch, k, v)`.

Rows are named by token ids: position p on a path holds `EK[id], EV[id]`; the id -1 stands for a row
nobody knows (a position before the window a snapshot alone supplied) and is written as NaN. The
truth of a cache is the list of ids of every row ever written on its live path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridlm.batch import Batch
from hybridlm.cache import KVCache, RowsSnapshot, SlidingKVCache
from hybridlm.cache.kv import SharedRows, held_bytes

H, D, VOCAB = 2, 4, 1000
UNKNOWN = -1
_gen = torch.Generator().manual_seed(1234)
EK = torch.randn(VOCAB, H, D, generator=_gen)
EV = torch.randn(VOCAB, H, D, generator=_gen)
ROW_BYTES = 2 * H * D * EK.element_size()  # one position's key + value, batch of one


# ---- helpers -------------------------------------------------------------------------------------
def rows_of(ids) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [1, H, n, D] for the ids (NaN rows for UNKNOWN)."""
    idx = torch.as_tensor(list(ids), dtype=torch.long).reshape(-1)
    k = EK[idx.clamp(min=0)].transpose(0, 1).unsqueeze(0).clone()
    v = EV[idx.clamp(min=0)].transpose(0, 1).unsqueeze(0).clone()
    k[:, :, idx < 0] = math.nan
    v[:, :, idx < 0] = math.nan
    return k, v


def write(cache: KVCache, ids):
    k, v = rows_of(ids)
    return cache.update(Batch.single([max(i, 0) for i in ids], cache.offset), k, v)


def assert_rows_equal(k: torch.Tensor, v: torch.Tensor, ids, row: int = 0) -> None:
    """k, v [B, H, n, D] hold the rows of `ids` in batch row `row` (UNKNOWN positions are not compared)."""
    ek, ev = rows_of(ids)
    known = torch.as_tensor([i >= 0 for i in ids], dtype=torch.bool)
    assert k.shape[2] == len(ids)
    assert torch.equal(k[row : row + 1][:, :, known], ek[:, :, known])
    assert torch.equal(v[row : row + 1][:, :, known], ev[:, :, known])


def window_low(window: int | None, t: int) -> int:
    """First position a query at `t` sees."""
    return 0 if window is None else max(0, t - window + 1)


def assert_live(cache: KVCache, path: list[int]) -> None:
    """The cache is at len(path) and holds the rows the next query needs, equal to the truth."""
    t = len(path)
    assert cache.offset == t
    lo = window_low(cache.window, t)
    if lo == t:
        return
    assert all(i >= 0 for i in path[lo:t]), "the cache claims a window nobody supplied"
    k, v = cache.rows(lo, t)
    assert_rows_equal(k, v, path[lo:t])


def assert_owns_exactly(t: torch.Tensor) -> None:
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), "a view pins a larger buffer"


def snap_rows(snap: RowsSnapshot) -> tuple[torch.Tensor, torch.Tensor]:
    return snap.rows(snap.rows_start, snap.end)


def reach(snap: RowsSnapshot) -> list[int]:
    return [t for t in range(snap.start - 2, snap.end + 3) if snap.reaches(t)]


def check_history(hist, paths: list[list[int]], offsets: list[int], lens: list[int], window) -> None:
    """The history of one update: every query of row b sees its window, equal to row b's truth."""
    assert hist.window == window
    if hist.prefix:  # shared segments come first: check them and the own rows as one buffer
        keys = torch.cat([k for k, _ in hist.prefix] + [hist.keys], dim=2)
        values = torch.cat([v for _, v in hist.prefix] + [hist.values], dim=2)
        hist = hist._replace(keys=keys, values=values, prefix=())
    ks, width = hist.key_start, hist.keys.shape[2]
    assert hist.values.shape[2] == width
    if window is None:
        assert ks == 0
    for b, (o, n) in enumerate(zip(offsets, lens, strict=True)):
        need = window_low(window, o)
        assert ks <= need, f"row {b}: first query at {o} needs position {need}, history starts at {ks}"
        assert ks + width >= o + n
        lo = max(ks, need) if window is not None else 0
        assert all(i >= 0 for i in paths[b][need : o + n])
        assert_rows_equal(
            hist.keys[:, :, lo - ks : o + n - ks],
            hist.values[:, :, lo - ks : o + n - ks],
            paths[b][lo : o + n],
            row=b,
        )


def make(kind: str, step: int = 4):
    return KVCache(step=step) if kind == "kv" else SlidingKVCache(5, step=step)


def fresh_at(kind_of: KVCache, prefix: list[int]) -> KVCache:
    """A new cache like `kind_of` holding `prefix` (one write, so nothing is trimmed)."""
    c = KVCache(step=3) if kind_of.window is None else SlidingKVCache(kind_of.window, step=3)
    if prefix:
        write(c, prefix)
    return c


def ids(n: int, base: int = 0) -> list[int]:
    return [(base + 7 * i) % VOCAB for i in range(n)]


def far_ahead(window: int) -> SlidingKVCache:
    """A sliding cache that has trimmed everything before position ~40."""
    c = SlidingKVCache(window, step=8)
    for i in range(12):
        write(c, ids(4, base=1000 + 4 * i))
    return c


KINDS = ["kv", "sliding"]


# ---- update / history ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_update_history_holds_truth_at_key_positions(kind):
    cache = make(kind, step=4)
    path: list[int] = []
    for n in [1, 7, 1, 1, 13, 2, 1, 30, 1, 5]:
        new = ids(n, base=len(path) * 3 + 1)
        o = cache.offset
        hist = write(cache, new)
        path += new
        check_history(hist, [path], [o], [n], cache.window)
        assert_live(cache, path)


@pytest.mark.parametrize("kind", KINDS)
def test_update_history_ragged_batch_each_row_at_its_own_offset(kind):
    cache = KVCache(batch_size=2, step=4) if kind == "kv" else SlidingKVCache(3, batch_size=2, step=4)
    paths: list[list[int]] = [[], []]
    for step, lens in enumerate([[5, 3], [2, 4], [1, 1], [6, 1], [1, 9]]):
        rows = [ids(n, base=100 * b + 10 * step) for b, n in enumerate(lens)]
        batch = Batch.ragged(rows, offsets=list(cache.offsets))
        k = torch.randn(2, H, batch.length, D)  # padding rows are junk
        v = torch.randn(2, H, batch.length, D)
        for b, r in enumerate(rows):
            k[b : b + 1, :, : len(r)], v[b : b + 1, :, : len(r)] = rows_of(r)
        old = list(cache.offsets)
        hist = cache.update(batch, k, v)
        for b in range(2):
            paths[b] += rows[b]
        assert cache.offsets == [len(p) for p in paths]
        check_history(hist, paths, old, lens, cache.window)


def test_sliding_memory_stays_bounded_by_window_plus_write_plus_step():
    window, step = 6, 4
    cache = SlidingKVCache(window, step=step)
    path: list[int] = []
    for i in range(200):
        n = 1 + i % 3
        new = ids(n, base=i)
        hist = write(cache, new)
        path += new
        assert cache.capacity <= window - 1 + 3 + step
        assert hist.keys.shape[2] <= window - 1 + n
    assert_live(cache, path)


# ---- lazy snapshots ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_lazy_snapshot_owns_nothing_until_a_write_overlaps_then_owns_pre_overwrite_rows(kind):
    cache = make(kind, step=64)
    path = ids(12)
    write(cache, path)
    grown: list[int] = []
    snap = cache.snapshot(4)
    snap.on_grow = grown.append
    assert snap.lazy and snap.nbytes == 0
    write(cache, ids(3, base=50))  # after the snapshot's range: no overlap
    assert snap.lazy and snap.nbytes == 0 and grown == []
    assert cache.restore(None, 12)
    write(cache, ids(2, base=60))  # rewind to its end and write: still no overlap
    assert snap.lazy and grown == []
    assert cache.restore(None, 9)
    write(cache, ids(1, base=70))  # overwrites position 9, inside [4, 12)
    assert not snap.lazy
    assert snap.nbytes == (12 - 4) * ROW_BYTES == sum(grown) and grown == [snap.nbytes]
    assert_owns_exactly(snap.k)
    assert_owns_exactly(snap.v)
    k, v = snap_rows(snap)
    assert_rows_equal(k, v, path[4:12])  # the data from before the overwrite


def test_every_write_checks_overlap_not_only_the_first_after_a_rewind():
    cache = KVCache(step=64)
    path = ids(20)
    write(cache, path)
    snap = cache.snapshot(10)
    assert cache.restore(None, 5)
    write(cache, ids(3, base=40))  # [5, 8): below the snapshot
    assert snap.lazy
    write(cache, ids(4, base=80))  # [8, 12): overlaps [10, 20)
    assert not snap.lazy
    assert_rows_equal(*snap_rows(snap), path[10:20])


def test_sliding_trim_copies_out_the_rows_it_drops():
    window = 3
    cache = SlidingKVCache(window, step=2)
    path = ids(8)
    write(cache, path)
    grown: list[int] = []
    snap = cache.snapshot(2)
    snap.on_grow = grown.append
    for i in range(40):  # the window wraps many times
        new = ids(1, base=300 + i)
        write(cache, new)
        path += new
        if not snap.lazy:
            break
    assert not snap.lazy and grown == [snap.nbytes] and snap.nbytes == 6 * ROW_BYTES
    assert_rows_equal(*snap_rows(snap), path[2:8])
    assert_owns_exactly(snap.k)


@pytest.mark.parametrize("kind", KINDS)
def test_cache_free_copies_out_lazy_snapshots(kind):
    cache = make(kind)
    path = ids(9)
    write(cache, path)
    snap = cache.snapshot(3)
    grown: list[int] = []
    snap.on_grow = grown.append
    cache.free()
    assert cache.offset == 0 and cache.nbytes == 0
    assert not snap.lazy and grown == [snap.nbytes] == [6 * ROW_BYTES]
    assert_rows_equal(*snap_rows(snap), path[3:9])


def test_lazy_snapshot_survives_buffer_growth():
    cache = KVCache(step=2)
    path = ids(3)
    write(cache, path)
    snap = cache.snapshot(0)
    for i in range(10):
        new = ids(3, base=500 + i)
        write(cache, new)
        path += new
    assert snap.lazy
    assert_rows_equal(*snap_rows(snap), path[:3])


# ---- rewind / restore ----------------------------------------------------------------------------
def test_kv_rewind_reaches_every_offset_and_never_forward():
    cache = KVCache(step=4)
    path = ids(17)
    write(cache, path)
    assert not cache.restore(None, 18)
    assert_live(cache, path)
    for t in range(17, -1, -1):
        assert cache.restore(None, t)
        assert_live(cache, path[:t])
    # rewinding does not destroy rows: going forward again needs a snapshot, not restore(None)
    assert not cache.restore(None, 1)


def test_sliding_rewind_refused_once_rows_are_trimmed_and_changes_nothing():
    window = 4
    cache = SlidingKVCache(window, step=2)
    path: list[int] = []
    for i in range(30):
        new = ids(1, base=i)
        write(cache, new)
        path += new
    assert cache.start_pos > 0
    before = (cache.offset, cache.start_pos, cache.rows(26, 30))
    for t in range(1, cache.start_pos + window - 1):
        assert not cache.restore(None, t)
    assert cache.offset == before[0] and cache.start_pos == before[1]
    assert torch.equal(cache.rows(26, 30)[0], before[2][0])
    assert_live(cache, path)
    # within what the last write kept, a rewind works
    assert cache.restore(None, 29)
    assert_live(cache, path[:29])
    # and offset 0 needs no rows at all: the cache starts over there
    assert cache.restore(None, 0)
    new = ids(6, base=99)
    hist = write(cache, new)
    check_history(hist, [new], [0], [6], window)
    assert_live(cache, new)
    assert cache.restore(None, 4)
    assert_live(cache, new[:4])


@pytest.mark.parametrize("kind", KINDS)
def test_restore_snapshot_reaches_every_target_in_its_range(kind):
    cache = make(kind, step=4)
    path = ids(30)
    write(cache, path)
    snap = cache.snapshot(10)
    assert reach(snap) == list(range(10, 31))
    # diverge: rewind into the range and write another continuation (the snapshot copies out)
    assert cache.restore(None, 10)
    write(cache, ids(25, base=900))
    assert not snap.lazy
    for t in range(10, 31):
        # from the live cache (sitting past `start`, with the same prefix; ascending, so a sliding
        # cache still holds the window before `start` where a target needs it) ...
        assert cache.restore(snap, t)
        assert_live(cache, path[:t])
        # ... and from a fresh cache sitting at `start`
        other = fresh_at(cache, path[:10])
        assert other.restore(snap, t)
        assert_live(other, path[:t])


@pytest.mark.parametrize("kind", KINDS)
def test_restore_of_an_unreachable_target_returns_false_and_changes_nothing(kind):
    cache = make(kind)
    path = ids(20)
    write(cache, path)
    snap = cache.snapshot(8)
    other = fresh_at(cache, path[:3])  # below the snapshot's start: its prefix is missing
    for t in [7, 21, 9, 11]:  # (a sliding target whose window lies inside the snapshot would work)
        before = (other.offset, other.rows(0, 3))
        assert not other.restore(snap, t)
        assert other.offset == before[0]
        assert torch.equal(other.rows(0, 3)[0], before[1][0])
    assert_live(other, path[:3])
    assert snap.lazy


def test_sliding_snapshot_restores_after_the_window_wrapped_many_times():
    window = 4
    cache = SlidingKVCache(window, step=2)
    path = ids(6)
    write(cache, path)
    new = ids(12, base=200)
    write(cache, new)
    path += new
    snap = cache.snapshot(6)  # [6, 18)
    for i in range(60):
        write(cache, ids(1, base=400 + i))
    assert not snap.lazy
    assert reach(snap) == list(range(6, 19))
    for t in range(6, 19):
        # the live cache is far ahead and no longer holds the window before 6: only targets whose
        # window lies inside the snapshot are reachable from it
        alone = window_low(window, t) >= 6
        assert cache.restore(snap, t) == alone
        if alone:
            assert_live(cache, path[:t])
            write(cache, ids(50, base=700))  # move far ahead again
        other = fresh_at(cache, path[:6])
        assert other.restore(snap, t)
        assert_live(other, path[:t])


def test_compacted_sliding_snapshot_restores_only_to_its_end():
    window = 5
    cache = SlidingKVCache(window, step=4)
    path = ids(40)
    write(cache, path)
    point = cache.compact(cache.snapshot(10))
    assert not point.lazy and point.nbytes == (window - 1) * ROW_BYTES
    assert_owns_exactly(point.k)
    assert reach(point) == [40]
    write(cache, ids(3, base=999))
    for t in range(10, 40):
        assert not cache.restore(point, t)
    # onto a fresh cache, onto a cache far ahead, onto a cache behind
    for other in [fresh_at(cache, []), cache, far_ahead(window), fresh_at(cache, ids(3))]:
        assert other.restore(point, 40)
        assert_live(other, [UNKNOWN] * (40 - window + 1) + path[40 - window + 1 :])
        write(other, ids(2, base=5))  # and it decodes on from there
    # a compacted point checkpoint whose window reaches before its start is left as it was
    short = cache.snapshot(cache.offset - 2)
    assert cache.compact(short) is short


def test_restore_into_a_sliding_cache_trimmed_past_the_snapshot():
    """Regression: restoring rows below the buffer's first held position (a trie branch switch)."""
    window = 4
    src = SlidingKVCache(window, step=8)
    path = ids(20)
    write(src, path)
    point = src.compact(src.snapshot(0))
    far = far_ahead(window)
    assert far.start_pos > 20
    assert far.restore(point, 20)
    truth = [UNKNOWN] * 17 + path[17:]
    assert_live(far, truth)
    new = ids(1, base=77)
    hist = write(far, new)
    check_history(hist, [truth + new], [20], [1], window)


def test_snapshot_after_a_snapshot_alone_restore_does_not_claim_unsupplied_rows():
    """Regression: a snapshot of a cache whose window came from a snapshot alone must not reach
    targets whose window includes the rows before it (they are not on this path)."""
    window = 4
    src = SlidingKVCache(window, step=8)
    path = ids(20)
    write(src, path)
    point = src.compact(src.snapshot(0))
    cache = SlidingKVCache(window, step=8)
    assert cache.restore(point, 20)
    snap = cache.snapshot(0)
    assert reach(snap) == [20]
    other = SlidingKVCache(window, step=8)
    assert not other.restore(snap, 17)
    assert other.restore(snap, 20)
    assert_live(other, [UNKNOWN] * 17 + path[17:])


@pytest.mark.parametrize("kind", KINDS)
def test_empty_snapshot_of_an_unwritten_cache_survives_free_and_merge(kind):
    """Regression: a [0, 0) snapshot of a cache with no buffer yet broke `free()` and `merge`."""
    cache = make(kind)
    empty = cache.snapshot(0)
    cache.free()
    assert empty.nbytes == 0
    path = ids(6)
    write(cache, path)
    child = cache.snapshot(0)
    child.materialize()
    merged = cache.merge(empty, child)
    assert (merged.start, merged.end) == (0, 6)
    assert_rows_equal(*snap_rows(merged), path)


def test_snapshot_after_rewinding_below_the_buffer_names_no_rows():
    """Regression: rewinding a trimmed sliding cache to 0 (an empty window) was refused, and a snapshot
    taken there named rows past its end (junk rows once copied out)."""
    cache = SlidingKVCache(3, step=1)
    for i in range(6):
        write(cache, ids(1, base=i))
    assert cache.start_pos > 0
    assert cache.restore(None, 0)
    empty = cache.snapshot(0)
    assert empty.rows_start == empty.end == 0
    cache.free()
    assert empty.nbytes == 0 and reach(empty) == [0]


# ---- split / merge -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lazy", [True, False])
def test_split_then_merge_round_trips(kind, lazy):
    cache = make(kind)
    path = ids(16)
    write(cache, path)
    for start in [0, 3]:
        for at in range(start, 17):
            snap = cache.snapshot(start)
            if not lazy:
                snap.materialize()
            rows, shape = snap_rows(snap), (snap.start, snap.end, snap.rows_start, reach(snap))
            left, right = cache.split(snap, at)
            assert (left.start, left.end, right.start, right.end) == (start, at, at, 16)
            assert left.lazy == right.lazy == lazy
            assert_rows_equal(*snap_rows(left), path[left.rows_start : at])
            assert_rows_equal(*snap_rows(right), path[right.rows_start : 16])
            merged = cache.merge(left, right)
            assert (merged.start, merged.end, merged.rows_start, reach(merged)) == shape
            assert torch.equal(snap_rows(merged)[0], rows[0]) and torch.equal(snap_rows(merged)[1], rows[1])
            for t in (x for x in shape[3] if x in (start, at, 16)):
                other = fresh_at(cache, path[:start])
                assert other.restore(merged, t)
                assert_live(other, path[:t])
            merged.free()


def test_split_then_merge_of_a_compacted_sliding_snapshot_round_trips():
    window = 4
    cache = SlidingKVCache(window, step=4)
    path = ids(20)
    write(cache, path)
    for at in range(5, 21):
        point = cache.compact(cache.snapshot(5))
        shape = (point.start, point.end, point.rows_start, reach(point))
        merged = cache.merge(*cache.split(point, at))
        assert (merged.start, merged.end, merged.rows_start, reach(merged)) == shape
        assert_rows_equal(*snap_rows(merged), path[merged.rows_start : 20])
        merged.free()


@pytest.mark.parametrize("kind", KINDS)
def test_split_and_merge_take_ownership_and_double_free_raises(kind):
    cache = make(kind)
    write(cache, ids(10))
    snap = cache.snapshot(2)
    left, right = cache.split(snap, 6)
    assert snap.closed
    with pytest.raises(RuntimeError):
        cache.split(snap, 4)
    with pytest.raises(RuntimeError):
        cache.restore(snap, 4)
    with pytest.raises(RuntimeError):
        snap.free()
    merged = cache.merge(left, right)
    assert left.closed and right.closed
    for used in (left, right):
        with pytest.raises(RuntimeError):
            cache.merge(used, merged)
        with pytest.raises(RuntimeError):
            cache.restore(used, 6)
    merged.free()
    with pytest.raises(RuntimeError):
        merged.free()
    assert cache._lazy == []  # nothing consumed stays registered with the buffer


def test_merge_does_not_report_growth_of_the_snapshots_it_consumes():
    """Regression: merging a lazy parent with a materialized child must not call `on_grow` for the
    parent it consumes (the owner would count bytes nobody holds)."""
    cache = KVCache(step=4)
    path = ids(6)
    write(cache, path)
    parent = cache.snapshot(0)  # lazy
    new = ids(6, base=30)
    write(cache, new)
    path += new
    child = cache.snapshot(6)
    child.materialize()
    grown: list[int] = []
    parent.on_grow = child.on_grow = grown.append
    merged = cache.merge(parent, child)
    assert grown == []
    assert merged.nbytes == 12 * ROW_BYTES
    assert_rows_equal(*snap_rows(merged), path)
    assert_owns_exactly(merged.k)


# ---- capture scheduling --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_capture_schedule_yields_consecutive_snapshots_inside_one_write(kind):
    cache = make(kind)
    path = ids(5)
    write(cache, path)
    cache.prepare_snapshots([9, 7, 13])
    new = ids(10, base=50)
    write(cache, new)  # one batched write crossing every scheduled offset
    path += new
    caps = cache.take_snapshots()
    assert [(c.start, c.end) for c in caps] == [(5, 7), (7, 9), (9, 13)]
    assert cache.take_snapshots() == []
    for c in caps:
        for t in range(c.start, c.end + 1):
            other = fresh_at(cache, path[: c.start])
            assert other.restore(c, t)
            assert_live(other, path[:t])


@pytest.mark.parametrize("kind", KINDS)
def test_capture_schedule_spanning_several_writes(kind):
    cache = make(kind, step=2)
    cache.prepare_snapshots([3, 4, 11])
    path: list[int] = []
    for n in [2, 5, 1, 6]:
        new = ids(n, base=len(path))
        write(cache, new)
        path += new
    caps = cache.take_snapshots()
    assert [(c.start, c.end) for c in caps] == [(0, 3), (3, 4), (4, 11)]
    for c in caps:
        assert all(c.reaches(t) for t in range(c.start, c.end + 1))
        other = fresh_at(cache, path[: c.start])
        assert other.restore(c, c.end)
        assert_live(other, path[: c.end])
    with pytest.raises(ValueError):
        cache.prepare_snapshots([cache.offset])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("drafts", [1, 4])
def test_speculation_shape_restores_to_every_accepted_count(kind, drafts):
    p = 9
    for accepted in range(drafts + 1):
        cache = make(kind)
        path = ids(p)
        write(cache, path)
        cache.prepare_snapshots([p + i for i in range(1, drafts + 1)])
        verify = ids(drafts + 1, base=600)  # the last real token plus the drafts, one write
        write(cache, verify)
        path += verify
        caps = cache.take_snapshots()
        assert [(c.start, c.end) for c in caps] == [(p + i, p + i + 1) for i in range(drafts)]
        target = p + 1 + accepted
        if accepted < drafts:
            assert cache.restore(caps[accepted], target)
        assert_live(cache, path[:target])
        assert cache.restore(None, target)  # the plain rewind agrees
        assert_live(cache, path[:target])
        nxt = ids(1, base=800)
        hist = write(cache, nxt)
        check_history(hist, [path[:target] + nxt], [target], [1], cache.window)
        for c in caps:
            c.free()


# ---- the stateful model --------------------------------------------------------------------------
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


@dataclass
class Entry:
    snap: RowsSnapshot
    path: tuple[int, ...]  # the rows of the path it was taken on, [0, end)


class RowsMachine(RuleBasedStateMachine):
    """Random writes, snapshots, rewinds, restores, splits, merges, compactions and frees against
    the list-of-rows truth; forks sharing rows copy-on-write (`share` / `attach`) and restores that
    read a snapshot's rows as a segment (`shares_restores`, chains of them: multi-segment caches)
    are driven by the same rules and must hold exactly the rows a private copy would."""

    window: int | None = None

    def new_cache(self, step: int) -> KVCache:
        return KVCache(step=step) if self.window is None else SlidingKVCache(self.window, step=step)

    @initialize(step=st.sampled_from([1, 3, 8]))
    def setup(self, step):
        self.cache = self.new_cache(step)
        self.path: list[int] = []
        self.entries: list[Entry] = []
        self.consumed: list[RowsSnapshot] = []
        self.acct = 0  # the owner's view of the snapshots' bytes, kept by nbytes and on_grow
        self.last_write = 0  # rewinds to offsets at or after this are guaranteed to work
        self.checks = 0
        self.forks: list[tuple[KVCache, list[int], int]] = []  # the other caches: cache, path, last write
        self.frozen: dict[int, tuple[SharedRows, torch.Tensor, torch.Tensor]] = {}  # segments as first seen

    # -- bookkeeping
    def _grew(self, delta: int) -> None:
        assert delta >= 0
        self.acct += delta

    def _add(self, snap: RowsSnapshot, path) -> None:
        assert not snap.closed
        snap.on_grow = self._grew
        self.acct += snap.nbytes
        self.entries.append(Entry(snap, tuple(path)))

    def _take(self, data, pred=lambda e: True) -> Entry:
        cands = [e for e in self.entries if pred(e)]
        e = data.draw(st.sampled_from(cands))
        self.entries.remove(e)
        self.acct -= e.snap.nbytes
        return e

    def _consumed(self, snap: RowsSnapshot) -> None:
        assert snap.closed
        self.consumed.append(snap)

    def _write(self, new) -> None:
        o = self.cache.offset
        hist = write(self.cache, new)
        self.path = self.path[:o] + list(new)
        check_history(hist, [self.path], [o], [len(new)], self.window)
        self.last_write = o

    # -- rules
    @rule(new=IDS)
    def write_rows(self, new):
        self._write(new)

    @rule(new=IDS, data=st.data())
    def write_with_captures(self, new, data):
        o, n = self.cache.offset, len(new)
        offs = sorted(data.draw(st.lists(st.integers(o + 1, o + n), min_size=1, max_size=4, unique=True)))
        cut = data.draw(st.integers(0, n))
        self.cache.prepare_snapshots(offs)
        for part in (new[:cut], new[cut:]):
            if part:
                self._write(part)
        caps = self.cache.take_snapshots()
        assert [(c.start, c.end) for c in caps] == list(zip([o, *offs[:-1]], offs, strict=True))
        for c in caps:
            self._add(c, self.path[: c.end])

    @rule(data=st.data())
    def snapshot(self, data):
        start = data.draw(st.integers(0, self.cache.offset))
        self._add(self.cache.snapshot(start), self.path)

    def _signature(self):
        c = self.cache
        lo = window_low(self.window, c.offset)
        k, v = c.rows(lo, c.offset) if lo < c.offset else (None, None)
        return c.offset, lo, k if k is None else k.clone(), v if v is None else v.clone()

    def _assert_unchanged(self, before) -> None:
        after = self._signature()
        assert after[:2] == before[:2]
        if before[2] is not None:
            assert torch.equal(after[2].nan_to_num(7.0), before[2].nan_to_num(7.0))
            assert torch.equal(after[3].nan_to_num(7.0), before[3].nan_to_num(7.0))

    @rule(data=st.data())
    def rewind(self, data):
        t = data.draw(st.integers(0, self.cache.offset + 2))
        before = self._signature()
        ok = self.cache.restore(None, t)
        if t > len(self.path):
            assert not ok
        if t <= len(self.path) and (self.window is None or t >= self.last_write):
            assert ok, f"rewind to {t} refused (last write at {self.last_write})"
        if ok:
            self.path = self.path[:t]
        else:
            self._assert_unchanged(before)

    @precondition(lambda self: self.entries)
    @rule(data=st.data(), share=st.booleans())
    def restore(self, data, share):
        e = data.draw(st.sampled_from(self.entries))
        snap = e.snap
        t = data.draw(st.integers(snap.start - 1, snap.end + 1))
        low = window_low(self.window, t)
        before = self._signature()
        self.cache.shares_restores = share
        ok = self.cache.restore(snap, t)
        if self.window is None:
            alone = snap.start == 0
            assert ok == (snap.reaches(t) and (alone or self.cache.offset >= snap.start))
        else:
            alone = low >= min(snap.rows_start, t)  # the snapshot alone holds the window at t
            assert ok or not (snap.reaches(t) and alone)
            assert snap.reaches(t) or not ok
        if not ok:
            self._assert_unchanged(before)
            return
        prefix = (self.path + [UNKNOWN] * snap.start)[: snap.start]
        new = prefix + list(e.path[snap.start : t])
        if alone:
            new = [UNKNOWN] * low + new[low:]
        self.path = new
        self.last_write = t

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def split(self, data):
        e = self._take(data)
        at = data.draw(st.integers(e.snap.start, e.snap.end))
        left, right = self.cache.split(e.snap, at)
        self._consumed(e.snap)
        self._add(left, e.path[:at])
        self._add(right, e.path)
        assert (left.start, left.end, right.start, right.end) == (e.snap.start, at, at, e.snap.end)

    def _merge_pairs(self):
        return [
            (p, c)
            for p in self.entries
            for c in self.entries
            if p is not c and p.snap.end == c.snap.start and c.path[: c.snap.start] == p.path
        ]

    @precondition(lambda self: self._merge_pairs())
    @rule(data=st.data())
    def merge(self, data):
        p, c = data.draw(st.sampled_from(self._merge_pairs()))
        self.entries.remove(p)
        self.entries.remove(c)
        self.acct -= p.snap.nbytes + c.snap.nbytes
        merged = self.cache.merge(p.snap, c.snap)
        self._consumed(p.snap)
        self._consumed(c.snap)
        assert (merged.start, merged.end) == (p.snap.start, c.snap.end)
        self._add(merged, c.path)

    @precondition(lambda self: self.entries and self.window is not None)
    @rule(data=st.data())
    def compact(self, data):
        e = self._take(data)
        out = self.cache.compact(e.snap)
        if out is not e.snap:
            self._consumed(e.snap)
            assert not out.lazy and out.nbytes == (out.end - out.rows_start) * ROW_BYTES
            assert [t for t in range(out.start, out.end + 1) if out.reaches(t)] == [out.end]
        self._add(out, e.path)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def free_snapshot(self, data):
        e = self._take(data)
        e.snap.free()
        self._consumed(e.snap)
        with pytest.raises(RuntimeError):
            e.snap.free()

    @precondition(lambda self: len(self.forks) < 3)
    @rule(block=st.sampled_from([1, 2, 4]))
    def fork(self, block):
        c, split = self.cache, self.cache.offset // block * block
        if not c.share(block):
            assert split <= max(c.start_pos, c.valid_from) and not c.segments
            return
        assert c.segments[-1].end == c.start_pos
        assert c.start_pos >= split or c.valid_from >= split  # (what lies below valid_from is off the path)
        other = self.new_cache(c.step)
        other.attach(c)
        self.forks.append((other, list(self.path), other.offset))

    @precondition(lambda self: self.forks)
    @rule(data=st.data())
    def switch(self, data):
        """Go on driving one of the forks (rules act on `self.cache`)."""
        i = data.draw(st.integers(0, len(self.forks) - 1))
        other, path, last = self.forks[i]
        self.forks[i] = (self.cache, self.path, self.last_write)
        self.cache, self.path, self.last_write = other, path, last

    @rule()
    def free_cache(self):
        self.cache.free()
        self.path = []
        self.last_write = 0

    # -- invariants
    @invariant()
    def live_rows_are_the_truth(self):
        if hasattr(self, "cache"):
            assert_live(self.cache, self.path)

    @invariant()
    def forks_hold_their_truth_and_shared_rows_never_change(self):
        if not hasattr(self, "cache"):
            return
        caches = [self.cache, *(f[0] for f in self.forks)]
        for other, path, _ in self.forks:
            assert_live(other, path)
        for c in caches:
            assert [s.end for s in c.segments[:-1]] == [s.start for s in c.segments[1:]]
            assert not c.segments or c.segments[-1].end == c.start_pos
            for seg in c.segments:
                if id(seg) not in self.frozen:
                    self.frozen[id(seg)] = (seg, seg.k.clone(), seg.v.clone())
        for seg, k, v in self.frozen.values():
            assert torch.equal(seg.k.nan_to_num(7.0), k.nan_to_num(7.0)), "a shared row changed"
            assert torch.equal(seg.v.nan_to_num(7.0), v.nan_to_num(7.0)), "a shared row changed"
            assert seg.holders == sum(s is seg for c in caches for s in c.segments)
        for e in self.entries:
            assert e.snap.readers == sum(s.source is e.snap for c in caches for s in c.segments)
        buffers = {s.storage: s.nbytes for c in caches for s in c.segments if not s.in_trie}
        assert held_bytes(caches) == sum(c.nbytes for c in caches) + sum(buffers.values())

    @invariant()
    def bytes_are_accounted(self):
        if not hasattr(self, "cache"):
            return
        total, storages = 0, set()
        for e in self.entries:
            s = e.snap
            assert not s.closed
            if s.lazy:
                assert s.nbytes == 0 and s in s.owner._lazy
                continue
            for t in (s.k, s.v):
                assert_owns_exactly(t)
                ptr = t.untyped_storage().data_ptr()
                assert t.numel() == 0 or ptr not in storages, "two snapshots own one tensor"
                storages.add(ptr)
            total += s.nbytes
        assert self.acct == total == sum(e.snap.nbytes for e in self.entries)
        assert all(s.closed for s in self.consumed)
        caches = [self.cache, *(f[0] for f in self.forks)]
        assert sum(len(c._lazy) for c in caches) == sum(e.snap.lazy for e in self.entries)

    @invariant()
    def open_snapshots_restore_their_reach(self):
        if not hasattr(self, "cache") or not self.entries:
            return
        self.checks += 1
        for j in (self.checks % len(self.entries), -1):
            e = self.entries[j]
            snap = e.snap
            targets = sorted({snap.start, snap.end, (snap.start + snap.end) // 2})
            for t in targets:
                other = fresh_at(self.cache, list(e.path[: snap.start]))
                ok = other.restore(snap, t)
                assert ok == snap.reaches(t)
                if not ok:
                    continue
                lo = window_low(self.window, t)
                window = list(e.path[lo:t])
                assert all(i >= 0 for i in e.path[max(lo, snap.start) : t]), "reaches rows it never saw"
                if any(i < 0 for i in window):
                    continue  # the window before `start` is the parent's (the trie supplies it)
                assert_live(other, list(e.path[:t]))


class KVMachine(RowsMachine):
    window = None


class SlidingMachine(RowsMachine):
    window = 3


class TinySlidingMachine(RowsMachine):
    window = 1


_SETTINGS = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = _SETTINGS
TestSlidingMachine = SlidingMachine.TestCase
TestSlidingMachine.settings = _SETTINGS
TestTinySlidingMachine = TinySlidingMachine.TestCase
TestTinySlidingMachine.settings = settings(_SETTINGS, max_examples=20)
