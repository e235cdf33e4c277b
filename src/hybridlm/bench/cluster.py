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
import shlex
import threading
import time
import urllib.request
from pathlib import Path

from hybridlm.bench.multiturn import make_trace
from hybridlm.cluster import Deployment, free_port
from hybridlm.prefix.cache import common_prefix

# Round-robin spreads every conversation over all replicas (each turn on the next one): the shared
# store's worst case. SGLang's cache-aware policy matches request text against its own tree of what
# it routed; the Ray Serve router (hybridlm.ray_serve, with --ray) asks the store which replica holds
# the deepest stored prefix.
MODEL_NAME = "hybridlm"
RUNS = {
    "SGLang cache-aware + shared store": {"store": True, "policy": "cache_aware"},
    "Ray Serve prefix-aware + shared store": {},
    "round-robin + shared store": {"store": True, "policy": "round_robin"},
    "round-robin, private caches": {"store": False, "policy": "round_robin"},
}


def prompts(trace, seed: int, tokenizer) -> list[tuple[int, str, list[int]]]:
    """(conversation, prompt text, its token ids as the server encodes them) per request: `multiturn.run`'s
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
    whole conversations (their turns in order); totals, and prompt tokens per replica when the
    answers name it (Ray's frontend does)."""
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


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _store_sent_bytes(store_url: str | None) -> int | None:
    """Bytes the store server has sent (entries read by replicas, index replies): locality."""
    if store_url is None:
        return None
    import valkey

    return int(valkey.Valkey.from_url(store_url).info("stats")["total_net_output_bytes"])


def run_sglang(args, requests, how: dict) -> dict:
    serve_args = ["--prefill-chunk", str(args.prefill_chunk), "--model-name", MODEL_NAME]
    router_args = shlex.split(args.router_args) if how["policy"] == "cache_aware" else []
    deployment = Deployment(
        args.replicas, args.model, threads=args.threads, serve_args=serve_args, router_args=router_args, **how
    )
    with deployment as d:
        run = replay(d.router_url, requests, args.think_ms / 1e3, args.clients)
        run["prompt_tokens_per_replica"] = sorted(
            (_metric(u, "hybridlm_prompt_tokens_total") for u in d.urls), reverse=True
        )
        run["store_sent_bytes"] = _store_sent_bytes(d.store_url)
    return run


def run_ray(args, requests) -> dict:
    """The same replicas as a Ray Serve deployment behind `ray_serve.PrefixAwareRouter`."""
    import ray
    import torch
    from ray import serve

    from hybridlm.models import load_model
    from hybridlm.prefix.disk import model_fingerprint
    from hybridlm.ray_serve import RayCluster, build

    fingerprint = model_fingerprint(load_model(args.model, dtype=torch.bfloat16, device="cpu"))
    serve_args = ("--prefill-chunk", str(args.prefill_chunk), "--model-name", MODEL_NAME)
    with Deployment(0, store=True, policy=None) as store:
        port = free_port()
        t0 = time.perf_counter()
        ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            spec = RayCluster(
                args.model, store.store_url, fingerprint, args.replicas, args.threads, serve_args
            )
            serve.run(build(spec), route_prefix="/")
            started = time.perf_counter() - t0
            run = replay(f"http://127.0.0.1:{port}", requests, args.think_ms / 1e3, args.clients)
            run["startup_seconds"] = started
            run["store_sent_bytes"] = _store_sent_bytes(store.store_url)
        finally:
            serve.shutdown()
            ray.shutdown()
    return run


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
        "think_ms": args.think_ms,
        "clients": args.clients,
        "oracle_min_prefilled_tokens": minimum,
        "runs": {},
    }
    runs = [label for label in RUNS if args.ray or "Ray" not in label]
    for label in runs:
        print(f"{label}: starting {args.replicas} replicas ...", flush=True)
        run = run_ray(args, requests) if "Ray" in label else run_sglang(args, requests, RUNS[label])
        run["prefilled_vs_oracle"] = run["prefilled_tokens"] / max(minimum, 1)
        report["runs"][label] = run
    print(
        f"\n{len(requests)} requests ({total} prompt tokens), {args.replicas} replicas, seed {args.seed}, ",
        end="",
    )
    print(f"{args.think_ms:g} ms between an answer and the next request, {args.clients} client(s)")
    print(f"single-server oracle minimum: {minimum} prefilled tokens")
    print(
        f"{'run':<36}{'prefilled':>10}{'vs oracle':>10}{'seconds':>9}{'store sent MB':>14}"
        "  prompt tokens per replica"
    )
    for label, r in report["runs"].items():
        spread = "/".join(f"{x:.0f}" for x in r["prompt_tokens_per_replica"])
        sent = "-" if r["store_sent_bytes"] is None else f"{r['store_sent_bytes'] / 2**20:.1f}"
        print(
            f"{label:<36}{r['prefilled_tokens']:>10}{r['prefilled_vs_oracle']:>10.3f}"
            f"{r['seconds']:>9.1f}{sent:>14}  {spread}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
