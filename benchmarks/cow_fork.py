"""Forking n choices of one prompt: copy-on-write KV sharing against a private copy per fork.

    python benchmarks/cow_fork.py [--preset qwen3.5-0.8b] [--prompt 2048] [--n 8] [--runs 5] [--threads 2]

The source sequence's caches are those of the preset's model (`make_caches(1)`), brought to `--prompt`
tokens by writing random key / value rows into every attention layer (fork time and memory depend
only on the sizes held, never on the values; recurrent / conv states are copied at their fixed
size either way). Then `fork_caches` makes the n - 1 other choices, `--runs` times per mode,
interleaved: "copy" (each fork copies the prompt's rows: `KVCache.share` disabled, the fallback
path) and "cow" (the forks and the source read one shared buffer). Reported per mode: best and
spread of the fork time (ms, all n - 1 forks into caches made beforehand), the bytes the n
sequences' caches hold (`held_bytes`: a shared buffer counted once), and the few-query attention
kernel's time over the prompt for a decode row, one buffer vs the shared + own pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from hybridlm.batch import Batch
from hybridlm.bench.forward import preset_dir
from hybridlm.cache import KVCache
from hybridlm.cache.fork import fork_caches
from hybridlm.cache.kv import held_bytes
from hybridlm.models import load_model
from hybridlm.ops.attention import attention


def filled_caches(model, prompt: int, rows: dict) -> list:
    """The model's caches for one sequence at `prompt` tokens (random KV rows, zero states)."""
    caches = model.make_caches(1)
    batch = Batch.single([0] * prompt, 0)
    for cache in caches:
        if isinstance(cache, KVCache):
            k, v = rows[cache.window]
            cache.update(batch, k, v)
        elif cache is not None:
            cache.offsets = [prompt]
    return caches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-0.8b")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(preset_dir(args.preset), dtype=torch.bfloat16)
    attn = next(m for m in model.modules() if hasattr(m, "kv_heads"))
    kv_heads, head_dim = attn.kv_heads, attn.head_dim
    g = torch.Generator().manual_seed(0)
    shape = (1, kv_heads, args.prompt, head_dim)
    rows = {
        w: (torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16())
        for w in {c.window for c in model.make_caches(1) if isinstance(c, KVCache)}
    }
    times: dict[str, list[float]] = {"copy": [], "cow": []}
    held: dict[str, int] = {}
    share = KVCache.share
    for _ in range(args.runs):
        for mode in ("copy", "cow"):
            KVCache.share = share if mode == "cow" else (lambda self, block=0: False)
            try:
                source = filled_caches(model, args.prompt, rows)
                fresh = [model.make_caches(1) for _ in range(args.n - 1)]
                t0 = time.perf_counter()
                forks = [fork_caches(source, caches) for caches in fresh]
                times[mode].append((time.perf_counter() - t0) * 1e3)
            finally:
                KVCache.share = share
            every = [c for caches in [source, *forks] for c in caches]
            held[mode] = held_bytes(every)
            held[mode + " (KV only)"] = held_bytes([c for c in every if isinstance(c, KVCache)])
    # A decode row's attention over the prompt: one buffer, and the shared + own pair of a fork.
    q = torch.randn(1, attn.heads, 1, head_dim, generator=g).bfloat16()
    k, v = rows[None] if None in rows else next(iter(rows.values()))
    split = args.prompt // 64 * 64 - 64
    batch = Batch.single([0], args.prompt - 1)
    kernel: dict[str, list[float]] = {"one buffer": [], "shared + own": []}
    for _ in range(50):
        pair = {"k": k[:, :, split:], "v": v[:, :, split:], "prefix": [(k[:, :, :split], v[:, :, :split])]}
        for name, kw in (("one buffer", {"k": k, "v": v}), ("shared + own", pair)):
            t0 = time.perf_counter()
            attention(q, batch=batch, key_start=0, scale=head_dim**-0.5, **kw)
            kernel[name].append((time.perf_counter() - t0) * 1e6)
    report = {
        "preset": args.preset,
        "prompt": args.prompt,
        "n": args.n,
        "threads": args.threads,
        "load": os.getloadavg(),
        "fork_ms": {m: {"best": round(min(t), 2), "max": round(max(t), 2)} for m, t in times.items()},
        "held_MB": {m: round(b / 2**20, 1) for m, b in held.items()},
        "attention_us": {m: {"best": min(t), "median": statistics.median(t)} for m, t in kernel.items()},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
