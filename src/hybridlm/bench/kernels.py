"""`hybridlm bench kernels`: each C kernel on a decode- or prompt-shaped call, at every ISA level this
CPU runs (`ops.native.isa_levels`: the build each level's machines get), beside the machine's limits.

Memory-bound kernels (decode: weights, KV rows, recurrent state) report GB/s of the bytes the call
must move, next to the measured read bandwidth (`bench.limits`); the integer prompt GEMM reports
GOP/s (2 · rows · in · out) next to torch's float32 GEMM on the same machine. Operands are sized past
the last-level cache (`--quick`: small ones, for a check that every path runs). A level whose build
lacks the kernel runs what the callers then run (torch), and says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from hybridlm.batch import Batch
from hybridlm.bench.limits import best_seconds, matmul_tflops, memory_bandwidth_gbs
from hybridlm.ops import attention as attention_ops
from hybridlm.ops import gated_delta, linear, mamba2, quant
from hybridlm.ops.native import built_for, isa_levels
from hybridlm.ops.quant_gemm import integer_prefill, prompt_rows

LAYERS = 8


@dataclass
class Case:
    """One timed call: `run()` moves `nbytes` bytes (memory-bound) or does `ops` operations."""

    name: str
    run: Callable[[], object]
    kernel: Callable[[], bool]  # whether this level's build has the kernel the call is meant for
    nbytes: int = 0
    ops: int = 0


@dataclass
class Result:
    kernel: str
    level: str
    us: float
    rate: float  # GB/s, or GOP/s where `unit` says
    unit: str
    native: bool


def cases(quick: bool) -> list[Case]:
    """Decode-shaped calls of the published shapes' widths (Qwen3.5-0.8B's Gated DeltaNet and
    attention, Nemotron-H-8B's Mamba-2) with batches chosen so the bytes exceed the caches. A matvec
    case calls `LAYERS` weights of 64 MiB in turn, as decode calls a model's layers, so each call
    reads its weights from memory however large the last-level cache (512 MiB in all, the size
    `bench.limits` reads its bandwidth with)."""
    g = torch.Generator().manual_seed(0)
    scale, layers = (8, 1) if quick else (1, LAYERS)
    n, k = 4096 // scale, 8192 // scale  # 64 MiB of bf16 weights a layer
    ws = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for _ in range(layers)]
    x1, x8 = torch.randn(1, k, generator=g).bfloat16(), torch.randn(8, k, generator=g).bfloat16()
    weight_bytes = sum(w.nbytes for w in ws)
    out = [
        Case("bf16 matvec, 1 row", lambda: [linear.linear(x1, w) for w in ws],
             lambda: linear.KERNEL.get() is not None, nbytes=weight_bytes),
        Case("bf16 matvec, 8 rows", lambda: [linear.linear(x8, w) for w in ws],
             lambda: linear.KERNEL.get() is not None, nbytes=weight_bytes),
    ]
    for scheme, cols, fn in (("int8", k, quant.INT8_KERNEL), ("int4", 2 * k, quant.INT4_KERNEL)):
        qs = [quant.QuantLinear.from_linear(nn.Linear(cols, n, bias=False).bfloat16(), scheme)
              for _ in range(layers)]
        xq = torch.randn(1, cols, generator=g).bfloat16()
        moved = sum(q.qweight.nbytes + q.scales.nbytes for q in qs)
        out.append(Case(f"{scheme} matvec, 1 row", lambda qs=qs, xq=xq: [q(xq) for q in qs],
                        lambda fn=fn: fn.get() is not None, nbytes=moved))
    rows, side = (64, 512) if quick else (512, 4096)
    for scheme in ("int8", "int4"):
        layer = quant.QuantLinear.from_linear(nn.Linear(side, side, bias=False).bfloat16(), scheme)
        xp = torch.randn(rows, side, generator=g).bfloat16()

        def prompt(layer=layer, xp=xp):
            with prompt_rows():
                return layer(xp)

        out.append(Case(f"{scheme} prompt GEMM, {rows} rows", prompt, integer_prefill,
                        ops=2 * rows * side * side))
    # Gated DeltaNet step: 16 key / value heads of 128, float32 state read and written.
    seqs = 2 if quick else 16
    heads, dim = 16, 128
    qkv = torch.randn(seqs, 1, 3 * heads * dim, generator=g).bfloat16()
    ab = torch.randn(seqs, 1, 2 * heads, generator=g).bfloat16()
    a_log, dt_bias = torch.zeros(heads), torch.zeros(heads)
    state = torch.zeros(seqs, heads, dim, dim)
    out.append(Case(
        f"gated delta step, {seqs} seqs",
        lambda: gated_delta.gated_delta_net_scan(qkv, ab, a_log, dt_bias, state, k_heads=heads, k_dim=dim,
                                                 v_heads=heads, v_dim=dim, inplace=True),
        lambda: gated_delta.GDN_KERNEL.get() is not None, nbytes=2 * state.nbytes,
    ))
    # Mamba-2 step: 128 heads of 64, 8 groups, state 128 (Nemotron-H-8B).
    mheads, mdim, groups, n_state = 128, 64, 8, 128
    mseqs = 1 if quick else 8
    xbc = torch.randn(mseqs, 1, mheads * mdim + 2 * groups * n_state, generator=g).bfloat16()
    dt = torch.randn(mseqs, 1, mheads, generator=g).bfloat16()
    m_state = torch.zeros(mseqs, mheads, mdim, n_state)
    ones = torch.ones(mheads)
    out.append(Case(
        f"mamba-2 step, {mseqs} seqs",
        lambda: mamba2.mamba2_step_fused(xbc, dt, -ones, ones, m_state, dt_bias=ones, heads=mheads,
                                         head_dim=mdim, groups=groups, state_size=n_state, inplace=True),
        lambda: mamba2.STEP_KERNEL.get() is not None, nbytes=2 * m_state.nbytes,
    ))
    # Attention: one query over a long context, 8 query heads sharing 2 KV heads of 256 (bf16).
    aseqs, keys = (1, 512) if quick else (4, 8192)
    q = torch.randn(aseqs, 8, 1, 256, generator=g).bfloat16()
    kv = torch.randn(aseqs, 2, keys, 256, generator=g).bfloat16()
    batch = Batch(torch.zeros(aseqs, 1, dtype=torch.long), [1] * aseqs, [keys - 1] * aseqs)
    out.append(Case(
        f"attention, 1 query over {keys} keys, {aseqs} seqs",
        lambda: attention_ops.attention(q, kv, kv, batch, key_start=0, scale=256**-0.5),
        lambda: attention_ops.KERNEL.get() is not None, nbytes=2 * kv.nbytes,
    ))
    return out


def measure(levels: list[str], quick: bool, budget_s: float) -> list[Result]:
    results = []
    with torch.no_grad():
        for case in cases(quick):
            for level in levels:
                with built_for(level):
                    secs = best_seconds(case.run, torch.device("cpu"), budget_s)
                    native = case.kernel()
                amount, unit = (case.ops, "GOP/s") if case.ops else (case.nbytes, "GB/s")
                rate = amount / secs / 1e9
                results.append(Result(case.name, level, secs * 1e6, rate, unit, native))
                print(f"  {case.name} at {level}: {secs * 1e6:.0f} us", flush=True)
    return results


def main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = args.levels or isa_levels()
    unknown = sorted(set(levels) - set(isa_levels()))
    if unknown:
        raise SystemExit(f"hybridlm: error: this CPU does not run --levels {' '.join(unknown)} "
                         f"(it runs {' '.join(isa_levels())})")
    print("measuring the machine ...", flush=True)
    bandwidth = memory_bandwidth_gbs()
    gemm = matmul_tflops(torch.float32) * 1e3
    print(f"kernels at {', '.join(levels)} ({'small operands' if args.quick else 'past the caches'}) ...",
          flush=True)
    results = measure(levels, args.quick, 0.05 if args.quick else 0.5)
    print(f"\nmachine: {bandwidth:.1f} GB/s read, {gemm:.0f} GFLOP/s float32 GEMM, "
          f"{torch.get_num_threads()} threads")
    width = max(len(r.kernel) for r in results)
    print(f"{'kernel':<{width}}" + "".join(f"{level:>16}" for level in levels))
    for name in dict.fromkeys(r.kernel for r in results):
        row = [r for r in results if r.kernel == name]
        cells = "".join(f"{r.rate:>9.1f} {r.unit:<5}{'' if r.native else '*':<1}" for r in row)
        print(f"{name:<{width}}{cells}")
    print(f"(GB/s of the bytes a call must move, beside {bandwidth:.1f} GB/s read; GOP/s beside "
          f"{gemm:.0f} GFLOP/s float32 GEMM; * this level's build lacks the kernel: what callers then run)")
    if args.json:
        report = {"bandwidth_gbs": bandwidth, "float32_gemm_gflops": gemm, "threads": torch.get_num_threads(),
                  "results": [asdict(r) for r in results]}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
