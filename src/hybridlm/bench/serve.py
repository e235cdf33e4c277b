"""`hybridlm bench serve`: time to first token and decode tokens/s through HTTP vs the engine alone.

The server runs in this process (uvicorn on a thread, a free loopback port) over the same engine
the direct runs use; the HTTP client is a separate process (`concurrent_client.py`), as real clients are.
Each run sends the same greedy request (a fixed random prompt of token ids, `ignore_eos`, a fixed
number of tokens); engine and HTTP runs alternate so drift in machine load hits both sides alike.
Both sides time the same events: TTFT is request start → first text received; decode tokens/s is
(completion tokens − 1) ÷ (first text → finish). The HTTP overhead is the extra decode time per
token through HTTP, in percent: the median over pairs of consecutive engine and HTTP runs, so that
drift in the machine's load cancels out.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import uvicorn

from hybridlm.engine import Engine, SamplingParams
from hybridlm.server import create_app

MODEL_NAME = "bench"


@dataclass(frozen=True)
class Run:
    ttft_ms: float
    decode_tok_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(engine: Engine, ids: list[int], params: SamplingParams) -> Run:
    start = time.perf_counter()
    first = None
    for event in engine.stream(ids, params):
        if first is None and event.text:
            first = time.perf_counter()
        if event.finished:
            done = time.perf_counter()
            tokens = event.usage.completion_tokens
    return Run((first - start) * 1e3, (tokens - 1) / (done - first))


class HTTPClient:
    """`concurrent_client.py` in its own process; `run` sends one streaming request and returns its
    timings: time to first text, and (completion tokens − 1) ÷ (first text → final usage chunk)."""

    def __init__(self, port: int):
        script = Path(__file__).with_name("concurrent_client.py")
        self._port = port
        self._proc = subprocess.Popen(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, ids: list[int], max_tokens: int) -> Run:
        body = {
            "model": MODEL_NAME,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._proc.stdin.write(json.dumps({"port": self._port, "bodies": [body]}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark client exited with {self._proc.wait()}")
        stream = json.loads(line)["streams"][0]
        if stream["tokens"] < 2:
            raise RuntimeError("the stream carried fewer than two tokens")
        first, done = stream["first"], stream["done"]
        return Run((first - stream["start"]) * 1e3, (stream["tokens"] - 1) / (done - first))

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(30)


def start_server(engine: Engine) -> tuple[int, Callable[[], None]]:
    """Serve `engine` as `MODEL_NAME` from uvicorn on a thread of this process, on a free loopback port;
    returns the port (once it accepts connections) and the function that stops the server."""
    port = free_port()
    config = uvicorn.Config(
        create_app(engine, MODEL_NAME), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="bench-server", daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join()

    return port, stop


def main(args, model) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(
        model.lm, model.tokenizer, prefill_chunk=args.prefill_chunk, context_length=args.context_length
    )
    port, stop_server = start_server(engine)

    # Ids fixed by a seed, so every run prefills the same prompt.
    vocab = min(model.tokenizer.vocab_size, model.lm.vocab_size)
    ids = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    direct: list[Run] = []
    through_http: list[Run] = []
    client = HTTPClient(port)
    try:
        print(f"warming up, then {args.repeats} runs each ...", flush=True)
        run_engine(engine, ids, params)
        client.run(ids, args.max_tokens)
        for _ in range(args.repeats):
            direct.append(run_engine(engine, ids, params))
            through_http.append(client.run(ids, args.max_tokens))
    finally:
        client.close()
        stop_server()
        engine.close()

    def summary(runs: list[Run]) -> dict[str, float]:
        # Other load on the machine only ever slows a run, so the best run is the least disturbed one.
        return {
            "ttft_ms": statistics.median(r.ttft_ms for r in runs),
            "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
            "best_ttft_ms": min(r.ttft_ms for r in runs),
            "best_decode_tok_s": max(r.decode_tok_s for r in runs),
        }

    # The overhead compares each HTTP run with the engine run just before it, so drift in the machine's
    # load between runs cancels out; the median over the pairs is the figure reported.
    pairs = list(zip(direct, through_http, strict=True))
    report = {
        "model": str(model.path),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "prompt_tokens": len(ids),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "engine": summary(direct),
        "http": summary(through_http),
        "http_decode_overhead_pct": statistics.median(
            (d.decode_tok_s / h.decode_tok_s - 1) * 100 for d, h in pairs
        ),
        # The same in absolute terms, which carries over to models of other sizes.
        "http_decode_overhead_us_per_token": statistics.median(
            (1 / h.decode_tok_s - 1 / d.decode_tok_s) * 1e6 for d, h in pairs
        ),
        "http_ttft_overhead_ms": statistics.median(h.ttft_ms - d.ttft_ms for d, h in pairs),
        "runs": {"engine": [asdict(r) for r in direct], "http": [asdict(r) for r in through_http]},
    }
    print(
        f"\n{model.path.name}: {len(ids)}-token prompt, {args.max_tokens} tokens generated, "
        f"{args.repeats} runs each, {report['threads']} torch threads, {model.device}"
    )
    print(f"{'':<16}{'TTFT ms':>20}{'decode tok/s':>20}")
    print(f"{'':<16}{'median':>10}{'best':>10}{'median':>10}{'best':>10}")
    for name, r in (("engine alone", report["engine"]), ("HTTP streaming", report["http"])):
        print(
            f"{name:<16}{r['ttft_ms']:>10.1f}{r['best_ttft_ms']:>10.1f}"
            f"{r['decode_tok_s']:>10.1f}{r['best_decode_tok_s']:>10.1f}"
        )
    pct, us, ms = (
        report[k]
        for k in ("http_decode_overhead_pct", "http_decode_overhead_us_per_token", "http_ttft_overhead_ms")
    )
    print(
        f"HTTP overhead (median over paired runs): decode time per token {pct:+.1f}% ({us:+.0f} µs), "
        f"time to first token {ms:+.1f} ms"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
