"""Sessions restoring the same trie node: KV rows read as shared segments against a copy per slot.

    python benchmarks/cow_restore.py [--preset qwen3.5-0.8b] [--prompt 2048] [--sessions 8] [--runs 5]
                                     [--threads 2]

One request prefills a `--prompt`-token prompt through a `PrefixCache` (default capture plan: a node
every 256 tokens and near the end, so the restored path is about a dozen nodes). Then, `--runs` times
per mode, interleaved, `--sessions` sessions are begun at once on that prompt plus one distinct
token each (every one restores the whole prompt into a slot of its own) and abandoned (their slots
reset, so the next run restores again): "copy" (`shares_restores` off on the slots' KV caches: each
slot copies the node path's rows, the previous behaviour) and "cow" (each slot reads the rows of the
node path's snapshots as segments). Reported per mode: best and spread of the time to begin all
sessions (ms; the recurrent / conv checkpoints are copied in both modes), the KV bytes held by the
trie and the slots together (`held_bytes`: a shared buffer counted once) and all bytes
(`ram_bytes + pinned_bytes`). Then the few-query attention kernel's time for a decode row over the
prompt: one buffer against the segments of a restored slot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from hybridlm.batch import Batch
from hybridlm.bench.forward import preset_dir
from hybridlm.cache import KVCache
from hybridlm.cache.kv import RowsSnapshot, held_bytes
from hybridlm.models import load_model
from hybridlm.ops.attention import attention
from hybridlm.prefix.cache import PrefixCache
from hybridlm.prefix.session import snap_bytes


def kv_bytes(pc: PrefixCache) -> int:
    """KV bytes the trie's snapshots and every slot's caches hold (each buffer once)."""
    trie = sum(snap_bytes(s) for n in pc.trie.nodes() for s in n.snaps if isinstance(s, RowsSnapshot))
    return trie + held_bytes([c for slot in pc.slots for c in slot.caches if isinstance(c, KVCache)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-0.8b")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(preset_dir(args.preset), dtype=torch.bfloat16)
    rng = random.Random(0)
    prompt = [rng.randrange(1, 1000) for _ in range(args.prompt)]
    pc = PrefixCache(model)
    pc.reserve(args.sessions + 1)
    with torch.no_grad():
        first = pc.begin(prompt + [1])
        while first.remaining:
            ids = first.remaining[:512]
            model(Batch.single(ids, offset=first.offset), first.caches)
            first.advance(ids)
        first.close()
    slot = first.slot  # reset like the others' will be (its live path would be a free rewind)
    for c in slot.caches:
        if c is not None:
            c.free()
            c.record = True
    slot.live = []
    times: dict[str, list[float]] = {"copy": [], "cow": []}
    held: dict[str, dict[str, float]] = {}
    nodes = len(pc.trie.match(prompt)[0])
    for _ in range(args.runs):
        for mode in ("copy", "cow"):
            for slot in pc.slots:
                for c in slot.caches:
                    if isinstance(c, KVCache):
                        c.shares_restores = mode == "cow"
            t0 = time.perf_counter()
            sessions = [pc.begin(prompt + [2 + i, 1]) for i in range(args.sessions)]
            times[mode].append((time.perf_counter() - t0) * 1e3)
            assert all(s.cached == args.prompt for s in sessions)
            held[mode] = {
                "kv_MB": round(kv_bytes(pc) / 2**20, 1),
                "all_MB": round((pc.ram_bytes + pc.pinned_bytes) / 2**20, 1),
            }
            if mode == "cow":
                cache = next(c for c in sessions[-1].caches if isinstance(c, KVCache))
                segments = [(seg.k, seg.v) for seg in cache.segments]
            for s in sessions:
                s.abandon()
    # A decode row's attention over the prompt: one buffer, and the segments of a restored slot.
    attn = next(m for m in model.modules() if hasattr(m, "kv_heads"))
    q = torch.randn(1, attn.heads, 1, attn.head_dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    k, v = torch.cat([k for k, _ in segments], dim=2), torch.cat([v for _, v in segments], dim=2)
    batch = Batch.single([0], args.prompt - 1)
    kw = dict(batch=batch, key_start=0, scale=attn.head_dim**-0.5)
    kernel: dict[str, list[float]] = {"one buffer": [], "segments": []}
    for _ in range(50):
        for name, args_ in (("one buffer", (k, v, ())), ("segments", (*segments[-1], segments[:-1]))):
            t0 = time.perf_counter()
            attention(q, args_[0], args_[1], prefix=args_[2], **kw)
            kernel[name].append((time.perf_counter() - t0) * 1e6)
    report = {
        "preset": args.preset,
        "prompt": args.prompt,
        "sessions": args.sessions,
        "threads": args.threads,
        "nodes_on_path": nodes,
        "segments_per_layer": len(segments),
        "load": os.getloadavg(),
        "begin_all_ms": {m: {"best": round(min(t), 1), "max": round(max(t), 1)} for m, t in times.items()},
        "held": held,
        "attention_us": {
            m: {"best": round(min(t), 1), "median": round(statistics.median(t), 1)} for m, t in kernel.items()
        },
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
