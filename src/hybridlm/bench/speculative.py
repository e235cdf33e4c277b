"""`hybridlm bench speculative`: decode tokens/s with speculative decoding vs plain decoding, in
one run, through the engine (greedy, the same prompt, prefill excluded).

The prompt is Q = P + G + P: a random head P, its greedy continuation G, P again — a prompt that
already contains the model's own greedy continuation of P. A trained model copies it (induction),
so prompt lookup drafts G and every draft is right; a random-weight model's continuation of Q
depends on the whole context and does not repeat G (the report says for how many tokens it does).
Scenarios, each against the plain baseline measured in the same run (modes interleaved per repeat,
medians reported, load average noted because the machine may be shared):
- ngram: prompt lookup over the request's own tokens, as served; acceptance as it comes.
- copy: drafts are C, the plain greedy continuation of Q — what prompt lookup drafts when the
  model copies its context (a trained model on this prompt): every draft right, the best case.
- random: a drafter proposing random tokens, never accepted: the controller must back off to
  plain decoding (the cost that remains is its probing).
- draft: a draft model (`--draft-model`, optionally int8; a Gemma 4 assistant for a Gemma 4 model),
  when given: acceptance as it comes.
- mtp: the checkpoint's own multi-token-prediction head (`--mtp`), when asked: acceptance as it
  comes (a random head's drafts are almost never right: what remains is its drafting cost).

Reported per scenario: decode tok/s and speedup over plain, acceptance rate per draft position,
mean tokens committed per verify pass, the verify pass cost by draft length (ms), and whether the
output equals plain greedy decoding token for token (on the CPU a verify pass computes every
position bit for bit as a decode step does, so it does in bf16 too).
"""

from __future__ import annotations

import json
import os
import random
import statistics
from pathlib import Path

import torch

from hybridlm.engine import Engine, SamplingParams, serial_setup
from hybridlm.speculative import MTP, Draft, Drafter, NgramDrafter, Speculator, TargetPolicy, load_draft


class RandomDrafter(Drafter):
    """Proposes uniformly random tokens (seeded): drafts that are (almost) never accepted."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        return Draft([self.rng.randrange(self.vocab) for _ in range(k)])

    def close(self) -> None:
        pass


class CopyDrafter(Drafter):
    """Drafts the known greedy continuation of `prompt` while the run follows it (nothing after)."""

    def __init__(self, prompt: list[int], continuation: list[int]):
        self.run = prompt + continuation

    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        n = len(tokens)
        return Draft(self.run[n : n + k] if tokens == self.run[:n] else [])

    def close(self) -> None:
        pass


def decode(
    model, speculator: Speculator | None, prompt: list[int], tokens: int
) -> tuple[list[int], float]:
    """Greedy `tokens` tokens on an engine of its own: (ids, decode tok/s after the first token).

    Each run's engine thread ends with the run: an OpenMP thread pool lives as long as the thread
    that made it, and with more pools than cores libgomp stops spinning between parallel regions
    (every engine's decode ~20% slower)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with Engine(model, None, context_length=1 << 20, speculative=speculator) as engine:
        result = engine.generate(prompt, params)
    if result.error:
        raise RuntimeError(result.error)
    return result.token_ids, (len(result.token_ids) - 1) / (result.timings.decode_ms / 1e3)


def summarize(speeds: list[float], plain: float, counts, controller, identical: bool) -> dict:
    passes = max(counts.verify_passes, 1)
    return {
        "tok_s": speeds,
        "median_tok_s": statistics.median(speeds),
        "speedup": statistics.median(speeds) / plain,
        "identical_to_plain": identical,
        "drafted_tokens": counts.drafted_tokens,
        "accepted_tokens": counts.accepted_tokens,
        "verify_passes": counts.verify_passes,
        "acceptance_by_position": [round(a, 3) for a in counts.acceptance_by_position()],
        "mean_committed_per_verify": (counts.accepted_tokens + counts.verify_passes) / passes,
        "step_ms_by_rows": {n: s * 1e3 for n, s in controller.measured_step_seconds().items()},
    }


def main(args) -> int:
    from hybridlm.bench.forward import load_bench_model

    torch.set_flush_denormal(True)
    model, path, dtype = load_bench_model(args)
    vocab = model.vocab_size
    load_before = os.getloadavg()
    print("building the prompt ...", flush=True)
    rng = random.Random(0)
    head = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
    decode(model, None, head, 4)  # warm-up (kernels, allocator)
    guess, _ = decode(model, None, head, args.tokens)
    prompt = head + guess + head
    truth, _ = decode(model, None, prompt, args.tokens)
    copied = next((i for i, (a, b) in enumerate(zip(truth, guess, strict=True)) if a != b), args.tokens)
    print(f"prompt {len(prompt)} tokens; the continuation repeats G for {copied} tokens", flush=True)
    factories = {
        "ngram": NgramDrafter,
        "copy": lambda: CopyDrafter(prompt, truth),
        "random": lambda: RandomDrafter(vocab, seed=1),
    }
    with serial_setup():  # no engine is running now
        if args.draft_model:
            print(f"loading draft model {args.draft_model} ...", flush=True)
            quantize = args.draft_quantize
            factories["draft"] = load_draft(args.draft_model, model, dtype=dtype, quantize=quantize)
        if args.mtp:
            factories["mtp"] = MTP.load(path, model)
    speculators = {name: Speculator(factory, max_depth=args.num_draft) for name, factory in factories.items()}
    for speculator in speculators.values():
        # Warm-up: first-use costs of verify shapes (and of the draft model) stay out of the timings.
        decode(model, speculator, prompt, 8)
    speeds: dict[str, list[float]] = {name: [] for name in ["plain", *speculators]}
    outputs: dict[str, list[int]] = {"plain": truth}
    for r in range(args.repeats):
        for name, speculator in [("plain", None), *speculators.items()]:
            ids, tok_s = decode(model, speculator, prompt, args.tokens)
            speeds[name].append(tok_s)
            outputs.setdefault(name, ids)
            print(f"repeat {r + 1}/{args.repeats} {name:<10} {tok_s:8.2f} tok/s", flush=True)
    plain = statistics.median(speeds["plain"])
    report = {
        "model": str(path),
        "draft_model": args.draft_model,
        "quantize": args.quantize,
        "draft_quantize": args.draft_quantize,
        "mtp": args.mtp,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "prompt_tokens": len(prompt),
        "decode_tokens": args.tokens,
        "num_draft": args.num_draft,
        "continuation_repeats_prompt_tokens": copied,
        "plain": {"tok_s": speeds["plain"], "median_tok_s": plain},
        "scenarios": {
            name: summarize(
                speeds[name],
                plain,
                speculator.totals,
                speculator.controller,
                outputs[name] == outputs["plain"],
            )
            for name, speculator in speculators.items()
        },
    }
    print(
        f"\n{report['device']}, {report['threads']} threads, load average {load_before[0]:.2f} before / "
        f"{report['load_average_after'][0]:.2f} after; {len(prompt)}-token prompt (its continuation "
        f"repeats the copy for {copied} tokens), {args.tokens} tokens decoded, up to {args.num_draft} "
        "drafts per verify"
    )
    print(f"{'mode':<11}{'tok/s':>9}{'speedup':>9}{'commit/verify':>15}{'same':>6}  acceptance by position")
    print(f"{'plain':<11}{plain:>9.2f}{1.0:>9.2f}")
    for name, s in report["scenarios"].items():
        by_pos = " ".join(f"{a:.2f}" for a in s["acceptance_by_position"])
        print(
            f"{name:<11}{s['median_tok_s']:>9.2f}{s['speedup']:>9.2f}{s['mean_committed_per_verify']:>15.2f}"
            f"{'yes' if s['identical_to_plain'] else 'NO':>6}  {by_pos}"
        )
    for name, s in report["scenarios"].items():
        costs = ", ".join(f"{n}: {ms:.1f}" for n, ms in s["step_ms_by_rows"].items())
        print(f"{name} step ms by rows (1 + draft length): {costs}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
