"""What a running sequence's caches cost, for admission: bytes of recurrent state and KV rows."""

from __future__ import annotations

import os
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
