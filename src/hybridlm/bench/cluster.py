"""`hybridlm bench cluster`: `bench multiturn`'s chat and agent traces through N replicas + a shared
Valkey / Redis store + SGLang's router (prefix-aware, and round-robin so that every conversation is
spread over the replicas), beside the same replicas round-robin without the store.

Requests go through the router's OpenAI API as text prompts to `/v1/completions` (the router
takes no token-id prompts), one at a time, with one generated token each: the API answers text,
not token ids, so a history that held the answers would make the oracle depend on tokens the client
never sees. Histories therefore grow by the trace's new messages (user turns, tool results,
rewritten tails, regenerations, edits), and what a replica stores is exactly each prompt's tokens
(encoded here with the model's tokenizer, as the server does; checked against `usage`): a
brute-force oracle that knows every prompt served gives each request's best reuse, and prefilled
tokens (`usage.cache.prefilled_tokens`, reported by whichever replica served it) are compared with
the sum of (prompt − best reuse).

Store writes are asynchronous (they never delay an answer): a node lands in the store some tens of
milliseconds after its request ends (encoding and digests of MBs of snapshots). `--think-ms` is the
client's pause between an answer and its next request (a user reading, a tool running); at 0 a
request sent on another replica right after the previous answer can miss what that answer's
replica has not yet written.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from hybridlm.bench.multiturn import make_trace
from hybridlm.cluster import Deployment, get_json, post_json
from hybridlm.prefix.cache import common_prefix

# Round-robin spreads every conversation over all replicas (each turn on the next one): the shared
# store's worst case. The prefix-aware router keeps a conversation where its prefix was seen.
RUNS = {
    "prefix-aware + shared store": {"store": True, "policy": "cache_aware"},
    "round-robin + shared store": {"store": True, "policy": "round_robin"},
    "round-robin, private caches": {"store": False, "policy": "round_robin"},
}


def prompts(trace, seed: int, tokenizer) -> list[tuple[str, list[int]]]:
    """(prompt text, its token ids as the server encodes them) per request: `multiturn.run`'s
    histories without the answers, in text (SGLang's router takes text prompts, not token ids).
    Each message is the trace's random tokens decoded; edits and rewritten tails cut the text."""
    rng = random.Random(seed)
    history: dict[int, str] = {}
    last: dict[int, str] = {}
    out = []
    for turn in trace:
        c = turn.conversation
        message = tokenizer.decode(turn.prompt, skip_special_tokens=True)
        if turn.kind == "regenerate":
            prompt = last[c]
        elif turn.kind == "edit":
            old = last[c]
            prompt = old[: rng.randrange(len(old) // 2, len(old))] + message
        elif turn.kind == "rewrite_tail":
            hist = history[c]
            prompt = hist[: len(hist) - rng.randrange(4, 32)] + message
        else:
            prompt = history.get(c, "") + message
        history[c] = last[c] = prompt
        out.append((prompt, tokenizer.encode(prompt, add_special_tokens=True)))
    return out


def oracle_minimum(requests: list[tuple[str, list[int]]]) -> int:
    """Tokens a single server with unbounded memory and perfect reuse must prefill (every prompt is
    stored whole: one token is generated, and it never enters the caches)."""
    stored: list[list[int]] = []
    total = 0
    for _, ids in requests:
        best = min(len(ids) - 1, max((common_prefix(s, ids) for s in stored), default=0))
        total += len(ids) - best
        stored.append(ids)
    return total


def replay(deployment: Deployment, requests, model_name: str, think_s: float) -> dict:
    prefilled = cached = 0
    t0 = time.perf_counter()
    for k, (prompt, ids) in enumerate(requests):
        if k:
            time.sleep(think_s)
        body = {"model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        usage = post_json(f"{deployment.router_url}/v1/completions", body)["usage"]
        if usage["prompt_tokens"] != len(ids):
            raise RuntimeError(
                f"the server encoded {usage['prompt_tokens']} tokens where the oracle has {len(ids)}"
            )
        prefilled += usage["cache"]["prefilled_tokens"]
        cached += usage["cache"]["cached_tokens"]
    seconds = time.perf_counter() - t0
    served = [_metric(url, "hybridlm_prompt_tokens_total") for url in deployment.urls]
    fetched = [_metric(url, "hybridlm_prefix_store_fetched_nodes_total") for url in deployment.urls]
    return {
        "prefilled_tokens": prefilled,
        "cached_tokens": cached,
        "seconds": seconds - think_s * (len(requests) - 1),
        "prompt_tokens_per_replica": served,
        "store_nodes_read_per_replica": fetched,
    }


def _metric(url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def main(args) -> int:
    from hybridlm.models.tokenizer import Tokenizer

    if args.model is None:
        from hybridlm.demo import demo_model_dir

        args.model = str(demo_model_dir())
    tokenizer = Tokenizer.from_dir(args.model)
    trace = make_trace(args.seed, tokenizer.vocab_size, args.conversations, args.turns, args.system_tokens, 1)
    requests = prompts(trace, args.seed, tokenizer)
    minimum = oracle_minimum(requests)
    total = sum(len(ids) for _, ids in requests)
    report = {
        "model": args.model,
        "replicas": args.replicas,
        "trace": {"requests": len(requests), "seed": args.seed, "prompt_tokens": total},
        "think_ms": args.think_ms,
        "oracle_min_prefilled_tokens": minimum,
        "runs": {},
    }
    for label, how in RUNS.items():
        print(f"{label}: starting {args.replicas} replicas ...", flush=True)
        serve_args = ["--prefill-chunk", str(args.prefill_chunk)]
        with Deployment(args.replicas, args.model, threads=args.threads, serve_args=serve_args, **how) as d:
            name = get_json(f"{d.urls[0]}/v1/models")["data"][0]["id"]
            run = replay(d, requests, name, args.think_ms / 1e3)
        run["prefilled_vs_oracle"] = run["prefilled_tokens"] / max(minimum, 1)
        report["runs"][label] = run
    print(
        f"\n{len(requests)} requests ({total} prompt tokens), {args.replicas} replicas, seed {args.seed}, ",
        end="",
    )
    print(f"{args.think_ms:g} ms between an answer and the next request")
    print(f"single-server oracle minimum: {minimum} prefilled tokens")
    print(f"{'run':<30}{'prefilled':>10}{'vs oracle':>10}{'seconds':>9}  prompt tokens per replica")
    for label, r in report["runs"].items():
        spread = "/".join(f"{x:.0f}" for x in r["prompt_tokens_per_replica"])
        print(
            f"{label:<30}{r['prefilled_tokens']:>10}{r['prefilled_vs_oracle']:>10.3f}"
            f"{r['seconds']:>9.1f}  {spread}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
