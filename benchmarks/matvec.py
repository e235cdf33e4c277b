"""Weight bandwidth (GB/s) of few-row linear layers, per method, per shape.

    PYTHONPATH=src python benchmarks/matvec.py [--dtype bf16|fp32] [--rows 1,2,4,9] [--methods ...]

GB/s = bytes of weight (in the method's storage format) / seconds per call, and in brackets its share
of the machine's read bandwidth (`bench.limits`). Each method cycles through enough copies of the
weight (``--pool-mb``) that they fall out of the last-level cache, as the weights of a decode step
do, placed as the model loader places weights (huge pages); methods take turns, and each one's
20th-percentile call counts, which tolerates a noisy machine.

Methods: ``linear`` (hybridlm.ops.linear), ``F.linear``, ``mv`` (torch.mv, 1 row),
``mkldnn`` (oneDNN with a weight prepacked for the row count), ``compile`` (torch.compile of
an fp32 multiply + sum, dynamic shapes), ``int8pack`` (torch._weight_int8pack_mm on int8
weights with per-row scales, so half the bytes of bf16), ``int8`` / ``int4`` (hybridlm's
``QuantLinear`` kernels; bytes = quantized weight + scales).

    PYTHONPATH=src python benchmarks/matvec.py --methods linear,int8,int4 --rows 1,2,4,8,17 \
        --shapes 248320x1024,3584x1024,1024x3584

``--preset`` instead streams a whole model's linear layers (``--quantize int8|int4``, or bf16),
every layer once per pass in the model's order as a decode step calls them, so no weight is still
cached when its turn comes again (the int4 Qwen3.5-0.8B preset reads 400 MB a pass, the last-level
cache here is 260 MB): GB/s = the pass's weight bytes / its seconds (best of ``--passes``), beside
the read bandwidth measured in the same run, per row count and per layer shape.

    PYTHONPATH=src python benchmarks/matvec.py --preset qwen3.5-0.8b --quantize int4 --rows 1,2,4,8,17
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from hybridlm.bench.limits import memory_bandwidth_gbs
from hybridlm.models.checkpoint import placed
from hybridlm.ops.linear import Linear, fast_path_available, linear
from hybridlm.ops.quant import QuantLinear

# Qwen3.5-0.8B decode shapes as (out, in): LM head, GDN qkv, MLP up/gate, MLP down, z, GDN out /
# attention o, attention q (with gate), k/v, GDN a/b.
SHAPES = "248320x1024,6144x1024,3584x1024,1024x3584,2048x1024,1024x2048,4096x1024,512x1024,16x1024"


def _mul_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x[:, None, :].float() * w.float()).sum(-1).to(x.dtype)


def _methods(names: list[str], x: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, tuple]:
    """name -> (fn(w), the weights in the format fn expects, bytes per weight); skips methods that
    do not apply to this input."""
    rows, (n, k), dtype = x.shape[0], weights[0].shape, x.dtype
    nbytes = n * k * dtype.itemsize
    out: dict[str, tuple] = {}
    for name in names:
        if name == "linear":
            out[name] = (lambda w: linear(x, w), weights, nbytes)
        elif name == "F.linear":
            out[name] = (lambda w: F.linear(x, w), weights, nbytes)
        elif name == "mv" and rows == 1:
            out[name] = (lambda w: torch.mv(w, x[0]), weights, nbytes)
        elif name == "mkldnn":
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
            op = torch.ops.mkldnn._linear_pointwise
            out[name] = (lambda w, op=op: op(x, w, None, "none", [], ""), packed, nbytes)
        elif name == "compile":
            fn = torch.compile(_mul_sum, dynamic=True)
            t0 = time.perf_counter()
            fn(x, weights[0])
            print(f"    (compile: first call {time.perf_counter() - t0:.1f} s)")
            out[name] = (lambda w, fn=fn: fn(x, w), weights, nbytes)
        elif name == "int8pack" and k % 32 == 0:  # wrong results for bf16 when in % 16 != 0
            q = [w.to(torch.int8) for w in weights]  # values are irrelevant for timing
            scale = torch.ones(n, dtype=dtype)
            out[name] = (lambda w, scale=scale: torch._weight_int8pack_mm(x, w, scale), q, n * k)
        elif name in ("int8", "int4") and dtype is torch.bfloat16 and k % 64 == 0:
            layer = torch.nn.Linear(k, n, bias=False, dtype=dtype)
            with torch.no_grad():
                layer.weight.copy_(weights[0])
            q = QuantLinear.from_linear(layer, name)
            size = q.qweight.numel() * q.qweight.element_size() + q.scales.numel() * q.scales.element_size()
            pool = max(1, len(weights) * nbytes // size)  # as many bytes as the bf16 copies
            out[name] = (lambda layer: layer(x), [_placed(copy.deepcopy(q)) for _ in range(pool)], size)
    return out


def _placed(q: QuantLinear) -> QuantLinear:
    for name in ("qweight", "scales"):
        t = getattr(q, name)
        setattr(q, name, placed(t, t.device, t.dtype))
    return q


def _compare(methods: dict[str, tuple], seconds: float) -> dict[str, float]:
    """GB/s of each method's 20th-percentile call over ``seconds``: methods take turns and every
    call is timed alone. The percentile drops both the calls slowed by other processes and the
    rare ones that found their weight still in the last-level cache."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn, ws, _ in methods.values():
        fn(ws[0])
    end, rounds = time.perf_counter() + seconds, 0
    while rounds < 3 or time.perf_counter() < end:
        for name, (fn, ws, _) in methods.items():
            for w in ws:
                t0 = time.perf_counter()
                fn(w)
                times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: methods[name][2] / sorted(t)[len(t) // 5] / 1e9 for name, t in times.items()}


def layer_bytes(layer: torch.nn.Module) -> int:
    """Bytes a call reads: the weight as stored (quantized: values and scales) and the bias."""
    return sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))


def model_passes(preset: str, quantize: str | None, rows_list: list[int], passes: int,
                 bandwidth: float) -> None:
    """Every linear layer of the `preset` model (`quantize`d) called once per pass, in model order;
    prints GB/s per row count and, per layer shape, the share of the pass's time and bytes."""
    from hybridlm.bench.forward import preset_dir
    from hybridlm.models import load_model

    model = load_model(preset_dir(preset), dtype=torch.bfloat16, quantize=quantize)
    layers = [m for m in model.modules() if isinstance(m, (Linear, QuantLinear))]
    total = sum(map(layer_bytes, layers))
    print(f"{preset} {quantize or 'bf16'}: {len(layers)} linear layers, {total / 1e6:.1f} MB a pass")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in {m.in_features for m in layers}}
        best, per_layer = float("inf"), []
        for _ in range(passes + 1):  # the first pass warms up (kernel builds, page faults)
            times = []
            for layer in layers:
                t0 = time.perf_counter()
                layer(xs[layer.in_features])
                times.append(time.perf_counter() - t0)
            if sum(times) < best:
                best, per_layer = sum(times), times
        gbs = total / best / 1e9
        print(f"rows {rows:>2}: {best * 1e3:7.2f} ms a pass, {gbs:5.1f} GB/s ({gbs / bandwidth:4.0%} of "
              f"{bandwidth:.1f})", flush=True)
        if rows == rows_list[0]:
            shapes: dict[tuple[int, int], list[float]] = {}
            for layer, t in zip(layers, per_layer, strict=True):
                entry = shapes.setdefault((layer.out_features, layer.in_features), [0.0, 0, 0])
                entry[0] += t
                entry[1] += layer_bytes(layer)
                entry[2] += 1
            for (n, k), (t, nbytes, count) in sorted(shapes.items(), key=lambda kv: -kv[1][0]):
                print(f"    {n:>6}x{k:<5} x{count:<3} {t * 1e3:6.2f} ms {nbytes / t / 1e9:5.1f} GB/s "
                      f"({nbytes / 1e6:6.1f} MB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--shapes", default=SHAPES, help="comma-separated OUTxIN")
    p.add_argument("--rows", default="1,2,4,8,17", help="comma-separated input row counts")
    p.add_argument("--methods", default="linear,F.linear,mv,mkldnn,int8pack")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pool-mb", type=int, default=1024, help="weight copies cycled per method (MiB)")
    p.add_argument("--seconds", type=float, default=2.0, help="per shape and row count")
    p.add_argument("--preset", help="stream this model's linear layers instead of --shapes")
    p.add_argument("--quantize", choices=["int8", "int4"], help="with --preset: quantize them")
    p.add_argument("--passes", type=int, default=5, help="with --preset: passes per row count (best counts)")
    args = p.parse_args()

    torch.set_flush_denormal(True)
    torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    names = args.methods.split(",")
    bandwidth = memory_bandwidth_gbs()
    print(f"{args.dtype}, {args.threads} threads, fast path available: {fast_path_available()}, "
          f"read bandwidth {bandwidth:.1f} GB/s")
    if args.preset:
        rows = [int(r) for r in args.rows.split(",")]
        model_passes(args.preset, args.quantize, rows, args.passes, bandwidth)
        return
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        copies = max(1, (args.pool_mb << 20) // (n * k * dtype.itemsize))
        base = torch.randn(n, k).to(dtype)
        weights = [placed(base, base.device, dtype) for _ in range(copies)]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k).to(dtype)
            gbs = _compare(_methods(names, x, weights), args.seconds)
            cells = "  ".join(f"{name} {v:5.1f} ({v / bandwidth:4.0%})" for name, v in gbs.items())
            print(f"{n:>6}x{k:<5} rows {rows:>2}:  {cells}", flush=True)


if __name__ == "__main__":
    main()
