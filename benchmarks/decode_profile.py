"""Where a decode step's time goes: per-op wall time of single-token steps, beside the weight bytes.

    PYTHONPATH=src python benchmarks/decode_profile.py --preset qwen3.5-0.8b --quantize int4 --threads 2
    PYTHONPATH=src python benchmarks/decode_profile.py --sequences 8 --context 512 --threads 2

Each leaf op the layers call (every linear layer by shape, the causal conv, the gated delta scan,
attention, rotary, the MLP activation, norms, the embedding) is timed around its call; "rest" is
the step's time outside them (the Python of the layers and blocks, residual adds, cache
bookkeeping, the logits' float conversion). The timers wrap the modules, so the timed steps run
through them (`without_plans`); a step with the timers is a little slower than one without, and a
one-sequence step by the model's decode plan (`models.decode`) faster still (all three printed).
Linear rows show GB/s of the bytes they read (weights as stored, scales included), and the step's
bandwidth limit is the read bandwidth ÷ all those bytes.

With ``--sequences N`` a step is one `forward_packed` over N sequences, each with its own caches
prefilled with its own ``--context`` tokens (at offsets ``context + i``, so no two are aligned), one
decode row each: the engine's decode step at N running sequences.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch

import hybridlm.models.layers as layers_mod
from hybridlm.batch import Batch
from hybridlm.bench.forward import prefilled_sequences, preset_dir
from hybridlm.bench.limits import memory_bandwidth_gbs
from hybridlm.models import load_model
from hybridlm.models.base import forward_packed
from hybridlm.models.decode import without_plans
from hybridlm.ops import norms
from hybridlm.ops.linear import Linear
from hybridlm.ops.quant import QuantLinear
from hybridlm.ops.sampling import greedy

# functions the layers module calls by its own global name: patched there
LAYER_FUNCTIONS = (
    "causal_conv1d", "gated_delta_net_scan", "attention", "apply_rotary", "elementwise_rows",
    "causal_conv1d_packed", "gated_delta_net_scan_packed", "attention_packed",
)
TIMED_MODULES = (
    Linear, QuantLinear, norms.RMSNorm, norms.OffsetRMSNorm, norms.GatedRMSNorm, torch.nn.Embedding,
)


def layer_bytes(layer: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))


def label(module: torch.nn.Module) -> str:
    if isinstance(module, (Linear, QuantLinear)):
        return f"linear {module.out_features}x{module.in_features}"
    return type(module).__name__


def steps(model, caches, logits, offsets: list[int], count: int) -> tuple[list[float], list, list[int]]:
    """`count` greedy decode steps of every sequence (`caches[i]`, its `logits[i]` [1, V], at
    `offsets[i]`): one forward for one sequence, one packed forward for several; (seconds of each
    step, last logits, next offsets)."""
    times = []
    for _ in range(count):
        segments = [
            Batch.single([int(greedy(x)[0])], offset=o, device=model.device)
            for x, o in zip(logits, offsets, strict=True)
        ]
        t0 = time.perf_counter()
        if len(caches) == 1:
            logits = [model(segments[0], caches[0])]
        else:
            logits = forward_packed(model, segments, caches, ["last"] * len(caches))
        times.append(time.perf_counter() - t0)
        offsets = [o + 1 for o in offsets]
    return times, logits, offsets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-0.8b")
    p.add_argument("--quantize", choices=["int8", "int4"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128, help="prefill tokens before the steps")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--sequences", type=int, default=1, help="sequences packed into each step")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    model = load_model(preset_dir(args.preset), dtype=torch.bfloat16, quantize=args.quantize)
    bandwidth = memory_bandwidth_gbs()
    offsets = [args.context + i for i in range(args.sequences)]
    caches, logits = prefilled_sequences(model, offsets)
    plain, logits, offsets = steps(model, caches, logits, offsets, args.steps + 3)
    plain = sorted(plain[3:])
    with without_plans():
        modular, logits, offsets = steps(model, caches, logits, offsets, args.steps + 3)
    modular = sorted(modular[3:])

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    nbytes: dict[str, int] = collections.defaultdict(int)

    def timed(name: str, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
            return out
        return run

    originals = {name: getattr(layers_mod, name) for name in LAYER_FUNCTIONS}
    for name, fn in originals.items():
        setattr(layers_mod, name, timed(name, fn))
    handles = []
    for module in model.modules():
        if isinstance(module, TIMED_MODULES):
            name = label(module)
            if isinstance(module, (Linear, QuantLinear)):
                nbytes[name] += layer_bytes(module)
            module.forward = timed(name, module.forward)
            handles.append(module)
    try:
        with without_plans():  # the plan calls the kernels directly: time the modules' path
            _, logits, offsets = steps(model, caches, logits, offsets, 3)
            spent.clear()
            calls.clear()
            profiled, _, _ = steps(model, caches, logits, offsets, args.steps)
    finally:
        for name, fn in originals.items():
            setattr(layers_mod, name, fn)
        for module in handles:
            del module.forward

    n = args.steps
    step = sum(profiled) / n
    total_bytes = sum(nbytes.values())
    print(f"{args.preset} {args.quantize or 'bf16'}, {args.threads} threads, {args.sequences} sequence(s), "
          f"{args.context}-token context, "
          f"read bandwidth {bandwidth:.1f} GB/s, load {os.getloadavg()[0]:.2f}")
    print(f"step: {plain[len(plain) // 2] * 1e3:.2f} ms median (decode plan), through the modules "
          f"{modular[len(modular) // 2] * 1e3:.2f} ms without timers, {step * 1e3:.2f} ms mean "
          f"with; {total_bytes / 1e6:.1f} MB of linear weights a step: limit "
          f"{bandwidth * 1e9 / total_bytes:.1f} tok/s ({total_bytes / bandwidth / 1e6:.2f} ms)")
    print(f"{'op':<28}{'calls':>6}{'ms/step':>9}{'share':>7}{'GB/s':>7}")
    linear_time = sum(t for name, t in spent.items() if name.startswith("linear"))
    for name in sorted(spent, key=lambda k: -spent[k]):
        ms = spent[name] / n * 1e3
        gbs = f"{nbytes[name] / (spent[name] / n) / 1e9:7.1f}" if name in nbytes else ""
        print(f"{name:<28}{calls[name] // n:>6}{ms:>9.2f}{spent[name] / n / step:>7.0%}{gbs}")
    rest = step - sum(spent.values()) / n
    print(f"{'rest (python, adds, caches)':<28}{'':>6}{rest * 1e3:>9.2f}{rest / step:>7.0%}")
    print(f"linears {linear_time / n * 1e3:.2f} ms ({total_bytes / (linear_time / n) / 1e9:.1f} GB/s), "
          f"everything else {(step - linear_time / n) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
