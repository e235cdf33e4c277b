"""Milliseconds per call of the recurrent kernels, ours vs transformers' torch fallbacks.

Shapes are Qwen3.5-0.8B's Gated DeltaNet layer: 16 heads, Dk = Dv = 128, conv over 6144 channels
with K = 4; bf16 activations, float32 state, batch 1, realistic gates. Prints the minimum and the
median over repeats (the minimum is the machine's figure; the median shows noise from other load).

    python benchmarks/kernels.py [--threads N] [--repeats R]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import torch
import torch.nn.functional as F


def timed(fn, repeats: int, min_seconds: float = 0.05) -> tuple[float, float]:
    """(min, median) milliseconds per call; each repeat loops until it has run min_seconds."""
    fn()
    t0 = time.perf_counter()
    fn()
    per_call = time.perf_counter() - t0
    loops = max(1, math.ceil(min_seconds / max(per_call, 1e-7)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - t0) / loops * 1e3)
    return min(samples), statistics.median(samples)


def gdn_inputs(L: int, H: int = 16, D: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, L, H, D, generator=gen), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, L, H, D, generator=gen), dim=-1).bfloat16()
    v = torch.randn(1, L, H, D, generator=gen).bfloat16()
    A = torch.empty(H).uniform_(0.01, 16, generator=gen)
    g = -A * F.softplus(torch.randn(1, L, H, generator=gen) + torch.rand(H, generator=gen))
    beta = torch.sigmoid(torch.randn(1, L, H, generator=gen))
    state = 0.1 * torch.randn(1, H, D, D, generator=gen)
    return q, k, v, g, beta, state


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per case")
    args_ = parser.parse_args()
    # Must precede the first parallel op so that every worker thread inherits it.
    torch.set_flush_denormal(True)
    torch.set_num_threads(args_.threads)
    warnings.filterwarnings("ignore")

    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        causal_conv1d_fn,
        causal_conv1d_update,
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )
    from transformers.utils import logging

    from hybridlm.ops.conv import causal_conv1d
    from hybridlm.ops.gated_delta import gated_delta_rule

    logging.set_verbosity_error()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call: min (median)")

    def report(name: str, fn, *args, **kwargs) -> None:
        lo, med = timed(lambda: fn(*args, **kwargs), args_.repeats)
        print(f"  {name:44s} {lo:9.3f} ({med:.3f})")

    inputs = gdn_inputs(1)
    state = inputs[-1]
    print("gated delta, decode: 1 token, 16 heads x 128 x 128")
    report("ours (new state)", gated_delta_rule, *inputs)
    report("ours (inplace=True)", gated_delta_rule, *inputs[:-1], state.clone(), inplace=True)
    report("transformers torch_recurrent_gated_delta_rule", torch_recurrent_gated_delta_rule,
           *inputs[:-1], initial_state=state, output_final_state=True)

    for L in (512, 2048):
        inputs = gdn_inputs(L)
        print(f"gated delta, prefill: {L} tokens")
        report("ours (chunked)", gated_delta_rule, *inputs)
        report("transformers torch_chunk_gated_delta_rule", torch_chunk_gated_delta_rule,
               *inputs[:-1], initial_state=inputs[-1], output_final_state=True)

    C, K = 6144, 4
    w = (0.3 * torch.randn(C, K)).bfloat16()
    for L in (1, 2048):
        x = torch.randn(1, L, C).bfloat16()
        prior = torch.randn(1, K - 1, C).bfloat16()
        print(f"causal conv1d: {L} token(s) x {C} channels, K = {K}, silu")
        report("ours", causal_conv1d, x, w, None, prior, activation="silu")
        if L == 1:
            report("transformers causal_conv1d_update", causal_conv1d_update,
                   x.transpose(1, 2), prior.transpose(1, 2).clone(), w, None, "silu")
        else:
            report("transformers causal_conv1d_fn", causal_conv1d_fn, x.transpose(1, 2), w, None, "silu")


if __name__ == "__main__":
    main()
