"""`hybridlm` command line: generate | demo-model | bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

log = logging.getLogger("hybridlm")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def setup_logging() -> None:
    level = os.environ.get("HYBRIDLM_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("HYBRIDLM_MODEL"),
                   help="checkpoint directory (config.json, *.safetensors, tokenizer.json); "
                        "default: the embedded demo model [env HYBRIDLM_MODEL]")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weight and activation dtype (default bfloat16)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")


def cmd_generate(args) -> int:
    from hybridlm import load_model

    model = load_model(args.model, dtype=DTYPES.get(args.dtype), device=args.device)
    if model.tokenizer is None:
        raise SystemExit(f"hybridlm: {model.path} has no tokenizer.json")
    text = args.prompt
    if args.chat:
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = model.tokenizer.encode(text)
    if not ids:
        raise SystemExit("hybridlm: the prompt encodes to no tokens")
    from hybridlm.models.tokenizer import IncrementalDecoder

    decoder = IncrementalDecoder(model.tokenizer)
    for token in model.stream(ids, args.max_tokens, temperature=args.temperature, seed=args.seed):
        sys.stdout.write(decoder.add(token))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    return 0


def cmd_demo_model(args) -> int:
    from hybridlm.demo import write_demo_model

    print(write_demo_model(args.out))
    return 0


def cmd_bench(args) -> int:
    from hybridlm.bench import forward

    if args.what == "forward":
        return forward.main(args)
    raise SystemExit(f"hybridlm: unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridlm", description="Inference engine for hybrid language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue a prompt and print the text",
                       description="Continue a prompt with the model and print the continuation as it is generated.")
    add_model_args(g)
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo-model", help="write the embedded demo checkpoint to a directory",
                       description="Write the small random-weight demo checkpoint (Qwen3.5-style hybrid, real "
                                   "tokenizer and chat template) to --out.")
    d.add_argument("--out", required=True, help="directory to write")
    d.set_defaults(func=cmd_demo_model)

    b = sub.add_parser("bench", help="measure speed next to the machine's limits",
                       description="Benchmarks. `forward`: prefill (512, 2048 tokens) and decode tokens/s beside the "
                                   "measured memory bandwidth and matmul rate.")
    b.add_argument("what", choices=["forward"], help="which benchmark")
    add_model_args(b)
    b.add_argument("--preset", choices=["qwen3.5-0.8b"], default=None,
                   help="use a random-weight checkpoint of this published shape (written once to the cache dir)")
    b.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prefill lengths (default 512 2048)")
    b.add_argument("--decode", type=int, default=32, help="decode steps to time (default 32)")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    b.add_argument("--json", default=None, help="also write the report as JSON to this file")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    from hybridlm.models.loader import CheckpointError

    try:
        return args.func(args)
    except CheckpointError as e:
        print(f"hybridlm: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
