"""The decode-priority time share of prefill: how much prompt work may run beside decoding streams.

A prompt that arrives while streams decode would otherwise add its whole prefill (seconds per chunk)
to their time per output token. While such late prompts wait, each engine step adds `share` × the
seconds its decode rows took to a credit; a late chunk runs once the credit covers its expected
seconds (the measured seconds per prefill token × its tokens) and is charged what it actually took.
Over the streams' life their prefill time stays within `share` × their decode time, so their time
per output token grows by at most a factor 1 + share; the late prompt's time to first token pays
for it. The credit grows every step a late prompt waits, so none is starved.
"""

from __future__ import annotations

from dataclasses import dataclass

EMA_WEIGHT = 0.2  # weight of the newest chunk in the seconds-per-token estimate


@dataclass
class PrefillShare:
    """share: late prefill seconds per decode second (> 0). credit: seconds of prefill late prompts
    may still run (negative: owed by the chunks that ran). seconds_per_token: the measured cost of
    prefill (an exponential average over every chunk run; None until one ran)."""

    share: float
    credit: float = 0.0
    seconds_per_token: float | None = None

    def open(self, decode_seconds: float, waiting: bool) -> None:
        """A step begins its prefill after decode rows took `decode_seconds`; `waiting`: whether a
        late prompt waits. Without one the surplus lapses (a debt stays: the streams are owed it)."""
        if waiting:
            self.credit += self.share * decode_seconds
        else:
            self.credit = min(self.credit, 0.0)

    def allows(self, tokens: int) -> bool:
        """Whether a late chunk of `tokens` tokens may run now."""
        expected = 0.0 if self.seconds_per_token is None else self.seconds_per_token * tokens
        return self.credit >= expected

    def ran(self, tokens: int, seconds: float, late: bool) -> None:
        """A chunk of `tokens` tokens took `seconds` (charged to the credit when `late`)."""
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * rate
        if late:
            self.credit -= seconds
