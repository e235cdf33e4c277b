"""The `Batch` every forward takes: right-padded token ids with per-row lengths and start offsets."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    """One forward's input.

    input_ids: [B, L] int64, right-padded; `query_lens[b]` ≤ L real tokens in row b.
    offsets: per-row position of the first token of this forward (= tokens already in the caches).
    memo: tensors derived once per forward (positions, masks) and shared by every layer.
    """

    input_ids: torch.Tensor
    query_lens: list[int]
    offsets: list[int]
    memo: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got {tuple(self.input_ids.shape)}")
        b, length = self.input_ids.shape
        if len(self.query_lens) != b or len(self.offsets) != b:
            raise ValueError("query_lens and offsets need one entry per row")
        if any(n < 0 or n > length for n in self.query_lens):
            raise ValueError(f"query_lens must lie in [0, {length}], got {self.query_lens}")

    @classmethod
    def single(cls, ids: list[int] | torch.Tensor, offset: int = 0, device=None) -> Batch:
        """A B = 1 batch of `ids` starting at position `offset`."""
        t = torch.as_tensor(ids, dtype=torch.long, device=device).reshape(1, -1)
        return cls(t, [t.shape[1]], [offset])

    @classmethod
    def ragged(
        cls, rows: list[list[int]], offsets: list[int] | None = None, device=None, pad_id: int = 0
    ) -> Batch:
        """Right-pad `rows` into one batch."""
        length = max(len(r) for r in rows)
        ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        return cls(ids.to(device), [len(r) for r in rows], list(offsets or [0] * len(rows)))

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def padded(self) -> bool:
        """True when some row has fewer real tokens than L."""
        return any(n != self.length for n in self.query_lens)

    def memoize(self, key, build):
        """Return `memo[key]`, building it once per forward."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    def positions(self) -> torch.Tensor:
        """[B, L] int64 absolute positions (padded positions continue the count)."""

        def build():
            base = torch.arange(self.length, device=self.device)
            return base[None, :] + torch.as_tensor(self.offsets, device=self.device)[:, None]

        return self.memoize("positions", build)

    def token_mask(self) -> torch.Tensor | None:
        """[B, L] bool, True on real tokens; None when no row is padded."""
        if not self.padded:
            return None

        def build():
            lens = torch.as_tensor(self.query_lens, device=self.device)
            return torch.arange(self.length, device=self.device)[None, :] < lens[:, None]

        return self.memoize("token_mask", build)


class Packed(Batch):
    """The rows of many sequences in one forward: `input_ids` [1, T] is their tokens end to end.

    segments: one B = 1 `Batch` per sequence (its tokens at its own offset); bounds: each segment's
    rows [start, end) in the packed T. Layers that take a `Packed` batch run their projections over
    all T rows at once (the weights are read once for every sequence) and their token mixers per
    segment, on that sequence's own caches, with the segment's `Batch` — so every cache sees exactly
    the forward it would see alone. Only models whose layers all do that take one (`CausalLM.packs`).
    """

    def __init__(self, segments: list[Batch]):
        if not segments or any(s.size != 1 for s in segments):
            raise ValueError("a packed batch needs one or more B = 1 segments")
        ids = torch.cat([s.input_ids[:, : s.query_lens[0]] for s in segments], dim=1)
        super().__init__(ids, [ids.shape[1]], [0])
        self.segments = segments
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for s in segments:
            self.bounds.append((start, start + s.query_lens[0]))
            start += s.query_lens[0]

    def positions(self) -> torch.Tensor:
        """[1, T] each row's absolute position in its own sequence."""
        return self.memoize("positions", lambda: torch.cat([s.positions() for s in self.segments], dim=1))
