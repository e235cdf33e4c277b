"""`hybridlm bench forward`: prefill and decode tokens/s beside the machine's limits.

Limits: decode ≤ bandwidth ÷ weight bytes read per token; prefill ≤ matmul rate ÷ FLOPs per token
(2 × parameters touched per token; the LM head runs once per prefill, so it is left out), the int8
matmul's rate where quantized layers prefill in integers (`ops.quant_gemm`), else the model dtype's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from hybridlm.batch import Batch
from hybridlm.engine import serial_setup
from hybridlm.ops.sampling import greedy

log = logging.getLogger(__name__)


def preset_dir(preset: str) -> Path:
    """A random checkpoint of a published shape, written once under the user cache directory."""
    from hybridlm.models.random import cached_random_checkpoint
    from hybridlm.presets import PRESETS

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridlm"
    return cached_random_checkpoint(PRESETS[preset], base / "presets" / preset, preset)


def routed_shares(model) -> dict[int, float]:
    """id(tensor) -> the share of it a token uses, for the routed experts' weights (k of E: a step
    reads only its tokens' chosen experts, `moe.dispatch`); tensors absent use all of themselves."""
    from hybridlm.models.moe import Experts, QuantExperts

    c = getattr(model, "config", None) or {}
    k = next((c.get(key) for key in ("num_experts_per_tok", "num_experts_per_token", "top_k_experts")
              if c.get(key)), None)
    shares = {}
    for m in model.modules():
        if isinstance(m, (Experts, QuantExperts)) and k:
            for t in (*m.parameters(), *m.buffers()):
                shares[id(t)] = k / m.num_experts
    return shares


def weight_bytes_per_token(model, active: bool = True) -> int:
    """Bytes of weights a decode step reads: every parameter and quantized layer's buffers except
    the embedding table (one row read), which a tied bf16 LM head reads whole (counted once); the
    routed experts at k of E (`active`; all of them with `active=False`, the weights' whole size)."""
    emb = model.model.embed_tokens.weight
    head_reads_table = getattr(model.lm_head, "weight", None) is emb
    shares = routed_shares(model) if active else {}
    seen, total = {id(emb)}, emb.numel() * emb.element_size() if head_reads_table else 0
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size() * shares.get(id(t), 1.0)
    return round(total)


def prefill_flops_per_token(model) -> int:
    """2 × weights used per prefill token (embedding lookup and LM head excluded; routed experts at
    k of E)."""
    from hybridlm.ops.quant import QuantLinear

    shares = routed_shares(model)
    weights = 0.0
    for name, module in model.named_modules():
        if name.startswith(("lm_head", "model.embed_tokens")):
            continue
        weights += sum(p.numel() * shares.get(id(p), 1.0) for p in module.parameters(recurse=False))
        if isinstance(module, QuantLinear):
            weights += module.in_features * module.out_features * shares.get(id(module.qweight), 1.0)
    return round(2 * weights)


def integer_prefill(model) -> bool:
    """Whether `model`'s quantized linear layers prefill with int8 activations (`ops.quant_gemm`)."""
    from hybridlm.ops.quant import QuantLinear
    from hybridlm.ops.quant_gemm import prefill_applies

    layer = next((m for m in model.modules() if isinstance(m, QuantLinear)), None)
    if layer is None:
        return False
    x = torch.empty(0, dtype=model.model.embed_tokens.weight.dtype, device=model.device)
    return prefill_applies(x, layer.qweight)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_prefill(model, length: int, repeats: int = 2) -> float:
    """Best seconds for one fresh prefill of `length` tokens."""
    ids = torch.randint(0, model.vocab_size, (length,)).tolist()
    best = float("inf")
    for _ in range(repeats + 1):
        caches = model.make_caches(1)
        _sync(model.device)
        t0 = time.perf_counter()
        model(Batch.single(ids, device=model.device), caches)
        _sync(model.device)
        best = min(best, time.perf_counter() - t0)
    return best


def _part(module) -> str | None:
    """The breakdown bucket of a module class, or None (its time goes to its caller)."""
    from hybridlm.ops.quant import QuantLinear

    if isinstance(module, (torch.nn.Linear, QuantLinear)):
        return "linear (GEMM)"
    name = type(module).__name__
    for key, part in (("DeltaNet", "Gated DeltaNet mixer"), ("Attention", "attention mixer"),
                      ("Conv", "short-conv mixer"), ("Norm", "norms"), ("Embedding", "embedding")):
        if key in name:
            return part
    return None


@torch.no_grad()
def prefill_breakdown(model, length: int) -> dict[str, float]:
    """Seconds of one fresh `length`-token prefill by part: linear layers (the GEMMs), each mixer
    (GDN chunk scan, attention, short conv) without its own linear layers, norms, and "other" (the
    rest: elementwise, MLP gating, the LM head's last row...). Forward hooks time each bucketed
    module exclusive of the bucketed modules it calls; CPU timings (CUDA would need syncs)."""
    ids = torch.randint(0, model.vocab_size, (length,)).tolist()
    totals: dict[str, float] = {}
    stack: list[list[float]] = []  # [start, seconds spent in bucketed children]

    def pre(module, args):
        stack.append([time.perf_counter(), 0.0])

    def post(module, args, out):
        start, inner = stack.pop()
        spent = time.perf_counter() - start
        totals[_part(module)] = totals.get(_part(module), 0.0) + spent - inner
        if stack:
            stack[-1][1] += spent

    hooks = []
    for module in model.modules():
        if _part(module):
            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        model(Batch.single(ids, device=model.device), model.make_caches(1))  # warm-up
        totals.clear()
        t0 = time.perf_counter()
        model(Batch.single(ids, device=model.device), model.make_caches(1))
        total = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    totals["other"] = total - sum(totals.values())
    return totals


def time_decode(model, steps: int, context: int = 128) -> float:
    """Median seconds per decode step after a `context`-token prefill."""
    caches = model.make_caches(1)
    ids = torch.randint(0, model.vocab_size, (context,)).tolist()
    logits = model(Batch.single(ids, device=model.device), caches)
    times = []
    for i in range(steps + 3):
        token = int(greedy(logits)[0])
        _sync(model.device)
        t0 = time.perf_counter()
        logits = model(Batch.single([token], offset=context + i, device=model.device), caches)
        _sync(model.device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def prefilled_sequences(model, contexts: list[int]) -> tuple[list, list[torch.Tensor]]:
    """One sequence per entry of `contexts`, each with its own fresh caches prefilled with that many
    random tokens: (the caches, each sequence's last logits [1, V])."""
    caches, logits = [], []
    for context in contexts:
        caches.append(model.make_caches(1))
        ids = torch.randint(0, model.vocab_size, (context,)).tolist()
        logits.append(model(Batch.single(ids, device=model.device), caches[-1]))
    return caches, logits


def time_packed_decode(model, rows: int, steps: int, context: int = 128) -> float:
    """Median seconds of one continuous-batching decode step of `rows` sequences (one token each,
    packed into one forward as the engine's step does), each after its own `context`-token prefill."""
    from hybridlm.models.base import forward_packed

    caches, logits = prefilled_sequences(model, [context] * rows)
    tokens = [int(greedy(x)[0]) for x in logits]
    times = []
    for i in range(steps + 3):
        segments = [Batch.single([t], offset=context + i, device=model.device) for t in tokens]
        _sync(model.device)
        t0 = time.perf_counter()
        logits = forward_packed(model, segments, caches, ["last"] * rows)
        _sync(model.device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
        tokens = [int(greedy(x)[0]) for x in logits]
    return sorted(times)[len(times) // 2]


def bench_dtype(args) -> torch.dtype:
    """A benchmark's --dtype (bf16 unless it says float32)."""
    return {"float32": torch.float32, "fp32": torch.float32}.get(args.dtype or "", torch.bfloat16)


def load_bench_model(args):
    """(model, path, dtype) for a benchmark's --preset / --model / --dtype / --device / --threads
    (the demo model when neither names one)."""
    from hybridlm.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    path = preset_dir(args.preset) if args.preset else args.model
    if path is None:
        from hybridlm.demo import demo_model_dir

        path = demo_model_dir()
    dtype = bench_dtype(args)
    print(f"loading {path} ...", flush=True)
    with serial_setup():
        return load_model(path, dtype=dtype, device=args.device, quantize=args.quantize), path, dtype


def main(args) -> int:
    from hybridlm.bench.limits import matmul_tflops, memory_bandwidth_gbs

    model, path, dtype = load_bench_model(args)
    device = model.device
    print("measuring the machine ...", flush=True)
    bandwidth = memory_bandwidth_gbs(device)
    integer = integer_prefill(model)
    rate = matmul_tflops(torch.int8 if integer else dtype, device)
    wbytes = weight_bytes_per_token(model)
    all_bytes = weight_bytes_per_token(model, active=False)
    flops = prefill_flops_per_token(model)
    report = {
        "model": str(path),
        "dtype": str(dtype).removeprefix("torch."),
        "quantize": (getattr(model, "quantization", None) or {}).get("scheme"),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "bandwidth_gbs": bandwidth,
        "matmul_tflops": rate,
        "matmul_dtype": "int8" if integer else str(dtype).removeprefix("torch."),
        "weight_bytes_per_token": wbytes,
        "weight_bytes": all_bytes,
        "prefill_flops_per_token": flops,
        "prefill": {},
        "decode": {},
    }
    for length in args.prefill:
        print(f"prefill {length} ...", flush=True)
        secs = time_prefill(model, length)
        report["prefill"][str(length)] = {"tok_s": length / secs, "limit_tok_s": rate * 1e12 / flops}
    if args.breakdown:
        print(f"prefill {args.breakdown} by part ...", flush=True)
        report["prefill_breakdown"] = prefill_breakdown(model, args.breakdown)
    print(f"decode {args.decode} steps ...", flush=True)
    step = time_decode(model, args.decode)
    report["decode"] = {
        "tok_s": 1 / step,
        "ms_per_token": step * 1e3,
        "limit_tok_s": bandwidth * 1e9 / wbytes,
    }
    if args.rows and not model.packs:
        print(f"--rows: {type(model).__name__} does not pack sequences into one step; skipped", flush=True)
    elif args.rows:
        report["decode"]["rows"] = {}
        for rows in args.rows:
            print(f"decode step of {rows} packed rows ...", flush=True)
            secs = time_packed_decode(model, rows, args.decode)
            report["decode"]["rows"][str(rows)] = {"ms_per_step": secs * 1e3, "per_one_row": secs / step}

    print(
        f"\nmachine: {bandwidth:.1f} GB/s read, {rate:.3f} {'TOP' if integer else 'TFLOP'}/s "
        f"{report['matmul_dtype']} matmul, "
        f"{report['threads']} threads, {device}"
    )
    gb, gflop = wbytes / 1e9, flops / 1e9
    weights = f"{report['quantize']} weights" if report["quantize"] else "weights"
    print(f"model: {gb:.3f} GB {weights} read per decode token, {gflop:.2f} GFLOP per prefill token")
    if all_bytes != wbytes:
        print(f"  (routed experts: the k of E a token chose; every expert counted: {all_bytes / 1e9:.3f} GB)")
    print(f"{'phase':<14}{'tok/s':>10}{'limit':>10}{'of limit':>10}")
    for length, r in report["prefill"].items():
        share = r["tok_s"] / r["limit_tok_s"]
        print(f"{'prefill ' + length:<14}{r['tok_s']:>10.1f}{r['limit_tok_s']:>10.1f}{share:>10.0%}")
    d = report["decode"]
    print(f"{'decode':<14}{d['tok_s']:>10.1f}{d['limit_tok_s']:>10.1f}{d['tok_s'] / d['limit_tok_s']:>10.0%}")
    for rows, r in report["decode"].get("rows", {}).items():
        print(f"decode step of {rows} rows: {r['ms_per_step']:.1f} ms, {r['per_one_row']:.2f}x one row's")
    if args.breakdown:
        parts = report["prefill_breakdown"]
        total = sum(parts.values())
        print(f"\nprefill {args.breakdown} by part ({total * 1e3:.0f} ms):")
        for part, secs in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {part:<22}{secs * 1e3:>9.1f} ms{secs / total:>7.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
