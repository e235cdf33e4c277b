"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the request's
own last few tokens (no extra model). Pays off where outputs repeat their input (code edits,
quoting, summaries, structured data) and on self-repeating generations."""

from __future__ import annotations

from hybridlm.speculative.base import Draft, Drafter, TargetPolicy


class NgramDrafter(Drafter):
    """Longest recent n-gram match, n from `max_n` down to `min_n`.

    An index per n maps each n-gram to the position right after its latest occurrence that is
    followed by a token (so never the run's own suffix); it grows incrementally as the run grows,
    so a proposal costs O(new tokens · max_n), not O(run length). The draft copies up to k tokens
    from there; when the copy reaches the end of the run it continues periodically (a run that
    repeats with period P is predicted to keep repeating).
    """

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        """Deterministic drafts (one-hot q): up to `k` tokens, none when nothing matches."""
        end = len(tokens)
        if end < self._indexed:  # not an extension of the run seen so far: start over
            self.close()
        for e in range(max(self._indexed, 1), end):
            for n, index in self._index.items():
                if e >= n:
                    index[tuple(tokens[e - n : e])] = e
        self._indexed = max(self._indexed, end)
        for n in range(self.max_n, self.min_n - 1, -1):
            if end < n:
                continue
            start = self._index[n].get(tuple(tokens[end - n :]))
            if start is not None:
                return Draft(self._copy(tokens, start, k))
        return Draft([])

    @staticmethod
    def _copy(tokens: list[int], start: int, k: int) -> list[int]:
        """tokens[start : start + k], continued with period len(tokens) - start past the end."""
        end, out = len(tokens), []
        for j in range(k):
            src = start + j
            out.append(tokens[src] if src < end else out[src - end])
        return out

    def close(self) -> None:
        for index in self._index.values():
            index.clear()
        self._indexed = 0
