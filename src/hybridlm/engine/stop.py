"""Stop strings matched on the output text across token boundaries, never released partially."""

from __future__ import annotations


class StopStrings:
    """Holds back output text that could still become a stop string.

    Text arrives in arbitrary pieces (token deltas). `feed` returns the part that can no longer be
    part of a match, plus the matched stop string once one completes; the text before the match is
    released and everything from the match on is dropped. Invariant: the held text is always the
    shortest suffix that is a proper prefix of some stop string, so a match can only start inside
    it and never in text already released.
    """

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add `text`; return what is safe to output. After a match (`matched` set) returns ''."""
        if self.matched is not None:
            return ""
        if not self._stops:
            return text
        held = self._held + text
        hits = [(i, s) for s in self._stops if (i := held.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)
            self._held = ""
            return held[:at]
        longest = max(len(s) for s in self._stops)
        keep = len(held)
        for start in range(max(0, len(held) - longest + 1), len(held)):
            tail = held[start:]
            if any(s.startswith(tail) for s in self._stops):
                keep = start
                break
        self._held = held[keep:]
        return held[:keep]

    def flush(self) -> str:
        """At the end of the output: the held text, which turned out not to be a stop string."""
        held, self._held = self._held, ""
        return held
