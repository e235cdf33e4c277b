"""What a running sequence's caches cost, for admission: bytes of recurrent state and KV rows; and
handing freed heap memory back to the system."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridlm.models.base import CausalLM
from hybridlm.ops.attention import KEY_BLOCK


def available_memory() -> int:
    """Bytes of memory the system can still hand out (Linux `MemAvailable`; else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class CacheCost:
    """Bytes one sequence's caches hold: `fixed` (recurrent / conv states), plus per attention layer
    `row` bytes a token (keys and values), a sliding one for at most its window (+ the 256-row growth
    step its buffer may hold beyond it)."""

    fixed: int
    row: int
    windows: tuple[int | None, ...]

    @classmethod
    def of(cls, model: CausalLM) -> CacheCost:
        fixed, windows = 0, []
        for cache in model.make_caches(1):
            if cache is None:
                continue
            if hasattr(cache, "state"):  # recurrent / conv: fixed-size tail and scan state
                fixed += cache.nbytes
            else:
                windows.append(cache.window)
        itemsize = torch.empty((), dtype=model.dtype).element_size()
        # Counted at the widest attention layer's row size (an estimate for admission, never low).
        rows = [2 * m.kv_heads * m.head_dim * itemsize for m in model.modules() if hasattr(m, "kv_heads")]
        return cls(fixed, max(rows, default=0), tuple(windows))

    def bytes(self, tokens: int) -> int:
        """Bytes of a sequence holding `tokens` tokens."""
        held = [tokens if w is None else min(tokens, w + 256) for w in self.windows]
        return self.fixed + self.row * sum(held)

    def fork_bytes(self, prompt: int, tokens: int) -> int:
        """Bytes of a fork taken after a `prompt`-token prefill, holding `tokens` tokens: its KV rows
        before the prompt rounded down to the key block are shared (`KVCache.share`, counted once, by
        the sequence it forked from), the rest are its own."""
        return self.bytes(tokens - prompt // KEY_BLOCK * KEY_BLOCK)


log = logging.getLogger(__name__)

# Released prefix-cache bytes between two trims.
TRIM_EVERY = 256 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Hands the heap's free pages back to the system (glibc `malloc_trim`) after every `every`
    bytes the prefix cache released. Snapshots are many small tensors (a demo-model server at its
    budget holds ~150 k); the holes their evictions leave stay resident in glibc's heap: at a 4 GiB
    budget (4096 MiB of live tensors, 370 MiB of process beside them) a server held 5824–5939 MiB,
    and 4970–5040 MiB after a trim. A trim of a ~3.5 GB heap takes 18–20 ms; the engine runs it between
    steps."""

    def __init__(self, every: int = TRIM_EVERY):
        self.every, self.mark, self._trim = every, 0, _malloc_trim()

    def __call__(self, released: int) -> bool:
        """Trim if `released` (a count that only grows) passed the last trim's by `every`; whether
        it did."""
        if self._trim is None or released - self.mark < self.every:
            return False
        self.mark = released
        t0 = time.perf_counter()
        self._trim(0)
        spent = (time.perf_counter() - t0) * 1e3
        log.debug("event=heap_trimmed released_mib=%d ms=%.1f", released >> 20, spent)
        return True
