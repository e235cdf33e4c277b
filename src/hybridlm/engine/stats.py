"""Engine counters and latency histograms, read by `/metrics` (the server renders them)."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

# Seconds; covers sub-millisecond decode steps of tiny models up to minutes-long prefills.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


@dataclass
class Histogram:
    """Latency histogram: `counts[i]` counts values in (buckets[i-1], buckets[i]], the last entry those
    above the top bucket; `cumulative()` gives Prometheus' `le` counts."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        """An independent copy (readers copy under the stats lock, then render unlocked)."""
        out = Histogram(self.buckets, sum=self.sum, count=self.count)
        out.counts = list(self.counts)
        return out

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


# Rows (tokens) per engine step: one decode row per sequence up to prefill chunks beside them.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class EngineStats:
    """Totals since start. Written by the engine thread under `lock`; readers copy under it too."""

    finished: Counter = field(default_factory=Counter)  # requests by finish reason
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0  # counted as tokens are produced, so cancelled requests show up live
    queue_seconds: Histogram = field(default_factory=Histogram)
    time_to_first_token_seconds: Histogram = field(default_factory=Histogram)
    prefill_seconds: Histogram = field(default_factory=Histogram)
    time_per_output_token_seconds: Histogram = field(default_factory=Histogram)
    e2e_seconds: Histogram = field(default_factory=Histogram)
    step_seconds: Histogram = field(default_factory=Histogram)  # one engine step (all running sequences)
    batch_rows: Histogram = field(default_factory=lambda: Histogram(ROW_BUCKETS))  # tokens per step
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def histograms(self) -> dict[str, Histogram]:
        return {
            "queue_seconds": self.queue_seconds,
            "time_to_first_token_seconds": self.time_to_first_token_seconds,
            "prefill_seconds": self.prefill_seconds,
            "time_per_output_token_seconds": self.time_per_output_token_seconds,
            "e2e_request_latency_seconds": self.e2e_seconds,
            "step_seconds": self.step_seconds,
            "batch_rows": self.batch_rows,
        }
