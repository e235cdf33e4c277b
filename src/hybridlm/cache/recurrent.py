"""Caches of layers that fold tokens into a fixed-size state: `RecurrentCache` (Gated DeltaNet:
conv tail + float32 delta state), `Mamba2Cache` (Mamba-2: conv tail over xBC + float32 SSM state)
and `ConvCache` (LFM2 short convolution: conv tail only).

Range-restorable snapshots. The state after token t cannot be recovered from a later state, so
while `record` is on the cache keeps a *scan-input log*: for every token, what the layer's conv
and scan consume (the pre-conv projection and the gate inputs). A snapshot of `[a, c)` holds the
log of `[a, c)` plus a checkpoint (conv tail, state) at c; restoring to any t in `[a, c]` replays
conv + scan over `[a, t)` from the state at a with the layer-supplied `replay` function — no
projections, no MLP, no other layer. A *point* snapshot keeps only the checkpoint and restores
only to its end (the reference engine's behaviour).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from hybridlm.batch import Batch
from hybridlm.cache.base import LayerCache, Snapshot, tensor_bytes

ReplayFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | None],
]
"""(conv_tail [B, K-1, C], state | None, inputs [B, n, C], gates [B, n, G] | None) -> (conv_tail, state).
The cache hands over its own live state, which the function may advance in place."""


def copy_into(live: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
    """`src`'s values in the live buffer `live` when it is a compact tensor of the same shape (the
    live state is the cache's own: decode advances it in place), else in a new tensor. Reusing the
    buffer saves an allocation whose first touch page-faults: 18 fresh 1 MiB states cost ~40 ms."""
    if live is not None and live.shape == src.shape and live.dtype == src.dtype and compact(live) is live:
        return live.copy_(src)
    return src.clone()


def compact(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` itself if it owns exactly its bytes, else a compact copy (never pin a larger buffer)."""
    if t is None:
        return None
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class RecurrentHistory(NamedTuple):
    """What a recurrent/conv layer gets from its cache for one forward.

    conv_tail: [B, K-1, C] inputs before this forward; state: [B, H, Dk, Dv] float32 (None for a
    conv-only cache); splits: positions within the forward (1..L) where the layer must return the
    state (captures); record: whether to hand the scan inputs back with `put`.
    """

    conv_tail: torch.Tensor
    state: torch.Tensor | None
    splits: list[int]
    record: bool


class ScanSnapshot(Snapshot):
    """`[start, end)` of a scan cache: an optional input log and an optional checkpoint at end."""

    def __init__(self, start, end, inputs=None, gates=None, tail=None, state=None):
        self.start, self.end = start, end
        self.inputs, self.gates = inputs, gates
        self.tail, self.state = tail, state

    kind = "scan"
    TENSORS = ("inputs", "gates", "tail", "state")

    def to_state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a store needs to rebuild this snapshot: JSON-able fields (kind, start, end) and the
        tensors it holds among inputs [B, n, C], gates [B, n, G], tail [B, K-1, C] and state
        [B, H, Dk, Dv] (float32), n = end - start; absent ones are left out."""
        self._check_open()
        tensors = {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}
        return {"kind": self.kind, "start": self.start, "end": self.end}, tensors

    @classmethod
    def from_state(cls, fields: dict, tensors: dict[str, torch.Tensor]) -> ScanSnapshot:
        """The inverse of `to_state` (takes ownership of the tensors)."""
        return cls(fields["start"], fields["end"], *(tensors.get(name) for name in cls.TENSORS))

    @property
    def has_log(self) -> bool:
        return self.inputs is not None

    @property
    def has_checkpoint(self) -> bool:
        return self.tail is not None

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.inputs, self.gates, self.tail, self.state)

    def reaches(self, target: int) -> bool:
        if target == self.end and self.has_checkpoint:
            return True
        return self.has_log and self.start <= target <= self.end

    def standalone(self, target: int) -> bool:
        return target == self.end and self.has_checkpoint

    def _release(self) -> None:
        self.inputs = self.gates = self.tail = self.state = None


class ScanCache(LayerCache):
    """Shared machinery of recurrent and conv caches (state, input log, captures, replay)."""

    def __init__(self, conv_tail: torch.Tensor, state: torch.Tensor | None, replay: ReplayFn):
        super().__init__(conv_tail.shape[0])
        self.conv_tail = conv_tail
        self.state = state
        self.replay = replay
        self._log: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._log_start = 0

    @property
    def nbytes(self) -> int:
        logged = sum(tensor_bytes(x, g) for x, g in self._log)
        return tensor_bytes(self.conv_tail, self.state) + logged

    # ---- the model-facing view -----------------------------------------------------------
    def get(self, batch: Batch) -> RecurrentHistory:
        self._forward_begins(max(batch.query_lens))
        splits: list[int] = []
        if self._scheduled:
            now = self.offset
            splits = [o - now for o in self._scheduled if now < o <= now + batch.query_lens[0]]
        return RecurrentHistory(self.conv_tail, self.state, splits, self.record)

    def put(
        self,
        batch: Batch,
        conv_tail: torch.Tensor,
        state: torch.Tensor | None,
        boundary: list[tuple[torch.Tensor, torch.Tensor | None]] = (),
        inputs: torch.Tensor | None = None,
        gates: torch.Tensor | None = None,
    ) -> None:
        """Store the live state after this forward.

        boundary: (tail, state) at each split `get` asked for, in order; inputs [B, L, C] and
        gates [B, L, G]: the scan inputs of this forward, required while `record` is on.
        """
        old = self.offsets
        self.offsets = [o + n for o, n in zip(old, batch.query_lens, strict=True)]
        self.conv_tail, self.state = conv_tail, state
        if self.record:
            if inputs is None:
                raise ValueError("this cache records scan inputs: pass them to put()")
            if len(set(old)) != 1 or batch.padded:
                raise ValueError("recording scan inputs needs rows at one offset and no padding")
            if not self._log:
                self._log_start = old[0]
            self._log.append((compact(inputs), compact(gates)))
        if self._scheduled:
            for o, (tail, st) in zip(self._crossed(old[0], self.offset), boundary, strict=True):
                inputs_, gates_ = self._log_slice(self._capture_from, o)
                snap = ScanSnapshot(self._capture_from, o, inputs_, gates_, compact(tail), compact(st))
                if snap.tail is conv_tail or (state is not None and snap.state is state):
                    snap.tail, snap.state = tail.clone(), None if st is None else st.clone()
                self._keep_capture(snap)
                self._capture_from = o
            if self._captures:
                self._drop_log_before(self._capture_from)

    # ---- the input log -------------------------------------------------------------------
    def _log_slice(self, lo: int, hi: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Compact copies of the logged inputs/gates of [lo, hi), or (None, None) if not held. The
        log's pieces are joined once and kept joined: a forward crossing several capture offsets
        slices the same tensor (joining per slice copied the whole log each time, ~12 MB a layer
        per capture at 512 tokens of a Qwen3.5-0.8B shape)."""
        if not self.record or not self._log or lo < self._log_start:
            return None, None
        if len(self._log) > 1:
            gates = None if self._log[0][1] is None else torch.cat([g for _, g in self._log], dim=1)
            self._log = [(torch.cat([x for x, _ in self._log], dim=1), gates)]
        inputs, gates = self._log[0]
        i, j = lo - self._log_start, hi - self._log_start
        if j > inputs.shape[1]:
            return None, None
        return inputs[:, i:j].clone(), None if gates is None else gates[:, i:j].clone()

    def _drop_log_before(self, pos: int) -> None:
        if not self._log or pos == self._log_start:
            return
        inputs, gates = self._log_slice(pos, self.offset)
        self._log = [] if inputs is None else [(inputs, gates)]
        self._log_start = pos

    def _reset_log(self) -> None:
        self._log = []
        self._log_start = self.offset

    # ---- snapshot contract ---------------------------------------------------------------
    def snapshot(self, start: int) -> ScanSnapshot:
        end = self.offset
        if not 0 <= start <= end:
            raise ValueError(f"snapshot start {start} outside [0, {end}]")
        inputs, gates = self._log_slice(start, end) if start < end else (None, None)
        state = None if self.state is None else self.state.clone()
        snap = ScanSnapshot(start, end, inputs, gates, self.conv_tail.clone(), state)
        self._reset_log()
        return snap

    def can_rewind(self, target: int) -> bool:
        return target == self.offset

    def restore(self, snap: ScanSnapshot | None, target: int) -> bool:
        if snap is None:
            if not self.can_rewind(target):
                return False
        else:
            snap._check_open()
            if not snap.reaches(target):
                return False
            if target == snap.end and snap.has_checkpoint:
                self.conv_tail = copy_into(self.conv_tail, snap.tail)
                self.state = None if snap.state is None else copy_into(self.state, snap.state)
            elif snap.has_log and self.offset == snap.start:
                n = target - snap.start
                if n:
                    gates = None if snap.gates is None else snap.gates[:, :n]
                    self.conv_tail, self.state = self.replay(
                        self.conv_tail, self.state, snap.inputs[:, :n], gates
                    )
            else:
                return False
        self.offsets = [target] * self.batch_size
        self._reset_log()
        self._clear_schedule_after_restore()
        return True

    def split(self, snap: ScanSnapshot, at: int) -> tuple[ScanSnapshot, ScanSnapshot]:
        snap._check_open()
        if not snap.start <= at <= snap.end:
            raise ValueError(f"split point {at} outside [{snap.start}, {snap.end}]")
        i = at - snap.start
        cut = lambda t, lo, hi: None if t is None else t[:, lo:hi].clone()
        left = ScanSnapshot(snap.start, at, cut(snap.inputs, 0, i), cut(snap.gates, 0, i))
        right = ScanSnapshot(
            at, snap.end, cut(snap.inputs, i, None), cut(snap.gates, i, None), snap.tail, snap.state
        )
        if at == snap.end and snap.has_checkpoint:
            # Both halves end at `end`: each owns its own copy of the checkpoint (never one tensor twice).
            left.tail, left.state = snap.tail.clone(), None if snap.state is None else snap.state.clone()
        left.on_grow = right.on_grow = snap.on_grow
        snap.inputs = snap.gates = snap.tail = snap.state = None
        snap.free()
        return left, right

    def merge(self, parent: ScanSnapshot, child: ScanSnapshot) -> ScanSnapshot:
        parent._check_open()
        child._check_open()
        if parent.end != child.start:
            raise ValueError(f"cannot merge [{parent.start}, {parent.end}) with [{child.start}, {child.end})")
        inputs = gates = None
        if parent.has_log and child.has_log:
            inputs = torch.cat([parent.inputs, child.inputs], dim=1)
            if parent.gates is not None:
                gates = torch.cat([parent.gates, child.gates], dim=1)
        merged = ScanSnapshot(parent.start, child.end, inputs, gates, child.tail, child.state)
        merged.on_grow = parent.on_grow or child.on_grow
        child.tail = child.state = None
        parent.free()
        child.free()
        return merged

    def compact(self, snap: ScanSnapshot) -> ScanSnapshot:
        """Drop the input log of a snapshot that has a checkpoint (it then restores only to its
        end); a log without a checkpoint is kept, since nothing else reaches past its start."""
        if snap.has_checkpoint:
            snap.inputs = snap.gates = None
        return snap

    def free(self) -> None:
        self.conv_tail = torch.zeros_like(self.conv_tail)
        self.state = None if self.state is None else torch.zeros_like(self.state)
        self.offsets = [0] * self.batch_size
        self._log = []
        self._log_start = 0


class RecurrentCache(ScanCache):
    """Delta-rule layer cache (Gated DeltaNet; Kimi Delta Attention, whose conv runs over q‖k‖v):
    conv tail [B, K-1, conv_dim] in the activation dtype and delta state [B, H, Dk, Dv] in float32.
    What the log holds per token is the layer's choice, through the inputs / gates it hands to `put`
    and the `replay` it supplies."""

    def __init__(
        self, batch_size, conv_dim, kernel, heads, k_dim, v_dim, replay: ReplayFn, dtype, device=None
    ):
        tail = torch.zeros(batch_size, kernel - 1, conv_dim, dtype=dtype, device=device)
        state = torch.zeros(batch_size, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        super().__init__(tail, state, replay)


class Mamba2Cache(ScanCache):
    """Mamba-2 layer cache: conv tail [B, K-1, conv_dim] over the pre-conv x‖B‖C rows in the
    activation dtype, SSM state [B, H, P, N] in float32. Its scan-input log holds per token the
    pre-conv xBC row [conv_dim] and the raw time step dt [H] (inputs and gates of `ScanSnapshot`):
    replaying conv + state update over them from a checkpoint rebuilds the tail and state at any
    token, with the same bits as the forward that logged them (`ops/mamba2.py`: the step form)."""

    def __init__(
        self, batch_size, conv_dim, kernel, heads, head_dim, state_size, replay: ReplayFn, dtype, device=None
    ):
        tail = torch.zeros(batch_size, kernel - 1, conv_dim, dtype=dtype, device=device)
        state = torch.zeros(batch_size, heads, head_dim, state_size, dtype=torch.float32, device=device)
        super().__init__(tail, state, replay)


def conv_replay(conv_tail, state, inputs, gates):
    """Conv-only replay: the new tail is the last K-1 of (tail ++ inputs)."""
    return torch.cat([conv_tail, inputs], dim=1)[:, -conv_tail.shape[1] :].clone(), None


class ConvCache(ScanCache):
    """Short-convolution layer cache (LFM2): the last K-1 conv inputs [B, K-1, hidden]."""

    def __init__(self, batch_size, channels, kernel, dtype, device=None):
        tail = torch.zeros(batch_size, kernel - 1, channels, dtype=dtype, device=device)
        super().__init__(tail, None, conv_replay)
