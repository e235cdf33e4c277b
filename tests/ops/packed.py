"""Shared by the packed-kernel property tests: where ragged sequences sit in a packed input."""

from __future__ import annotations

from hypothesis import strategies as st


def packed_layout(data, lens: list[int]) -> tuple[list[int], int, list[list[int]]]:
    """Draw 0-2 unused rows before each sequence of `lens` tokens and up to 3 sorted split points in
    each: (first row of each sequence, rows in all, splits per sequence)."""
    gaps = data.draw(st.lists(st.integers(0, 2), min_size=len(lens), max_size=len(lens)), label="gaps")
    splits = [sorted(data.draw(st.lists(st.integers(0, n), max_size=3), label="splits")) for n in lens]
    starts, end = [], 0
    for n, gap in zip(lens, gaps, strict=True):
        starts.append(end + gap)
        end += gap + n
    return starts, end, splits
