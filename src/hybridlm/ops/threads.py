"""The team size of a decode step on a CPU that other processes share.

A decode step is ~300 short parallel regions. With one thread per core and another process busy on a
core, every region waits for the thread that the scheduler parked behind that process (a
Qwen3.5-0.8B-shaped step measured 10-30x slower with `yes` on one of 2 cores). So decode steps run on
the cores other processes leave idle: their busy time is /proc/stat's busy time of all CPUs (steal time
excluded) less this process's own CPU time, sampled at most every `INTERVAL` seconds.

Only decode-sized forwards (every linear in the row-wise kernels) change their team: those kernels
compute each output in one thread in a fixed order, so a step's numbers do not depend on how many
threads share it. Prompt chunks keep the configured team (torch's GEMMs may round differently with
another team size, and a long region loses only the slow thread's share, not a time slice per region).

``HYBRIDLM_ADAPT_THREADS=0`` keeps the configured team for every step.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["INTERVAL", "CoreShare", "decode_team", "decode_threads"]

# Seconds between samples of the other processes' CPU time (two small /proc reads each).
INTERVAL = 0.5


def _busy_and_total(cpus: set[int], stat: str = "/proc/stat") -> tuple[int, int] | None:
    """Busy and total jiffies since boot of the CPUs `cpus` from `stat`'s per-CPU lines (None where
    it cannot be read).

    Steal time counts as neither: it is the hypervisor running another machine on this virtual CPU,
    not a process here, and it hits a one-thread team as often as a two-thread one. Counted as busy,
    a cloud VM's 10-15 % steal on each of 2 vCPUs read as a third of a core taken, and a noisier
    neighbour's as half of one, which halved the decode team for nothing."""
    busy = total = 0
    try:
        with open(stat) as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if int(name[3:]) not in cpus:
                    continue
                fields = [int(v) for v in rest.split()]
                idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
                all_ = sum(fields[:7])  # user .. softirq; guest time is already inside user / nice
                busy, total = busy + all_ - idle, total + all_
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def _own_jiffies() -> int:
    """This process's user + system CPU time, in clock ticks."""
    times = os.times()
    return round((times.user + times.system) * os.sysconf("SC_CLK_TCK"))


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


class CoreShare:
    """How many of this process's CPUs other processes keep busy, sampled at most every `interval` s.

    `others()` is their busy time over the last completed sample, in cores (0.0 until two samples
    exist, or where /proc cannot be read)."""

    def __init__(self, interval: float = INTERVAL):
        self.interval = interval
        self._lock = threading.Lock()
        self._last: tuple[float, int, int, int] | None = None  # (time, busy, total, own)
        self._others = 0.0

    def others(self) -> float:
        now = time.monotonic()
        last = self._last
        if last is not None and now - last[0] < self.interval:
            return self._others
        with self._lock:
            cpus = allowed_cpus()
            sample = _busy_and_total(cpus)
            if sample is None:
                return 0.0
            busy, total = sample
            own = _own_jiffies()
            if self._last is not None and total > self._last[2]:
                _, busy0, total0, own0 = self._last
                # total counts the jiffies of each CPU of the set: a share of it, times their number,
                # is cores
                self._others = max(0.0, (busy - busy0) - (own - own0)) / (total - total0) * len(cpus)
            self._last = (now, busy, total, own)
            return self._others


SHARE = CoreShare()


def decode_threads(configured: int, share: CoreShare = SHARE) -> int:
    """The team for a decode step: `configured`, less the cores of this process's CPU set that other
    processes keep busy (rounded), at least 1."""
    if configured <= 1 or os.environ.get("HYBRIDLM_ADAPT_THREADS", "1") == "0":
        return configured
    free = len(allowed_cpus()) - round(share.others())
    return max(1, min(configured, free))


@contextmanager
def decode_team(share: CoreShare = SHARE) -> Iterator[int]:
    """Inside, this thread's torch / OpenMP team is `decode_threads` of its configured size (restored
    on exit); yields the team size."""
    configured = torch.get_num_threads()
    threads = decode_threads(configured, share)
    if threads == configured:
        yield threads
        return
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(configured)
