"""`hybridlm bench multiturn`: seeded chat / agent traces through the engine with the prefix cache.

Reports prefilled tokens against the oracle minimum (a brute-force oracle that knows every token
sequence the engine stored: each request's prompt plus its output except the last token, which
never enters the caches), time to first token of cached and uncached turns, and bytes held — once
with a budget above the working set and once with a quarter of it.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridlm.prefix.cache import PrefixCache, common_prefix


@dataclass
class Turn:
    conversation: int
    prompt: list[int]
    kind: str


def make_trace(
    seed: int, vocab: int, conversations: int, turns: int, system_len: int, gen: int
) -> list[Turn]:
    """Interleaved conversations sharing a system prompt: growing histories, agent tool results,
    rewritten tails (e.g. thinking dropped), regenerations and edits of earlier messages. The
    model's output is not known in advance, so a turn's history holds placeholder answer tokens
    that `run` replaces with what was really generated."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    system = words(system_len)
    trace: list[Turn] = []
    for t in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            kind = "turn" if t else "first"
            if t and rng.random() < 0.15:
                kind = "regenerate"
            elif t and rng.random() < 0.15:
                kind = "rewrite_tail"
            elif t and rng.random() < 0.1:
                kind = "edit"
            elif t and c % 2 == 1:
                kind = "tool_result"
            size = {"tool_result": rng.randrange(150, 400)}.get(kind, rng.randrange(20, 120))
            trace.append(Turn(c, system + words(size) if t == 0 else words(size), kind))
    return trace


@dataclass
class Record:
    kind: str
    prompt_tokens: int
    cached: int
    oracle_best: int
    prefilled: int
    ttft_ms: float
    forward_ms: float
    restore_ms: float


@dataclass
class RunResult:
    records: list[Record] = field(default_factory=list)
    peak_ram_bytes: int = 0

    def summary(self) -> dict:
        r = self.records
        cached = [x for x in r if x.cached > 0]
        uncached = [x for x in r if x.cached == 0]
        prefilled = sum(x.prefilled for x in r)
        minimum = sum(x.prompt_tokens - x.oracle_best for x in r)
        ratios = [x.ttft_ms / x.forward_ms for x in cached if x.forward_ms > 0]
        return {
            "requests": len(r),
            "prompt_tokens": sum(x.prompt_tokens for x in r),
            "prefilled_tokens": prefilled,
            "oracle_min_prefilled_tokens": minimum,
            "prefilled_vs_oracle": prefilled / max(minimum, 1),
            "hit_rate": len(cached) / max(len(r), 1),
            "ttft_ms_cached": _percentiles([x.ttft_ms for x in cached]),
            "ttft_ms_uncached": _percentiles([x.ttft_ms for x in uncached]),
            "restore_ms_cached": _percentiles([x.restore_ms for x in cached]),
            "cached_ttft_over_new_token_prefill": _percentiles(ratios),
            "peak_ram_bytes": self.peak_ram_bytes,
        }


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p95": None, "n": 0}
    xs = sorted(xs)
    return {"p50": statistics.median(xs), "p95": xs[min(len(xs) - 1, int(0.95 * len(xs)))], "n": len(xs)}


def run(engine, prefix: PrefixCache, trace: list[Turn], gen: int, progress=None) -> RunResult:
    """Replay `trace` through `engine`; histories grow with the real outputs."""
    from hybridlm.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    history: dict[int, list[int]] = {}
    last_prompt: dict[int, list[int]] = {}
    stored: list[list[int]] = []
    rng = random.Random(1234)
    result = RunResult()
    for turn in trace:
        c = turn.conversation
        if turn.kind == "regenerate":
            prompt = last_prompt[c]
        elif turn.kind == "edit":
            old = last_prompt[c]
            cut = rng.randrange(len(old) // 2, len(old))
            prompt = old[:cut] + turn.prompt
        elif turn.kind == "rewrite_tail":
            hist = history[c]
            prompt = hist[: len(hist) - rng.randrange(2, max(3, gen // 2))] + turn.prompt
        else:
            prompt = history.get(c, []) + turn.prompt
        best = min(len(prompt) - 1, max((common_prefix(s, prompt) for s in stored), default=0))
        done = engine.generate(prompt, params)
        out = done.token_ids
        stored.append(prompt + out[:-1])
        history[c], last_prompt[c] = prompt + out, prompt
        u, t = done.usage, done.timings
        forward_ms = t.prefill_ms - u.restore_ms
        result.records.append(
            Record(
                turn.kind,
                len(prompt),
                u.cached_tokens,
                best,
                u.prefilled_tokens,
                t.first_token_ms,
                forward_ms,
                u.restore_ms,
            )
        )
        result.peak_ram_bytes = max(result.peak_ram_bytes, prefix.nbytes)
        if progress is not None:
            progress.update()
    return result


# --trace: (conversations, turns, system tokens, generated tokens) when the flags leave them out
DEFAULTS = {"chat": (4, 5, 1024, 16), "agents": (2, 8, 3000, 48)}


def main(args) -> int:
    from tqdm import tqdm

    from hybridlm.bench.forward import load_bench_model

    given = (args.conversations, args.turns, args.system_tokens, args.gen)
    args.conversations, args.turns, args.system_tokens, args.gen = (
        d if v is None else v for v, d in zip(given, DEFAULTS[args.trace], strict=True)
    )
    model, path, _ = load_bench_model(args)
    if args.trace == "agents":
        return agents_main(args, model, path)
    trace = make_trace(
        args.seed, model.vocab_size, args.conversations, args.turns, args.system_tokens, args.gen
    )
    report = {"model": str(path), "trace": {"requests": len(trace), "seed": args.seed}, "runs": {}}
    budgets = [("budget >= working set", None)]
    for label, budget in budgets:
        report["runs"][label] = _one_run(model, trace, args, budget, label, tqdm)
    working_set = report["runs"][budgets[0][0]]["peak_ram_bytes"]
    quarter = max(1, working_set // 4)
    report["runs"]["budget = working set / 4"] = _one_run(model, trace, args, quarter, "budget = 1/4", tqdm)
    report["runs"]["budget = working set / 4"]["ram_budget_bytes"] = quarter

    print(f"\nmodel {path}: {len(trace)} requests, seed {args.seed}")
    header = f"{'run':<26}{'prefilled':>10}{'oracle min':>11}{'ratio':>7}{'hit rate':>9}"
    header += f"{'TTFT cached p50/p95 ms':>24}{'uncached p50/p95 ms':>21}{'peak RAM MB':>12}"
    print(header)
    for label, s in report["runs"].items():
        tc, tu = s["ttft_ms_cached"], s["ttft_ms_uncached"]
        print(
            f"{label:<26}{s['prefilled_tokens']:>10}{s['oracle_min_prefilled_tokens']:>11}"
            f"{s['prefilled_vs_oracle']:>7.3f}{s['hit_rate']:>9.0%}"
            f"{_fmt(tc):>24}{_fmt(tu):>21}{s['peak_ram_bytes'] / 2**20:>12.1f}"
        )
    full = report["runs"][budgets[0][0]]["cached_ttft_over_new_token_prefill"]
    print(f"cached turn TTFT / time to prefill its new tokens: p50 {full['p50']:.3f}, p95 {full['p95']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def agents_main(args, model, path) -> int:
    """The agent session (`bench.agents`) through one engine with the prefix cache: wall time and
    prefilled tokens against the oracle's fewest."""
    from hybridlm.bench.agents import agent_session, replay
    from hybridlm.engine import Engine, SamplingParams

    session = agent_session(
        args.seed, model.vocab_size, args.conversations, args.turns, args.system_tokens
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
    prefix = PrefixCache(model)
    with Engine(model, None, prefill_chunk=args.prefill_chunk, prefix=prefix) as engine:

        def send(prompt: list[int]) -> tuple[list[int], int]:
            done = engine.generate(prompt, params)
            return done.token_ids, done.usage.prefilled_tokens

        print(f"{session.requests} requests of {args.conversations} agents ...", flush=True)
        summary = replay(session, send).summary()
    report = {"model": str(path), "trace": "agents", "seed": args.seed, "gen": args.gen} | summary
    print(
        f"\nmodel {path}: {summary['requests']} requests, {summary['prompt_tokens']} prompt tokens, "
        f"{args.gen} generated each; wall {summary['wall_s']:.1f} s, prefilled "
        f"{summary['prefilled_tokens']} (oracle min {summary['oracle_min_prefilled_tokens']}, "
        f"{summary['prefilled_vs_oracle']:.3f}x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _fmt(p: dict) -> str:
    return "-" if not p["n"] else f"{p['p50']:.0f}/{p['p95']:.0f}"


def _one_run(model, trace, args, budget, label, tqdm) -> dict:
    from hybridlm.engine import Engine

    prefix = PrefixCache(model, ram_budget=budget)
    with Engine(model, None, prefill_chunk=args.prefill_chunk, prefix=prefix) as engine:
        t0 = time.perf_counter()
        with tqdm(total=len(trace), desc=label, unit="req", leave=False) as bar:
            result = run(engine, prefix, trace, args.gen, bar)
        summary = result.summary()
        summary["seconds"] = time.perf_counter() - t0
        summary["cache_stats"] = vars(prefix.stats)
        if budget is not None:
            summary["within_budget"] = result.peak_ram_bytes <= budget
    return summary
