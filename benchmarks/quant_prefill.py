"""Prefill tok/s of the bf16 model and its int8 / int4 quantizations, interleaved in one process.

    python benchmarks/quant_prefill.py [--preset qwen3.5-0.8b] [--threads 2] [--tokens 512] [--rounds 3]

Each round times one fresh prefill of every model in turn (best of 2 after a warm-up), so the three
share the machine's state minute by minute; prints each round and the best and spread per model.
``HYBRIDLM_INT8_PREFILL=0`` measures the dequantized bf16 path instead of the integer one.
"""

import argparse

import torch

from hybridlm.bench.forward import preset_dir, time_prefill
from hybridlm.models import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3.5-0.8b")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = preset_dir(args.preset)
    models = {s or "bf16": load_model(path, dtype=torch.bfloat16, quantize=s) for s in (None, "int8", "int4")}
    runs: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        for name, model in models.items():
            runs[name].append(args.tokens / time_prefill(model, args.tokens))
        print(f"round {r}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in runs.items()), flush=True)
    for name, v in runs.items():
        print(f"{name:<5} prefill {args.tokens}: best {max(v):.1f} tok/s, spread {min(v):.1f}..{max(v):.1f}")


if __name__ == "__main__":
    main()
