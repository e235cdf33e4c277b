"""`hybridlm bench restore`: restoring a cached prefix vs recomputing it, per layer kind.

A prompt of N tokens is prefilled once with restore points every `cadence` tokens (as the prefix
cache captures them). Recompute time per layer kind is that kind's share of a fresh prefill of the
prefix (forward hooks on each decoder layer: mixer + MLP). Restore time is, per layer, bringing a
*fresh* cache to the target from the snapshots — the worst case, nothing live to rewind:
- at a restore point (`end`): rows copied for attention, checkpoint copied for recurrent/conv;
- mid-range (`replay`): the target `cadence - 1` tokens past the last restore point before the
  end, so recurrent layers replay the longest stretch the capture plan allows.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from hybridlm.batch import Batch

KIND_NAMES = {
    "KVCache": "full attention",
    "SlidingKVCache": "sliding window",
    "RecurrentCache": "gated deltanet",
    "ConvCache": "short conv",
}


def _kind(cache) -> str:
    return KIND_NAMES.get(type(cache).__name__, type(cache).__name__)


class _LayerTimer:
    """Forward hooks adding each decoder layer's wall time to its layer kind."""

    def __init__(self, model, kinds: list[str]):
        self.kinds, self.spent, self.started = kinds, defaultdict(float), {}
        self.hooks = []
        for i, layer in enumerate(model.model.layers):
            self.hooks.append(layer.register_forward_pre_hook(self._pre(i)))
            self.hooks.append(layer.register_forward_hook(self._post(i)))

    def _pre(self, i):
        def hook(module, inputs):
            self.started[i] = time.perf_counter()

        return hook

    def _post(self, i):
        def hook(module, inputs, output):
            self.spent[self.kinds[i]] += time.perf_counter() - self.started[i]

        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def recompute_ms(model, ids: list[int], repeats: int = 2) -> dict[str, float]:
    """Milliseconds each layer kind spends in a fresh prefill of `ids` (best of `repeats`)."""
    kinds = [_kind(c) for c in model.make_caches(1)]
    best: dict[str, float] = {}
    for _ in range(repeats):
        timer = _LayerTimer(model, kinds)
        try:
            model(Batch.single(ids, device=model.device), model.make_caches(1))
        finally:
            timer.remove()
        for k, v in timer.spent.items():
            best[k] = min(best.get(k, float("inf")), v * 1e3)
    return best


def captured(model, ids: list[int], cadence: int):
    """Snapshots per layer covering [0, len(ids)) in `cadence`-token pieces (range-restorable)."""
    caches = model.make_caches(1)
    cuts = list(range(cadence, len(ids) + 1, cadence))
    if cuts[-1] != len(ids):
        cuts.append(len(ids))
    for c in caches:
        c.prepare_snapshots(cuts, ranges=True)
    for pos in range(0, len(ids), 512):
        model(Batch.single(ids[pos : pos + 512], offset=pos, device=model.device), caches)
    return [c.take_snapshots() for c in caches]


def restore_ms(model, snaps, target: int, repeats: int = 3) -> dict[str, float]:
    """Milliseconds per layer kind to bring fresh caches to `target` through the snapshots."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        spent: dict[str, float] = defaultdict(float)
        for cache, pieces in zip(model.make_caches(1), snaps, strict=True):
            path = [s for s in pieces if s.start < target]
            t0 = time.perf_counter()
            last = len(path) - 1
            # Fastest route for a fresh cache: the nearest standalone snapshot end, then forward.
            j = last
            while j > 0 and not path[j - 1].standalone(path[j - 1].end):
                j -= 1
            if j > 0:
                assert cache.restore(path[j - 1], path[j - 1].end)
            for snap in path[j:]:
                assert cache.restore(snap, min(snap.end, target)), (type(cache).__name__, target)
            if torch.device(model.device).type == "cuda":
                torch.cuda.synchronize()
            spent[_kind(cache)] += time.perf_counter() - t0
            cache.free()
        for k, v in spent.items():
            best[k] = min(best.get(k, float("inf")), v * 1e3)
    return best


def main(args) -> int:
    from hybridlm.bench.forward import bench_dtype, preset_dir
    from hybridlm.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"tokens": args.tokens, "cadence": args.cadence, "models": {}}
    rows = []
    load = lambda path: load_model(path, dtype=bench_dtype(args), device=args.device, quantize=args.quantize)
    for preset in args.preset or []:
        rows += _one_model(load(preset_dir(preset)), preset, args, report)
    if args.model or not args.preset:
        from hybridlm.demo import demo_model_dir

        path = args.model or demo_model_dir()
        rows += _one_model(load(path), Path(path).name, args, report)
    print(
        f"\nprefix of {args.tokens} tokens, restore points every {args.cadence}; fresh caches (nothing live)"
    )
    print(
        f"{'model':<22}{'layer kind':<16}{'recompute ms':>13}{'restore@end ms':>15}{'ratio':>8}"
        f"{'restore mid ms':>15}{'ratio':>8}"
    )
    for r in rows:
        print(
            f"{r['model']:<22}{r['kind']:<16}{r['recompute_ms']:>13.1f}{r['restore_end_ms']:>15.2f}"
            f"{r['ratio_end']:>7.0f}x{r['restore_mid_ms']:>15.2f}{r['ratio_mid']:>7.0f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _one_model(model, name: str, args, report: dict) -> list[dict]:
    print(f"{name}: prefill {args.tokens} tokens ...", flush=True)
    ids = torch.randint(10, model.vocab_size, (args.tokens,)).tolist()
    recompute = recompute_ms(model, ids)
    snaps = captured(model, ids, args.cadence)
    at_end = restore_ms(model, snaps, args.tokens)
    # The longest replay the plan allows: cadence - 1 tokens past the last restore point.
    mid_target = min(args.tokens - 1, (args.tokens - 1) // args.cadence * args.cadence + args.cadence - 1)
    mid = restore_ms(model, snaps, mid_target)
    rows = []
    for kind in recompute:
        rows.append(
            {
                "model": name,
                "kind": kind,
                "recompute_ms": recompute[kind],
                "restore_end_ms": at_end[kind],
                "ratio_end": recompute[kind] / max(at_end[kind], 1e-6),
                "restore_mid_ms": mid[kind],
                "ratio_mid": recompute[kind] / max(mid[kind], 1e-6),
                "mid_target": mid_target,
            }
        )
    report["models"][name] = rows
    for layer_snaps in snaps:
        for s in layer_snaps:
            s.free()
    return rows
