"""`hybridlm bench quality`: how far quantized weights move the next-token distributions.

As llama.cpp's ``--kl-divergence``: the same token sequences go through the bf16 model and the
quantized one; per position it takes KL(P_bf16 ‖ P_quant) of the next-token distributions (nats)
and whether both pick the same top-1 token. Sequences are seeded random token ids (the preset
checkpoints have random weights and no tokenizer), fed as fresh prefills of `context` tokens.

Each scheme is measured twice: as prefill computes it (on a CPU with AVX-512 VNNI the activations
are quantized to int8, `ops.quant_gemm`) and as decode computes the same positions (``decode
rows``: every row through the few-row kernels with bf16 activations, `ops.linear.rowwise`). The
float32 model's line is the noise floor: how far bf16 itself is from float32 on the same tokens
(random weights give nearly flat next-token distributions, where top-1 flips on tiny changes).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridlm.batch import Batch
from hybridlm.bench.forward import load_bench_model
from hybridlm.models.base import CausalLM
from hybridlm.ops.linear import rowwise
from hybridlm.ops.quant import QUANTIZATIONS


def sequences(vocab_size: int, tokens: int, context: int, seed: int = 0) -> list[list[int]]:
    """ceil(tokens / context) seeded random id sequences of `context` ids (the last one shorter)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (tokens,), generator=g).tolist()
    return [ids[i : i + context] for i in range(0, tokens, context)]


class DecodeRows:
    """`model` called with every linear layer computing each row as a decode step would (`rowwise`)."""

    def __init__(self, model: CausalLM):
        self.model, self.device = model, model.device

    def make_caches(self, batch: int):
        return self.model.make_caches(batch)

    def __call__(self, *args, **kwargs):
        with rowwise():
            return self.model(*args, **kwargs)


@torch.no_grad()
def compare(reference: CausalLM, candidates: dict[str, CausalLM], seqs: list[list[int]]) -> dict[str, dict]:
    """Per candidate: KL(P_reference ‖ P_candidate) per position, in nats (mean, 99th percentile,
    max), and the share of positions whose top-1 tokens agree, over every position of `seqs` (the
    reference runs once per sequence)."""
    kls = {name: [] for name in candidates}
    agree = dict.fromkeys(candidates, 0)
    for ids in seqs:
        ref = reference(Batch.single(ids, device=reference.device), reference.make_caches(1), logits="all")[0]
        p = torch.log_softmax(ref.float(), dim=-1)
        for name, model in candidates.items():
            got = model(Batch.single(ids, device=model.device), model.make_caches(1), logits="all")[0].float()
            q = torch.log_softmax(got, dim=-1)
            kls[name].append((p.exp() * (p - q)).sum(-1).clamp_min(0).cpu())
            agree[name] += int((ref.argmax(-1) == got.argmax(-1)).sum())
            del got, q
    out = {}
    for name in candidates:
        kl = torch.cat(kls[name]).double()
        out[name] = {
            "tokens": kl.numel(),
            "kl_mean": kl.mean().item(),
            "kl_p99": kl.quantile(0.99).item(),
            "kl_max": kl.max().item(),
            "top1_agreement": agree[name] / kl.numel(),
        }
    return out


def main(args) -> int:
    from hybridlm.models import load_model

    schemes = [args.quantize] if args.quantize else list(QUANTIZATIONS)
    args.quantize = None
    reference, path, dtype = load_bench_model(args)
    seqs = sequences(reference.vocab_size, args.tokens, args.context, args.seed)
    report = {"model": str(path), "threads": torch.get_num_threads(), "tokens": args.tokens,
              "context": args.context, "seed": args.seed, "schemes": {}}
    print(f"quantizing ({', '.join(schemes)}) ...", flush=True)
    candidates: dict = {"float32 (noise floor)": load_model(path, dtype=torch.float32, device=args.device)}
    for s in schemes:
        model = load_model(path, dtype=dtype, device=args.device, quantize=s)
        candidates[f"{s} prefill"], candidates[f"{s} decode rows"] = model, DecodeRows(model)
    print(f"comparing over {args.tokens} tokens ...", flush=True)
    report["schemes"] = compare(reference, candidates, seqs)
    reference_dtype = str(dtype).removeprefix("torch.")
    print(f"\n{path}: {args.tokens} tokens in sequences of {args.context}, against {reference_dtype}")
    print(f"{'weights':<23}{'KL mean':>11}{'KL p99':>11}{'KL max':>11}{'top-1 agree':>13}")
    for scheme, r in report["schemes"].items():
        print(f"{scheme:<23}{r['kl_mean']:>11.5f}{r['kl_p99']:>11.5f}{r['kl_max']:>11.5f}"
              f"{r['top1_agreement']:>13.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
