"""`hybridlm bench cluster`: `bench multiturn`'s chat and agent traces through N replicas under Ray
Serve behind `ray_serve.PrefixAwareRouter`, sharing a Valkey / Redis store: in `prefix` mode, and in
`round_robin` mode (every turn of every conversation on the next replica: the store's worst case),
beside the same replicas round-robin with private caches.

Requests go through the router's OpenAI API as text prompts to `/v1/completions`, one at a time
(or from `--clients` threads), with one generated token each: the API answers text, not token
ids, so a history that held the answers would make the oracle depend on tokens the client never
sees. Histories therefore grow by the trace's new messages (user turns, tool results, rewritten
tails, regenerations, edits), and what a replica stores is exactly each prompt's tokens (encoded
here with the model's tokenizer, as the server does; checked against `usage`): a brute-force
oracle that knows every prompt served gives each request's best reuse, and prefilled tokens
(`usage.cache.prefilled_tokens`, reported by whichever replica served it) are compared with the
sum of (prompt − best reuse).

Store writes are asynchronous (they never delay an answer): a node lands in the store some tens of
milliseconds after its request ends. `--think-ms` is the client's pause between an answer and its
next request; at 0 a follow-up reaches the router before the previous answer's write has landed,
and the router either sends it to the replica that answered (prefix mode) or waits for the write.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from pathlib import Path

from hybridlm.bench.multiturn import make_trace
from hybridlm.cluster import Deployment, ray_cluster
from hybridlm.prefix.cache import common_prefix

MODEL_NAME = "hybridlm"
RUNS = {
    "prefix-aware + shared store": {"store": True, "policy": "prefix"},
    "round-robin + shared store": {"store": True, "policy": "round_robin"},
    "round-robin, private caches": {"store": False, "policy": "round_robin"},
}


def prompts(trace, seed: int, tokenizer) -> list[tuple[int, str, list[int]]]:
    """(conversation, prompt text, its token ids as the server encodes them) per request: `multiturn.run`'s
    histories without the answers, in text (what a client sees).
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
        out.append((c, prompt, tokenizer.encode(prompt, add_special_tokens=True)))
    return out


def oracle_minimum(requests: list[tuple[int, str, list[int]]]) -> int:
    """Tokens a single server with unbounded memory and perfect reuse must prefill (every prompt is
    stored whole: one token is generated, and it never enters the caches)."""
    stored: list[list[int]] = []
    total = 0
    for _, _, ids in requests:
        best = min(len(ids) - 1, max((common_prefix(s, ids) for s in stored), default=0))
        total += len(ids) - best
        stored.append(ids)
    return total


def replay(url: str, requests, think_s: float, clients: int = 1) -> dict:
    """Send `requests` to `url`'s OpenAI API: one at a time, or from `clients` threads, each taking
    whole conversations (their turns in order); totals, and prompt tokens per replica (the
    frontend's answers name the replica)."""
    totals = {"prefilled_tokens": 0, "cached_tokens": 0}
    per_replica: dict[str, int] = {}
    lock = threading.Lock()

    errors: list[Exception] = []

    def client(mine) -> None:
        try:
            for k, (prompt, ids) in enumerate(mine):
                if k:
                    time.sleep(think_s)
                one(prompt, ids)
        except Exception as e:  # re-raised below, in the caller's thread
            errors.append(e)

    def one(prompt, ids) -> None:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as r:
            usage = json.loads(r.read())["usage"]
            replica = r.headers.get("x-hybridlm-replica")
        if usage["prompt_tokens"] != len(ids):
            raise RuntimeError(f"the server encoded {usage['prompt_tokens']} tokens, the oracle {len(ids)}")
        with lock:
            totals["prefilled_tokens"] += usage["cache"]["prefilled_tokens"]
            totals["cached_tokens"] += usage["cache"]["cached_tokens"]
            if replica is not None:
                per_replica[replica] = per_replica.get(replica, 0) + len(ids)

    shares = [[(p, ids) for c, p, ids in requests if c % clients == i] for i in range(clients)]
    threads = [threading.Thread(target=client, args=(mine,)) for mine in shares if mine]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    thinking = think_s * (max(len(mine) for mine in shares) - 1)
    return {
        **totals,
        "seconds": time.perf_counter() - t0 - thinking,
        "prompt_tokens_per_replica": sorted(per_replica.values(), reverse=True),
    }


def _store_sent_bytes(store) -> int:
    """Bytes the store server has sent (entries read by replicas, index replies): lost locality."""
    return int(store.client().info("stats")["total_net_output_bytes"])


def run(args, port: int, requests, label: str, how: dict, think_s: float) -> dict:
    serve_args = ["--prefill-chunk", str(args.prefill_chunk), "--model-name", MODEL_NAME]
    name = "bench" + str(list(RUNS).index(label))
    deployment = Deployment(
        port,
        name,
        args.replicas,
        args.model,
        threads=args.threads,
        serve_args=serve_args,
        wait_s=args.wait_ms / 1e3,
        **how,
    )
    with deployment as d:
        result = replay(d.url, requests, think_s, args.clients)
        result["store_sent_bytes"] = _store_sent_bytes(d.store_server) if d.store_server else None
    return result


def main(args) -> int:
    from hybridlm.models.tokenizer import Tokenizer

    if args.model is None:
        from hybridlm.demo import demo_model_dir

        args.model = str(demo_model_dir())
    tokenizer = Tokenizer.from_dir(args.model)
    trace = make_trace(args.seed, tokenizer.vocab_size, args.conversations, args.turns, args.system_tokens, 1)
    requests = prompts(trace, args.seed, tokenizer)
    minimum = oracle_minimum(requests)
    total = sum(len(ids) for _, _, ids in requests)
    report = {
        "model": args.model,
        "replicas": args.replicas,
        "trace": {"requests": len(requests), "seed": args.seed, "prompt_tokens": total},
        "clients": args.clients,
        "wait_ms": args.wait_ms,
        "oracle_min_prefilled_tokens": minimum,
        "runs": {},  # think ms -> label -> run
    }
    with ray_cluster(args.replicas) as port:
        for think_ms in args.think_ms:
            runs = report["runs"][think_ms] = {}
            for label, how in RUNS.items():
                print(f"{label}, think {think_ms:g} ms: starting {args.replicas} replicas ...", flush=True)
                result = run(args, port, requests, label, how, think_ms / 1e3)
                result["prefilled_vs_oracle"] = result["prefilled_tokens"] / max(minimum, 1)
                runs[label] = result
    print(
        f"\n{len(requests)} requests ({total} prompt tokens), {args.replicas} replicas, seed {args.seed}, "
        f"{args.clients} client(s), router waits ≤ {args.wait_ms:g} ms for a store write; "
        f"single-server oracle minimum: {minimum} prefilled tokens"
    )
    for think_ms, runs in report["runs"].items():
        print(f"\n{think_ms:g} ms between an answer and the next request")
        print(
            f"{'run':<32}{'prefilled':>10}{'vs oracle':>10}{'seconds':>9}{'store sent MB':>14}"
            "  prompt tokens per replica"
        )
        for label, r in runs.items():
            spread = "/".join(f"{x:.0f}" for x in r["prompt_tokens_per_replica"])
            sent = "-" if r["store_sent_bytes"] is None else f"{r['store_sent_bytes'] / 2**20:.1f}"
            print(
                f"{label:<32}{r['prefilled_tokens']:>10}{r['prefilled_vs_oracle']:>10.3f}"
                f"{r['seconds']:>9.1f}{sent:>14}  {spread}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
