"""Model-free tests of the scan caches' contract (DESIGN.md §3.2): `RecurrentCache` and `ConvCache`.

A toy layer stands in for the model: token id i has conv input `EX[i]` and gate `EG[i]`; one step
shifts the input into the conv tail (the last K-1 inputs) and folds it into the state,
`state' = state * gate + input` (float32). The toy replay applies the same steps, so every path to
an offset (one forward, split forwards, replay from a capture, a checkpoint) must give bit-identical
state. `ConvCache` replays with the real `conv_replay`. The truth of a cache is the list of token
ids on its live path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridlm.batch import Batch
from hybridlm.cache import ConvCache, RecurrentCache, ScanSnapshot
from hybridlm.cache.recurrent import conv_replay

C, K, VOCAB = 3, 3, 1000
_gen = torch.Generator().manual_seed(4321)
EX = torch.randn(VOCAB, C, generator=_gen)
EG = torch.rand(VOCAB, 1, generator=_gen) * 0.5 + 0.25
DTYPES = {"recurrent": torch.float32, "conv": torch.bfloat16}
KINDS = ["recurrent", "conv"]


# ---- the toy layer -------------------------------------------------------------------------------
def toy_step(tail, state, x, g):
    """One token: x [B, 1, C], g [B, 1, 1] (None for conv-only)."""
    tail = torch.cat([tail, x], dim=1)[:, 1:]  # a view, on purpose: captures must copy it compactly
    if state is not None:
        state = state * g.reshape(-1, 1, 1, 1) + x.float().reshape(-1, 1, 1, C)
    return tail, state


def toy_replay(tail, state, inputs, gates):
    for i in range(inputs.shape[1]):
        g = None if gates is None else gates[:, i : i + 1]
        tail, state = toy_step(tail, state, inputs[:, i : i + 1], g)
    return tail, state


def make(kind: str):
    if kind == "recurrent":
        return RecurrentCache(1, C, K, 1, 1, C, toy_replay, torch.float32)
    return ConvCache(1, C, K, torch.bfloat16)


def inputs_of(kind: str, ids) -> tuple[torch.Tensor, torch.Tensor | None]:
    idx = torch.as_tensor(list(ids), dtype=torch.long)
    x = EX[idx].unsqueeze(0).to(DTYPES[kind])
    return x, (EG[idx].unsqueeze(0) if kind == "recurrent" else None)


def kind_of(cache) -> str:
    return "conv" if isinstance(cache, ConvCache) else "recurrent"


def forward(cache, ids):
    """What a recurrent / conv layer does with its cache in one forward."""
    kind = kind_of(cache)
    x, g = inputs_of(kind, ids)
    batch = Batch.single(ids, cache.offset)
    hist = cache.get(batch)
    assert hist.record == cache.record
    tail, state, boundary = hist.conv_tail, hist.state, []
    for i in range(len(ids)):
        tail, state = toy_step(tail, state, x[:, i : i + 1], None if g is None else g[:, i : i + 1])
        if i + 1 in hist.splits:
            boundary.append((tail, state))
    assert len(boundary) == len(hist.splits)
    logged = (x, g) if hist.record else (None, None)
    cache.put(batch, tail, state, boundary, inputs=logged[0], gates=logged[1])
    return hist


_TRUTH: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor | None]] = {}


def truth(kind: str, path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(conv tail, state) after `path` from zeros, one token at a time (memoized by prefix)."""
    path = tuple(path)
    i = len(path)
    while (kind, path[:i]) not in _TRUTH and i > 0:
        i -= 1
    if i == 0 and (kind, ()) not in _TRUTH:
        state = torch.zeros(1, 1, 1, C) if kind == "recurrent" else None
        _TRUTH[kind, ()] = (torch.zeros(1, K - 1, C, dtype=DTYPES[kind]), state)
    tail, state = _TRUTH[kind, path[:i]]
    x, g = inputs_of(kind, path[i:]) if i < len(path) else (None, None)
    for j in range(i, len(path)):
        gj = None if g is None else g[:, j - i : j - i + 1]
        tail, state = toy_step(tail, state, x[:, j - i : j - i + 1], gj)
        _TRUTH[kind, path[: j + 1]] = (tail, state)
    return tail, state


def assert_state(tail, state, kind: str, path) -> None:
    t_tail, t_state = truth(kind, path)
    assert torch.equal(tail, t_tail)
    assert (state is None and t_state is None) or torch.equal(state, t_state)


def assert_live(cache, path) -> None:
    assert cache.offset == len(path)
    assert_state(cache.conv_tail, cache.state, kind_of(cache), path)


def cache_at(kind: str, path):
    """A fresh cache sitting at `path` (restored from a checkpoint built from the truth)."""
    cache = make(kind)
    if path:
        tail, state = truth(kind, path)
        point = ScanSnapshot(0, len(path), tail=tail.clone(), state=None if state is None else state.clone())
        assert cache.restore(point, len(path))
        point.free()
    return cache


def signature(cache):
    st_ = None if cache.state is None else cache.state.clone()
    return cache.offset, cache.conv_tail.clone(), st_, cache.nbytes


def assert_unchanged(cache, before) -> None:
    after = signature(cache)
    assert after[0] == before[0] and after[3] == before[3]
    assert torch.equal(after[1], before[1])
    assert (after[2] is None and before[2] is None) or torch.equal(after[2], before[2])


def owned(snap: ScanSnapshot) -> list[torch.Tensor]:
    return [t for t in (snap.inputs, snap.gates, snap.tail, snap.state) if t is not None]


def assert_owns_exactly(t: torch.Tensor) -> None:
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), "a view pins a larger buffer"


def token_bytes(kind: str) -> int:
    x, g = inputs_of(kind, [0])
    return x.numel() * x.element_size() + (0 if g is None else g.numel() * g.element_size())


def state_bytes(cache) -> int:
    tail, s = cache.conv_tail, cache.state
    return tail.numel() * tail.element_size() + (0 if s is None else s.numel() * s.element_size())


def ids(n: int, base: int = 0) -> list[int]:
    return [(base + 7 * i) % VOCAB for i in range(n)]


def reach(snap: ScanSnapshot) -> list[int]:
    return [t for t in range(snap.start - 2, snap.end + 3) if snap.reaches(t)]


# ---- get / put / captures ------------------------------------------------------------------------
def test_toy_replay_and_conv_replay_agree_with_stepping():
    for kind in KINDS:
        path = ids(11)
        x, g = inputs_of(kind, path)
        start_tail, start_state = truth(kind, path[:4])
        replay = toy_replay if kind == "recurrent" else conv_replay
        for n in range(0, 8):
            gates = None if g is None else g[:, 4 : 4 + n]
            tail, state = replay(start_tail, start_state, x[:, 4 : 4 + n], gates)
            assert_state(tail, state, kind, path[: 4 + n])


def test_conv_replay_keeps_the_last_k_minus_1_inputs_compactly():
    tail = torch.arange(2 * 4 * 5, dtype=torch.float32).reshape(2, 4, 5)  # K - 1 = 4
    for n in range(0, 7):
        inputs = torch.randn(2, n, 5)
        out, state = conv_replay(tail, None, inputs, None)
        assert state is None
        assert torch.equal(out, torch.cat([tail, inputs], dim=1)[:, -4:])
        assert_owns_exactly(out)


@pytest.mark.parametrize("kind", KINDS)
def test_forwards_advance_the_state_like_one_token_at_a_time(kind):
    cache = make(kind)
    path: list[int] = []
    for n in [1, 5, 1, 12, 2]:
        new = ids(n, base=len(path))
        hist = forward(cache, new)
        assert hist.splits == [] and not hist.record
        path += new
        assert_live(cache, path)
    assert cache.nbytes == state_bytes(cache)  # nothing logged unless recording


@pytest.mark.parametrize("kind", KINDS)
def test_get_put_with_splits_returns_captures_whose_checkpoints_equal_the_truth(kind):
    cache = make(kind)
    path = ids(4)
    forward(cache, path)
    cache.prepare_snapshots([6, 9, 12])
    new = ids(8, base=100)
    hist = forward(cache, new)  # one forward crossing every scheduled offset
    path += new
    assert hist.splits == [2, 5, 8]
    caps = cache.take_snapshots()
    assert [(c.start, c.end) for c in caps] == [(4, 6), (6, 9), (9, 12)]
    assert cache.take_snapshots() == []
    for c in caps:
        assert c.has_checkpoint and not c.has_log  # not recording: point captures
        assert_state(c.tail, c.state, kind, path[: c.end])
        assert reach(c) == [c.end]
        for t in owned(c):
            assert_owns_exactly(t)
        assert c.tail is not cache.conv_tail and c.tail.untyped_storage().data_ptr() != (
            cache.conv_tail.untyped_storage().data_ptr()
        )
    assert_live(cache, path)


@pytest.mark.parametrize("kind", KINDS)
def test_capture_schedule_spanning_several_forwards(kind):
    cache = make(kind)
    cache.prepare_snapshots([2, 3, 9], ranges=True)
    path: list[int] = []
    splits = []
    for n in [1, 2, 1, 7]:
        new = ids(n, base=len(path))
        splits.append(forward(cache, new).splits)
        path += new
    assert splits == [[], [1, 2], [], [5]]
    caps = cache.take_snapshots()
    assert [(c.start, c.end) for c in caps] == [(0, 2), (2, 3), (3, 9)]
    for c in caps:
        assert c.has_log and c.has_checkpoint
        assert_state(c.tail, c.state, kind, path[: c.end])


@pytest.mark.parametrize("kind", KINDS)
def test_recorded_captures_restore_every_interior_offset_by_replay_from_their_start(kind):
    cache = make(kind)
    path = ids(5)
    forward(cache, path)
    cache.prepare_snapshots([8, 15], ranges=True)
    new = ids(10, base=300)
    forward(cache, new)
    path += new
    caps = cache.take_snapshots()
    assert [(c.start, c.end) for c in caps] == [(5, 8), (8, 15)]
    for c in caps:
        assert c.has_log and c.has_checkpoint
        assert reach(c) == list(range(c.start, c.end + 1))
        assert c.inputs.shape[1] == c.end - c.start
        for t in range(c.start, c.end + 1):
            other = cache_at(kind, path[: c.start])
            assert other.restore(c, t)
            assert_live(other, path[:t])
            forward(other, ids(2, base=9))  # and it runs on from there
            assert_live(other, path[:t] + ids(2, base=9))


@pytest.mark.parametrize("kind", KINDS)
def test_recorded_capture_from_any_other_offset_is_refused_and_changes_nothing(kind):
    cache = make(kind)
    path = ids(3)
    forward(cache, path)
    cache.prepare_snapshots([10], ranges=True)
    new = ids(7, base=40)
    forward(cache, new)
    path += new
    (cap,) = cache.take_snapshots()
    for at in [[], path[:2], path[:4], path[:10], ids(5, base=1)]:
        other = cache_at(kind, at)
        for t in range(3, 10):  # interior targets need the cache sitting at 3
            before = signature(other)
            assert not other.restore(cap, t)
            assert_unchanged(other, before)
        assert other.restore(cap, 10)  # the checkpoint restores its end from anywhere
        assert_live(other, path)


@pytest.mark.parametrize("kind", KINDS)
def test_point_snapshot_restores_only_to_its_end(kind):
    cache = make(kind)
    path = ids(9)
    forward(cache, path)
    snap = cache.snapshot(2)  # not recording: a point snapshot
    assert snap.has_checkpoint and not snap.has_log
    assert reach(snap) == [9]
    assert snap.nbytes == state_bytes(cache)
    for t in owned(snap):
        assert_owns_exactly(t)
    forward(cache, ids(4, base=20))
    for t in range(2, 9):
        other = cache_at(kind, path[:2])
        before = signature(other)
        assert not other.restore(snap, t)
        assert_unchanged(other, before)
    for at in [[], path[:2], ids(30, base=5)]:
        other = cache_at(kind, at)
        assert other.restore(snap, 9)
        assert_live(other, path)
    assert cache.restore(snap, 9)
    assert_live(cache, path)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("start", "logged"), [(3, False), (5, False), (6, True), (8, True), (9, False)])
def test_snapshot_has_a_log_only_for_a_range_recorded_since_the_last_capture_or_snapshot(kind, start, logged):
    cache = make(kind)
    path = ids(4)
    forward(cache, path)
    cache.prepare_snapshots([6], ranges=True)  # recording starts at 4
    new = ids(5, base=60)
    forward(cache, new)
    path += new
    (cap,) = cache.take_snapshots()
    assert (cap.start, cap.end) == (4, 6) and cap.has_log
    # the log now holds [6, 9): a snapshot from 6 or later has a log, from before 6 it is a point
    assert cache.nbytes == state_bytes(cache) + 3 * token_bytes(kind)
    snap = cache.snapshot(start)
    assert (snap.start, snap.end) == (start, 9)
    assert snap.has_log == logged and snap.has_checkpoint
    assert_state(snap.tail, snap.state, kind, path)
    for t in owned(snap):
        assert_owns_exactly(t)
    if logged:
        assert reach(snap) == list(range(start, 10))
        assert snap.nbytes == state_bytes(cache) + (9 - start) * token_bytes(kind)
        for t in range(start, 10):
            other = cache_at(kind, path[:start])
            assert other.restore(snap, t)
            assert_live(other, path[:t])
    else:
        assert reach(snap) == [9]
        assert snap.nbytes == state_bytes(cache)
    # a snapshot resets the log: only what follows it is logged
    assert cache.nbytes == state_bytes(cache)
    more = ids(2, base=start)
    forward(cache, more)
    assert cache.nbytes == state_bytes(cache) + 2 * token_bytes(kind)
    assert cache.snapshot(9).has_log
    # ... and so does a restore
    forward(cache, more)
    assert cache.restore(None, 13)
    assert cache.nbytes == state_bytes(cache)


@pytest.mark.parametrize("kind", KINDS)
def test_rewind_reaches_only_the_current_offset(kind):
    cache = make(kind)
    path = ids(6)
    forward(cache, path)
    for t in [0, 5, 7]:
        before = signature(cache)
        assert not cache.restore(None, t)
        assert_unchanged(cache, before)
    assert cache.restore(None, 6)
    assert_live(cache, path)


@pytest.mark.parametrize("kind", KINDS)
def test_recording_needs_the_scan_inputs(kind):
    cache = make(kind)
    cache.prepare_snapshots([3], ranges=True)
    batch = Batch.single([1, 2, 3])
    hist = cache.get(batch)
    assert hist.record and hist.splits == [3]
    with pytest.raises(ValueError):
        cache.put(batch, hist.conv_tail, hist.state, [(hist.conv_tail, hist.state)])


# ---- the log is bounded --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_log_never_holds_more_than_since_the_last_capture_or_snapshot(kind):
    cache = make(kind)
    cache.prepare_snapshots([1], ranges=True)
    path: list[int] = []
    since = 0  # where the log must start
    for i in range(40):
        new = ids(1 + i % 4, base=i)
        o = cache.offset
        if i % 3 == 0:
            cache.prepare_snapshots([o + len(new)])
        forward(cache, new)
        path += new
        for c in cache.take_snapshots():
            since = c.end
            assert c.nbytes == state_bytes(cache) + (c.end - c.start) * token_bytes(kind)
            c.free()
        if i % 7 == 6:
            cache.snapshot(since).free()
            since = cache.offset
        assert cache.nbytes == state_bytes(cache) + (cache.offset - since) * token_bytes(kind)
        assert cache.nbytes <= state_bytes(cache) + 12 * token_bytes(kind)
    assert_live(cache, path)


# ---- split / merge -------------------------------------------------------------------------------
def recorded_snapshot(kind: str, path: list[int], start: int, record: bool):
    cache = make(kind)
    forward(cache, path[:start])
    if record:
        cache.prepare_snapshots([len(path) + 1], ranges=True)
    forward(cache, path[start:])
    return cache, cache.snapshot(start)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("record", [True, False])
def test_split_then_merge_round_trips(kind, record):
    path = ids(10)
    for at in range(3, 11):
        cache, snap = recorded_snapshot(kind, path, 3, record)
        assert snap.has_log == record
        shape = (snap.start, snap.end, snap.has_log, snap.has_checkpoint, reach(snap), snap.nbytes)
        tensors = [t.clone() for t in owned(snap)]
        left, right = cache.split(snap, at)
        assert (left.start, left.end, right.start, right.end) == (3, at, at, 10)
        assert left.has_log == right.has_log == record
        assert right.has_checkpoint and left.has_checkpoint == (at == 10)
        assert reach(right) == (list(range(at, 11)) if record else [10])
        assert reach(left) == (list(range(3, at + 1)) if record else ([10] if at == 10 else []))
        for piece in (left, right):
            if piece.has_log:
                for t in range(piece.start, piece.end + 1):
                    other = cache_at(kind, path[: piece.start])
                    assert other.restore(piece, t)
                    assert_live(other, path[:t])
        merged = cache.merge(left, right)
        got = (merged.start, merged.end, merged.has_log, merged.has_checkpoint, reach(merged), merged.nbytes)
        assert got == shape
        assert all(torch.equal(a, b) for a, b in zip(owned(merged), tensors, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_split_at_the_end_does_not_share_the_checkpoint(kind):
    """Regression: both halves of a split at `end` owned the same checkpoint tensors (counted twice)."""
    path = ids(8)
    cache, snap = recorded_snapshot(kind, path, 2, record=False)
    total = snap.nbytes
    left, right = cache.split(snap, 8)
    assert left.has_checkpoint and right.has_checkpoint
    assert left.tail.untyped_storage().data_ptr() != right.tail.untyped_storage().data_ptr()
    assert left.nbytes == right.nbytes == total  # two checkpoints, each owned once
    left.free()
    other = make(kind)
    assert other.restore(right, 8)
    assert_live(other, path)


@pytest.mark.parametrize("kind", KINDS)
def test_split_and_merge_take_ownership_and_double_free_raises(kind):
    path = ids(8)
    cache, snap = recorded_snapshot(kind, path, 2, record=True)
    left, right = cache.split(snap, 5)
    assert snap.closed and snap.nbytes == 0
    with pytest.raises(RuntimeError):
        cache.split(snap, 4)
    with pytest.raises(RuntimeError):
        cache.restore(snap, 8)
    with pytest.raises(RuntimeError):
        snap.free()
    merged = cache.merge(left, right)
    for used in (left, right):
        assert used.closed
        with pytest.raises(RuntimeError):
            cache.merge(used, merged)
        with pytest.raises(RuntimeError):
            cache.restore(used, 5)
    with pytest.raises(ValueError):
        cache.merge(merged, merged)  # not adjacent
    merged.free()
    with pytest.raises(RuntimeError):
        merged.free()


# ---- speculation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("drafts", [1, 4])
def test_speculation_shape_restores_to_every_accepted_count(kind, drafts):
    p = 7
    for accepted in range(drafts + 1):
        cache = make(kind)
        path = ids(p)
        forward(cache, path)
        cache.prepare_snapshots([p + i for i in range(1, drafts + 1)])
        verify = ids(drafts + 1, base=500)  # the last real token plus the drafts, one forward
        hist = forward(cache, verify)
        path += verify
        assert hist.splits == list(range(1, drafts + 1))
        caps = cache.take_snapshots()
        assert [(c.start, c.end) for c in caps] == [(p + i, p + i + 1) for i in range(drafts)]
        target = p + 1 + accepted
        if accepted < drafts:
            assert cache.restore(caps[accepted], target)
        assert_live(cache, path[:target])
        nxt = ids(1, base=800)
        forward(cache, nxt)
        assert_live(cache, path[:target] + nxt)
        for c in caps:
            c.free()


# ---- the stateful model --------------------------------------------------------------------------
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)


@dataclass
class Entry:
    snap: ScanSnapshot
    path: tuple[int, ...]  # the tokens of the path it was taken on, [0, end)


class ScanMachine(RuleBasedStateMachine):
    kind = "recurrent"

    @initialize()
    def setup(self):
        self.cache = make(self.kind)
        self.path: list[int] = []
        self.entries: list[Entry] = []
        self.consumed: list[ScanSnapshot] = []
        self.acct = 0
        self.log_from = 0  # while recording, the log must hold exactly [log_from, offset)
        self.checks = 0

    def _grew(self, delta: int) -> None:
        self.acct += delta

    def _add(self, snap: ScanSnapshot, path) -> None:
        assert not snap.closed
        snap.on_grow = self._grew
        self.acct += snap.nbytes
        self.entries.append(Entry(snap, tuple(path)))
        if snap.has_checkpoint:
            assert_state(snap.tail, snap.state, self.kind, path[: snap.end])
        if snap.has_log:
            assert snap.inputs.shape[1] == snap.end - snap.start

    def _take(self, data) -> Entry:
        e = data.draw(st.sampled_from(self.entries))
        self.entries.remove(e)
        self.acct -= e.snap.nbytes
        return e

    def _forward(self, new) -> None:
        forward(self.cache, new)
        self.path += list(new)

    @rule(new=IDS)
    def write(self, new):
        self._forward(new)

    @rule(new=IDS, data=st.data(), ranges=st.booleans())
    def write_with_captures(self, new, data, ranges):
        o, n = self.cache.offset, len(new)
        offs = sorted(data.draw(st.lists(st.integers(o + 1, o + n), min_size=1, max_size=4, unique=True)))
        cut = data.draw(st.integers(0, n))
        if ranges and not self.cache.record:
            self.log_from = o
        self.cache.prepare_snapshots(offs, ranges=ranges)
        for part in (new[:cut], new[cut:]):
            if part:
                self._forward(part)
        caps = self.cache.take_snapshots()
        assert [(c.start, c.end) for c in caps] == list(zip([o, *offs[:-1]], offs, strict=True))
        for c in caps:
            assert c.has_checkpoint and c.has_log == self.cache.record
            self._add(c, self.path[: c.end])
        if self.cache.record:
            self.log_from = offs[-1]

    @rule(data=st.data())
    def snapshot(self, data):
        start = data.draw(st.integers(0, self.cache.offset))
        snap = self.cache.snapshot(start)
        assert snap.has_checkpoint
        assert snap.has_log == (self.cache.record and self.log_from <= start < snap.end)
        self._add(snap, self.path)
        self.log_from = self.cache.offset

    @rule(data=st.data())
    def rewind(self, data):
        t = data.draw(st.integers(max(0, self.cache.offset - 2), self.cache.offset + 1))
        before = signature(self.cache)
        ok = self.cache.restore(None, t)
        assert ok == (t == self.cache.offset)
        if ok:
            self.log_from = t
        else:
            assert_unchanged(self.cache, before)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def restore(self, data):
        here = [e for e in self.entries if e.snap.start == self.cache.offset and e.snap.has_log]
        e = data.draw(st.sampled_from(here if here and data.draw(st.booleans()) else self.entries))
        snap = e.snap
        t = data.draw(st.integers(snap.start - 1, snap.end + 1))
        from_checkpoint = t == snap.end and snap.has_checkpoint
        by_replay = snap.has_log and snap.start <= t <= snap.end and self.cache.offset == snap.start
        before = signature(self.cache)
        ok = self.cache.restore(snap, t)
        assert ok == (from_checkpoint or by_replay)
        if not ok:
            assert_unchanged(self.cache, before)
            return
        self.path = list(e.path[:t]) if from_checkpoint else self.path + list(e.path[snap.start : t])
        self.log_from = t

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def split(self, data):
        e = self._take(data)
        s = e.snap
        at = data.draw(st.integers(s.start, s.end))
        logged, ckpt = s.has_log, s.has_checkpoint
        left, right = self.cache.split(s, at)
        assert s.closed
        self.consumed.append(s)
        assert left.has_log == right.has_log == logged
        assert right.has_checkpoint == ckpt and left.has_checkpoint == (ckpt and at == s.end)
        self._add(left, e.path[:at])
        self._add(right, e.path)

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
        logged, ckpt = p.snap.has_log and c.snap.has_log, c.snap.has_checkpoint
        merged = self.cache.merge(p.snap, c.snap)
        assert p.snap.closed and c.snap.closed
        self.consumed += [p.snap, c.snap]
        assert (merged.start, merged.end, merged.has_log, merged.has_checkpoint) == (
            p.snap.start,
            c.snap.end,
            logged,
            ckpt,
        )
        self._add(merged, c.path)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def free_snapshot(self, data):
        e = self._take(data)
        e.snap.free()
        self.consumed.append(e.snap)
        with pytest.raises(RuntimeError):
            e.snap.free()

    @rule()
    def free_cache(self):
        self.cache.free()
        self.path = []
        self.log_from = 0

    # -- invariants
    @invariant()
    def live_state_is_the_truth(self):
        assert_live(self.cache, self.path)

    @invariant()
    def log_holds_only_what_follows_the_last_capture_or_snapshot(self):
        logged = (self.cache.offset - self.log_from) * token_bytes(self.kind) if self.cache.record else 0
        assert self.cache.nbytes == state_bytes(self.cache) + logged

    @invariant()
    def bytes_are_accounted(self):
        storages = set()
        for e in self.entries:
            assert not e.snap.closed
            for t in owned(e.snap):
                assert_owns_exactly(t)
                ptr = t.untyped_storage().data_ptr()
                assert t.numel() == 0 or ptr not in storages, "two snapshots own one tensor"
                storages.add(ptr)
            for t in (self.cache.conv_tail, self.cache.state):
                assert t is None or t.numel() == 0 or t.untyped_storage().data_ptr() not in storages
        assert self.acct == sum(e.snap.nbytes for e in self.entries)
        assert all(s.closed and s.nbytes == 0 for s in self.consumed)

    @invariant()
    def open_snapshots_restore_their_reach(self):
        if not self.entries:
            return
        self.checks += 1
        for j in (self.checks % len(self.entries), -1):
            e = self.entries[j]
            snap = e.snap
            for t in sorted({snap.start, (snap.start + snap.end) // 2, snap.end}):
                if snap.has_log:  # from the cache sitting at `start` on the snapshot's path
                    other = cache_at(self.kind, e.path[: snap.start])
                    assert other.restore(snap, t)
                    assert_live(other, e.path[:t])
                if t == snap.end and snap.has_checkpoint:  # from anywhere
                    other = cache_at(self.kind, e.path[: max(0, snap.start - 1)])
                    assert other.restore(snap, t)
                    assert_live(other, e.path[:t])
                if not snap.reaches(t) or (t < snap.end and snap.start > 0):
                    other = cache_at(self.kind, e.path[: snap.start - 1] if snap.start > 0 else ids(1))
                    before = signature(other)
                    assert not other.restore(snap, t)
                    assert_unchanged(other, before)


class RecurrentMachine(ScanMachine):
    kind = "recurrent"


class ConvMachine(ScanMachine):
    kind = "conv"


_SETTINGS = settings(
    max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRecurrentMachine = RecurrentMachine.TestCase
TestRecurrentMachine.settings = _SETTINGS
TestConvMachine = ConvMachine.TestCase
TestConvMachine.settings = _SETTINGS
