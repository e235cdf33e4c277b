"""`hybridlm bench concurrency`: many streaming clients at once through the HTTP server.

The server runs in this process (uvicorn on a thread, a free loopback port, as `bench serve`); the
clients run in a separate process (`concurrent_client.py`). For each client count N, N clients send
distinct random prompts (cold: no prefix is shared) at once, each streaming `--max-tokens` greedy
tokens. Reported per N: aggregate generated tokens/s (all generated tokens ÷ wall time, first request
sent → last stream done), time to first token (TTFT) and time per output token (TPOT, per request:
(done − first text) ÷ (tokens − 1), as vLLM's benchmark defines it) p50 / p95 over requests, the
inter-token gap p95 over all tokens, prefix reuse (cached ÷ prompt tokens) and the process's peak
resident memory during the round. With `--long-prompt L`, one more round per N runs N − 1 clients
and sends an L-token prompt once they all decode; its TPOT p95 (of the N − 1) beside the same
round's without it is the interference of a long prompt arriving mid-run, and the long prompt's
TTFT what the time share (`--prefill-share`) makes it pay.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import tokenizers
import torch

from hybridlm.api import Model
from hybridlm.bench.serve import MODEL_NAME, start_server
from hybridlm.engine import serial_setup
from hybridlm.models.base import CausalLM
from hybridlm.models.tokenizer import Tokenizer
from hybridlm.runtime import freeze_loaded_objects
from hybridlm.settings import Settings, make_engine


def id_tokenizer(vocab: int) -> Tokenizer:
    """A tokenizer whose token i reads "ti": for random checkpoints that ship none (the presets), so
    that every generated token streams text, as with a real tokenizer."""
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


def with_tokenizer(lm: CausalLM, path: Path) -> Model:
    """The checkpoint's `Model` (warmed up), with `id_tokenizer` when it ships no tokenizer.json."""
    own = (path / "tokenizer.json").exists()
    tokenizer = Tokenizer.from_dir(path) if own else id_tokenizer(lm.vocab_size)
    model = Model(lm, tokenizer, path)
    with serial_setup():
        model.warm_up()
    return model


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class PeakRSS:
    """Peak resident memory of this process while the block runs (sampled every 20 ms)."""

    def __enter__(self) -> PeakRSS:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            try:
                with open("/proc/self/statm") as f:
                    self.peak = max(self.peak, int(f.read().split()[1]) * 4096)
            except OSError:
                return
            if self._stop.wait(0.02):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def summarise(result: dict, streams: list[dict], prompt_tokens: int, peak: int) -> dict:
    tokens = sum(s["tokens"] for s in streams)
    ttft = [(s["first"] - s["start"]) * 1e3 for s in streams]
    tpot = [(s["done"] - s["first"]) / (s["tokens"] - 1) * 1e3 for s in streams if s["tokens"] > 1]
    gaps = [(b - a) * 1e3 for s in streams for a, b in zip(s["arrivals"], s["arrivals"][1:], strict=False)]
    prompts = prompt_tokens * len(streams)
    return {
        "clients": len(streams),
        "generated_tokens": tokens,
        "wall_s": result["wall"],
        "aggregate_tok_s": tokens / result["wall"],
        "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p95": percentile(ttft, 0.95),
        "tpot_ms_p50": percentile(tpot, 0.5),
        "tpot_ms_p95": percentile(tpot, 0.95),
        "itl_ms_p95": percentile(gaps, 0.95),
        "prefix_reuse": sum(s["cached"] for s in streams) / prompts if prompts else 0.0,
        "peak_rss_gb": peak / 1e9,
    }


def line(row: dict) -> str:
    return (
        f"{row['aggregate_tok_s']:7.1f} tok/s  TTFT p50/p95 {row['ttft_ms_p50']:7.0f}/"
        f"{row['ttft_ms_p95']:7.0f} ms  TPOT p50/p95 {row['tpot_ms_p50']:6.1f}/{row['tpot_ms_p95']:6.1f} ms"
        f"  ITL p95 {row['itl_ms_p95']:6.1f} ms  reuse {row['prefix_reuse']:.2f}"
        f"  peak RSS {row['peak_rss_gb']:.2f} GB"
    )


def speculation_counts(engine) -> dict[str, int] | None:
    """The engine's speculative totals so far (None without speculative decoding)."""
    if engine.speculative is None:
        return None
    t = engine.speculative.totals
    return {"drafted": t.drafted_tokens, "accepted": t.accepted_tokens, "verify_passes": t.verify_passes}


def main(args, model) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = make_engine(model, Settings.of(args))
    freeze_loaded_objects()  # as `hybridlm serve` does
    port, stop_server = start_server(engine)
    client = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("concurrent_client.py"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    vocab = min(model.tokenizer.vocab_size, model.lm.vocab_size)
    rng = torch.Generator().manual_seed(args.seed)
    # Prompts never repeat (a fresh random draw each): every round is cold, as the anchors.
    prompt = lambda n: torch.randint(0, vocab, (n,), generator=rng).tolist()

    def body(n: int, client: int = 0) -> dict:
        """Client `client`'s request with an n-token prompt; with --speculative-clients K only
        clients 0 … K-1 decode speculatively."""
        return {
            "model": MODEL_NAME,
            "prompt": prompt(n),
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "speculative": args.speculative_clients is None or client < args.speculative_clients,
        }

    def bodies(n: int) -> list[dict]:
        return [body(args.prompt_tokens, i) for i in range(n)]

    def run(bodies: list[dict], late: list[dict] = ()) -> tuple[dict, int]:
        with PeakRSS() as rss:
            client.stdin.write(json.dumps({"port": port, "bodies": bodies, "late": list(late)}) + "\n")
            client.stdin.flush()
            line = client.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark client exited with {client.wait()}")
        return json.loads(line), rss.peak

    report: dict = {
        "model": str(model.path),
        "threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "max_running": engine.scheduler.max_running,
        "max_batch_tokens": engine.scheduler.max_batch_tokens,
        "prefix_cache": engine.prefix is not None,
        "rounds": [],
        "long_prompt": [],
    }
    try:
        print("warming up ...", flush=True)
        run(bodies(2))
        for n in args.clients:
            for _ in range(args.repeats):
                before = speculation_counts(engine)
                result, peak = run(bodies(n))
                row = summarise(result, result["streams"], args.prompt_tokens, peak)
                if before is not None:
                    after = speculation_counts(engine)
                    row["speculative"] = {k: after[k] - before[k] for k in before}
                report["rounds"].append(row)
                print(f"{n:>3} clients: " + line(row), flush=True)
                if args.long_prompt and n > 1:
                    result, peak = run(bodies(n - 1), [body(args.long_prompt, n - 1)])
                    decoding = summarise(result, result["streams"][: n - 1], args.prompt_tokens, peak)
                    quiet, _ = run(bodies(n - 1))
                    baseline = summarise(quiet, quiet["streams"], args.prompt_tokens, 0)
                    ratio = decoding["tpot_ms_p95"] / baseline["tpot_ms_p95"]
                    late = result["streams"][n - 1]
                    long_ttft = (late["first"] - late["start"]) * 1e3  # the price of the time share
                    report["long_prompt"].append(
                        {
                            "clients": n,
                            "with_long": decoding,
                            "without": baseline,
                            "tpot_p95_ratio": ratio,
                            "long_ttft_ms": long_ttft,
                        }
                    )
                    print(
                        f"    + a {args.long_prompt}-token prompt mid-run: TPOT p95 of the {n - 1} decoding "
                        f"{decoding['tpot_ms_p95']:.1f} ms vs {baseline['tpot_ms_p95']:.1f} ms without "
                        f"({ratio:.2f}x); its TTFT {long_ttft / 1e3:.1f} s",
                        flush=True,
                    )
    finally:
        client.stdin.close()
        client.wait(60)
        stop_server()
        engine.close()
    by_n: dict[int, list[dict]] = {}
    for row in report["rounds"]:
        by_n.setdefault(row["clients"], []).append(row)
    report["best"] = {
        n: {
            "aggregate_tok_s": max(r["aggregate_tok_s"] for r in rows),
            "aggregate_tok_s_spread": [
                min(r["aggregate_tok_s"] for r in rows),
                max(r["aggregate_tok_s"] for r in rows),
            ],
            "tpot_ms_p95": min(r["tpot_ms_p95"] for r in rows),
            "ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in rows),
        }
        for n, rows in by_n.items()
    }
    if 1 in by_n:
        one = report["best"][1]
        for best in report["best"].values():
            best["speedup_vs_1"] = best["aggregate_tok_s"] / one["aggregate_tok_s"]
            best["tpot_p95_vs_1"] = best["tpot_ms_p95"] / one["tpot_ms_p95"]
        print(
            "\nbest of repeats: "
            + ", ".join(
                f"{n} clients {b['aggregate_tok_s']:.1f} tok/s ({b['speedup_vs_1']:.2f}x, TPOT p95 "
                f"{b['tpot_p95_vs_1']:.2f}x)"
                for n, b in report["best"].items()
            )
        )
    if engine.speculative is not None:
        # What the depth controller measured: seconds per step by rows in it (decode + verify rows).
        steps = engine.speculative.controller.measured_step_seconds()
        report["step_ms_by_rows"] = {rows: seconds * 1e3 for rows, seconds in steps.items()}
        print("step ms by rows:", ", ".join(f"{r}: {ms:.0f}" for r, ms in report["step_ms_by_rows"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
