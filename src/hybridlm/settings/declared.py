"""Every `hybridlm serve` setting, declared once: its flag, environment variable, default and help.

`Settings` is the dataclass a server is built from (`settings.build`); `add_flags` turns its
declaration into argparse flags (the CLI's, and `Settings.parse` for the Ray integration and tests),
and `environment_epilog` / `markdown_table` write the `--help` epilog and the table in
docs/command-line.md from the same declaration.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

from hybridlm.ops import QUANTIZATIONS
from hybridlm.settings import values
from hybridlm.settings.values import DTYPES, Parser

DEMO_MODEL_NAME = "hybridlm-demo"

# The groups a command takes: chat and the benchmarks take MODEL (and some ENGINE) flags, serve all.
MODEL, ENGINE, SERVER = "model", "engine", "server"

# Read by the process, not by a flag; listed in the epilog and the docs table after the flags.
OTHER_ENVIRONMENT = {
    "HYBRIDLM_LOG_LEVEL": "log level: DEBUG, INFO, WARNING (default), ERROR",
    "HYBRIDLM_DEMO_DIR": "where the demo model is written (default ~/.cache/hybridlm/demo-model)",
}


@dataclass(frozen=True)
class Flag:
    """How one `Settings` field is given on the command line. `default` is the text a user would
    type (parsed by `type` like a typed value); `switch` makes a store_true flag whose variable
    turns it on when set to 0 (`HYBRIDLM_PREFIX_CACHE=0` for `--no-prefix-cache`)."""

    group: str
    help: str
    default: str | None = None
    env: str | None = None
    type: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    switch: bool = False

    def option(self, name: str) -> str:
        return "--" + name.replace("_", "-")

    def value(self, text: str | None):
        """The setting's value for the text `text` (a default, or an environment variable's)."""
        if self.switch:
            return text == "0"
        if text is None or self.type is None:
            return text
        return self.type(text)


def setting(group: str, help: str, default: str | None = None, **how):
    """A `Settings` field declared by its `Flag`; the field's own default is the parsed `default`."""
    flag = Flag(group, help, default, **how)
    return field(default=flag.value(default), metadata={"flag": flag})


@dataclass
class Settings:
    """What a server is built from, one field per `hybridlm serve` flag (`--cache-ram` is
    `cache_ram`). Sizes are in bytes, times in seconds."""

    model: str | None = setting(
        MODEL,
        "checkpoint directory (config.json, *.safetensors, tokenizer.json); default: the embedded demo model",
        env="HYBRIDLM_MODEL",
    )
    dtype: str | None = setting(
        MODEL, "weight and activation dtype (default bfloat16)", choices=tuple(sorted(DTYPES))
    )
    device: str | None = setting(
        MODEL, "torch device (default: cuda if available, else cpu)", type=values.device
    )
    quantize: str | None = setting(
        MODEL,
        "weight-only quantization of every linear layer on load, LM head included (int8: per "
        "output channel; int4: groups of 64); a checkpoint written by `hybridlm quantize` loads "
        "quantized without it",
        env="HYBRIDLM_QUANTIZE",
        type=values.quantization,
        metavar="{" + ",".join(QUANTIZATIONS) + "}",
    )
    model_name: str | None = setting(
        SERVER,
        "the model id clients send and /v1/models lists (default: the checkpoint directory's "
        f"name, {DEMO_MODEL_NAME!r} for the demo model)",
        env="HYBRIDLM_MODEL_NAME",
    )
    host: str = setting(
        SERVER,
        "address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the server to the network)",
        "127.0.0.1",
        env="HYBRIDLM_HOST",
    )
    port: int = setting(SERVER, "TCP port (default 8000)", "8000", env="HYBRIDLM_PORT", type=values.port)
    api_key: str | None = setting(
        SERVER,
        "require 'Authorization: Bearer KEY' on every endpoint but /health (default: no key)",
        env="HYBRIDLM_API_KEY",
    )
    cache_ram: int = setting(
        ENGINE,
        "byte budget of the prefix cache's snapshots in host memory, e.g. 4G, 512M (default 4G)",
        "4G",
        env="HYBRIDLM_CACHE_RAM",
        type=values.byte_size,
    )
    cache_dir: str | None = setting(
        ENGINE,
        "directory for the prefix cache's disk tier (snapshots demoted from RAM, kept across "
        "restarts of the same model; safetensors files)",
        env="HYBRIDLM_CACHE_DIR",
    )
    cache_disk: int = setting(
        ENGINE,
        "byte budget of --cache-dir (default 16G)",
        "16G",
        env="HYBRIDLM_CACHE_DISK",
        type=values.byte_size,
    )
    cache_store: str | None = setting(
        ENGINE,
        "redis://HOST:PORT/DB of a Valkey / Redis server shared by replicas: prefixes missing here "
        "are restored from it, and what this server computes is written to it",
        env="HYBRIDLM_CACHE_STORE",
        type=values.store_url,
    )
    replica: str = setting(
        ENGINE,
        "this replica's name in --cache-store, published for a prefix-aware router "
        "(its base URL, e.g. http://10.0.0.5:8000)",
        "",
        env="HYBRIDLM_REPLICA",
    )
    no_prefix_cache: bool = setting(
        ENGINE,
        "prefill every prompt from scratch (no reuse across requests)",
        env="HYBRIDLM_PREFIX_CACHE",
        switch=True,
    )
    prefill_chunk: int = setting(
        ENGINE,
        "most prompt tokens per forward pass (default 512)",
        "512",
        env="HYBRIDLM_PREFILL_CHUNK",
        type=values.positive_int,
    )
    max_running: int = setting(
        ENGINE,
        "most requests generating at once, each with caches of its own; decode steps read the "
        "weights once for all of them (default 8)",
        "8",
        env="HYBRIDLM_MAX_RUNNING",
        type=values.at_least_one,
    )
    max_batch_tokens: int = setting(
        ENGINE,
        "tokens per engine step: decode rows first, then prompt chunks while they fit (at least "
        "one chunk per step), so a long prompt delays running streams by about one budget's worth "
        "(default 512)",
        "512",
        env="HYBRIDLM_MAX_BATCH_TOKENS",
        type=values.at_least_one,
    )
    prefill_share: float = setting(
        ENGINE,
        "while requests decode, prompts that arrive later prefill for at most this fraction of "
        "the decode time (on average), so their time per output token grows at most 1 + this "
        "factor; the late prompt waits longer for its first token (default 0.5)",
        "0.5",
        env="HYBRIDLM_PREFILL_SHARE",
        type=values.positive_float,
    )
    context_length: int | None = setting(
        ENGINE,
        "most tokens (prompt + output) per request; longer prompts are refused "
        "(default: the model's max_position_embeddings)",
        env="HYBRIDLM_CONTEXT_LENGTH",
        type=values.context_length,
    )
    speculative: str | None = setting(
        ENGINE,
        "speculative decoding (greedy output unchanged, sampled output equally distributed): "
        "'ngram' drafts by prompt lookup in the request's own tokens, 'draft' with --draft-model (a "
        "Gemma 4 assistant checkpoint drafts from its Gemma 4 model's own keys/values), 'mtp' "
        "with the checkpoint's own multi-token-prediction head (Qwen3.5, Qwen3-Next: mtp.* tensors); the "
        "draft length adapts and falls back to plain decoding when drafts do not pay (default: off; "
        'requests opt out with "speculative": false)',
        env="HYBRIDLM_SPECULATIVE",
        choices=("ngram", "draft", "mtp"),
    )
    draft_model: str | None = setting(
        ENGINE,
        "checkpoint directory of a smaller model with the same tokenizer, or of a Gemma 4 assistant "
        "(model_type gemma4_assistant, for a Gemma 4 model), for --speculative draft",
        env="HYBRIDLM_DRAFT_MODEL",
    )
    draft_quantize: str | None = setting(
        ENGINE,
        "quantize the draft model's linear layers on load (weight-only, as --quantize)",
        env="HYBRIDLM_DRAFT_QUANTIZE",
        choices=QUANTIZATIONS,
    )
    num_draft: int = setting(
        ENGINE,
        "most draft tokens per verify pass (default 8)",
        "8",
        env="HYBRIDLM_NUM_DRAFT",
        type=int,
    )
    max_queue: int = setting(
        SERVER,
        "most requests waiting for the engine; more get HTTP 429 (default 64)",
        "64",
        env="HYBRIDLM_MAX_QUEUE",
        type=values.non_negative_int,
    )
    graceful_timeout: float = setting(
        SERVER,
        "seconds running requests may finish after SIGTERM / Ctrl-C before they are cancelled (default 30)",
        "30",
        env="HYBRIDLM_GRACEFUL_TIMEOUT",
        type=values.non_negative_float,
    )
    max_body: int = setting(
        SERVER,
        "largest request body; larger ones get HTTP 413 (default 16M)",
        "16M",
        env="HYBRIDLM_MAX_BODY",
        type=values.byte_size,
    )
    read_timeout: float = setting(
        SERVER,
        "seconds a client has to send a request's head, and each part of its body (then the "
        "connection is closed / HTTP 408) (default 30)",
        "30",
        env="HYBRIDLM_READ_TIMEOUT",
        type=values.positive_float,
    )
    max_connections: int = setting(
        SERVER,
        "open connections beyond which requests get HTTP 503 (default 256)",
        "256",
        env="HYBRIDLM_MAX_CONNECTIONS",
        type=values.positive_int,
    )

    @classmethod
    def of(cls, args: argparse.Namespace) -> Settings:
        """The settings a parsed command line holds; fields its command has no flag for keep their
        defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @classmethod
    def parse(cls, argv: Iterable[str]) -> Settings:
        """`hybridlm serve`'s flags `argv` (the environment filling what they leave out) as settings;
        a bad value exits as the command line does."""
        parser = Parser(prog="hybridlm serve")
        add_flags(parser, (MODEL, SERVER, ENGINE))
        return cls.of(parser.parse_args(list(argv)))


def declared() -> list[tuple[str, Flag]]:
    """(field name, flag) of every setting, in the order `--help` lists them."""
    return [(f.name, f.metadata["flag"]) for f in fields(Settings)]


def add_flags(parser: argparse.ArgumentParser, groups: Iterable[str]) -> None:
    """Add the flags of the settings in `groups` to `parser`, in declaration order. A flag's default
    is its environment variable when set: argparse parses a text default with the flag's `type`, so
    a bad value in the environment is reported like a bad flag."""
    groups = set(groups)
    for name, flag in declared():
        if flag.group not in groups:
            continue
        env_text = os.environ.get(flag.env) if flag.env else None
        help = flag.help
        if flag.env:
            help += f" [env {flag.env}=0]" if flag.switch else f" [env {flag.env}]"
        if flag.switch:
            default = flag.value(os.environ.get(flag.env, "1"))
            parser.add_argument(flag.option(name), action="store_true", default=default, help=help)
            continue
        how = {"type": flag.type, "choices": flag.choices and list(flag.choices), "metavar": flag.metavar}
        how = {k: v for k, v in how.items() if v is not None}
        default = env_text if env_text is not None else flag.default
        parser.add_argument(flag.option(name), default=default, help=help, **how)


def environment_epilog() -> str:
    """The `hybridlm serve --help` epilog: each environment variable and the flag it stands for."""
    lines = ["environment variables (a flag given on the command line wins):"]
    for name, flag in declared():
        if flag.env:
            meaning = f"set to 0 for {flag.option(name)}" if flag.switch else flag.option(name)
            lines.append(f"  {flag.env:<25} {meaning}")
    lines += [f"  {env:<25} {meaning}" for env, meaning in OTHER_ENVIRONMENT.items()]
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The settings table of docs/command-line.md (tests/test_settings.py checks the page holds it)."""
    rows = ["| flag | environment variable | default | what it sets |", "|---|---|---|---|"]
    for name, flag in declared():
        env = f"`{flag.env}{'=0' if flag.switch else ''}`" if flag.env else ""
        default = f"`{flag.default}`" if flag.default is not None else ""
        rows.append(f"| `{flag.option(name)}` | {env} | {default} | {flag.help} |")
    rows += [f"| | `{env}` | | {meaning} |" for env, meaning in OTHER_ENVIRONMENT.items()]
    return "\n".join(rows) + "\n"
