"""Decode step time per family: 1 sequence, N sequences as N separate forwards (what a family that does
not pack costs in an engine step), and N sequences packed into one `forward_packed`.

    python benchmarks/packing.py [--families ...] [--sequences 8] [--threads 2] [--steps 20]

Each family runs on a random checkpoint (bf16) written once under ~/.cache/hybridlm/: the published
small shapes of `hybridlm.presets.PRESETS` for Qwen3.5 / LFM2 / Gemma 3 (shared with `hybridlm bench
forward --preset`), and under packing/ scaled-down shapes for Qwen3-Next (MoE) and Gemma 4 (per-layer
inputs, KV-shared layers), whose smallest published checkpoints are too large for this shared machine.
Every sequence first prefills its own `--context` tokens; a step then feeds each its next token at
its own offset. Reported: the median step over `--steps` (after 2 warm-up steps) in wall and process
CPU milliseconds, and what packing saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from hybridlm.batch import Batch
from hybridlm.bench.forward import preset_dir
from hybridlm.models import load_model
from hybridlm.models.base import forward_packed
from hybridlm.models.random import cached_random_checkpoint

# Qwen3-Next's published structure (3 Gated DeltaNet layers per gated attention layer, routed
# experts with a sigmoid-gated shared expert on every layer), at 1/2 width and 1/6 depth, 64 experts.
QWEN3_NEXT_SMALL = {
    "model_type": "qwen3_next",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}

# Gemma 4 E2B's structure (sliding layers with one global layer in four, per-layer inputs of 256,
# the last layers sharing keys/values, double-wide MLP there) at 2/3 width, 12 layers, a 32 Ki vocabulary.
GEMMA4_SMALL = {
    "model_type": "gemma4_text",
    "vocab_size": 32768,
    "vocab_size_per_layer_input": 32768,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 12,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 512,
    "hidden_size_per_layer_input": 256,
    "num_kv_shared_layers": 4,
    "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
}

# family -> a `hybridlm.presets.PRESETS` name or a shape of this file
SHAPES = {
    "qwen3.5": "qwen3.5-0.8b",
    "qwen3-next": QWEN3_NEXT_SMALL,
    "lfm2": "lfm2-350m",
    "gemma3": "gemma3-270m",
    "gemma4": GEMMA4_SMALL,
}


def checkpoint(family: str) -> Path:
    """The family's random checkpoint: a preset's is shared with `hybridlm bench forward --preset`."""
    if isinstance(SHAPES[family], str):
        return preset_dir(SHAPES[family])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridlm" / "packing"
    return cached_random_checkpoint(SHAPES[family], base / family, family)


def median_ms(step, steps: int) -> tuple[float, float]:
    """Median wall and process-CPU milliseconds of `step()` over `steps` calls after 2 warm-up calls
    (on a loaded machine CPU time leaves out the time spent waiting for a core)."""
    wall, cpu = [], []
    for i in range(steps + 2):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        if i >= 2:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return 1000 * statistics.median(wall), 1000 * statistics.median(cpu)


def measure(family: str, sequences: int, steps: int, context: int) -> dict:
    model = load_model(checkpoint(family), device="cpu")
    g = torch.Generator().manual_seed(0)

    def prefilled(n: int) -> tuple[list[list], list[int]]:
        caches = [model.make_caches(1) for _ in range(n)]
        for c in caches:
            model(Batch.single(torch.randint(1, model.vocab_size, (context,), generator=g)), c)
        return caches, [context] * n

    def token() -> list[int]:
        return [int(torch.randint(1, model.vocab_size, (1,), generator=g))]

    def separate(caches, offsets):
        def step():
            for i, c in enumerate(caches):
                model(Batch.single(token(), offset=offsets[i]), c)
                offsets[i] += 1

        return step

    def packed(caches, offsets):
        def step():
            segments = [Batch.single(token(), offset=o) for o in offsets]
            forward_packed(model, segments, caches, ["last"] * len(caches))
            for i in range(len(offsets)):
                offsets[i] += 1

        return step

    one, one_cpu = median_ms(separate(*prefilled(1)), steps)
    apart, apart_cpu = median_ms(separate(*prefilled(sequences)), steps)
    together, together_cpu = median_ms(packed(*prefilled(sequences)), steps)
    return {
        "family": family,
        "model_type": model.config.model_type,
        "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "sequences": sequences,
        "one_ms": round(one, 2),
        "separate_ms": round(apart, 2),
        "packed_ms": round(together, 2),
        "packed_vs_separate": round(apart / together, 2),
        "packed_vs_one": round(together / one, 2),
        "cpu_one_ms": round(one_cpu, 2),
        "cpu_separate_ms": round(apart_cpu, 2),
        "cpu_packed_ms": round(together_cpu, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--context", type=int, default=128, help="tokens each sequence prefills first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    rows = []
    load = os.getloadavg()
    print(f"threads {args.threads}, {args.sequences} sequences, context {args.context}, load {load}")
    for family in args.families:
        row = measure(family, args.sequences, args.steps, args.context)
        rows.append(row)
        print(
            f"{family:10s} {row['parameters_m']:6.1f} M | wall: 1 seq {row['one_ms']:7.1f} ms, "
            f"{args.sequences} separate {row['separate_ms']:7.1f}, {args.sequences} packed "
            f"{row['packed_ms']:7.1f} ({row['packed_vs_separate']:.2f}x faster than separate, "
            f"{row['packed_vs_one']:.2f}x one step) | CPU: {row['cpu_one_ms']:.1f} / "
            f"{row['cpu_separate_ms']:.1f} / {row['cpu_packed_ms']:.1f} ms",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
