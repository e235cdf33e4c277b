"""`hybridlm bench grammar`: the per-token cost of grammar-constrained decoding beside a decode step.

The random presets carry no tokenizer, so the benchmark builds a byte-level BPE vocabulary of the
preset's size (248320 ids for qwen3.5-0.8b): the 256 byte tokens and the commonest words, numbers and
punctuation runs of the Python standard library's sources, the way a real BPE vocabulary is made of
the commonest pieces of its corpus. The mask's cost depends on the vocabulary's size and the shape of
its token trie, not on the merges. A matcher is walked along a valid document (a nested JSON schema,
and a forced Hermes tool call), each step timing the mask (computing the allowed ids and masking
[1, V] float32 logits) as the engine does it; the decode step of the preset model is timed as
`bench forward` does (or given by --decode-ms). With xgrammar installed, it is measured the same way
for comparison (the figures behind choosing llguidance).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sysconfig
import time
from collections import Counter
from pathlib import Path

import numpy as np
import tokenizers
import torch

from hybridlm.engine.grammar import Grammar, GrammarCompiler
from hybridlm.models.tokenizer import Tokenizer

EOS = "<|endoftext|>"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city", "zip"],
        },
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "tags", "address"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "analytical engine", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "scores": [0.5, 12.25, 99],
}


def _byte_level(data: bytes) -> str:
    """`data` in the byte-level BPE alphabet (GPT-2's printable stand-ins for bytes)."""
    table = _alphabet()
    return "".join(table[b] for b in data)


@functools.cache
def _alphabet() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def synthetic_tokenizer(vocab: int) -> tuple[Tokenizer, list[bytes]]:
    """A byte-level BPE tokenizer of `vocab` ids (the last one EOS) from the stdlib's sources, and
    each id's bytes; written once under the user cache directory (building it reads the sources)."""
    base = Path(os.environ.get("HYBRIDLM_CACHE_DIR") or Path.home() / ".cache" / "hybridlm")
    path = base / "grammar-bench" / f"vocab-{vocab}.json"
    if not path.exists():
        print(f"building a {vocab}-id byte-level vocabulary into {path} ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps([t.hex() for t in _vocabulary(vocab)]))
        tmp.rename(path)
    tokens = [bytes.fromhex(t) for t in json.loads(path.read_text())]
    model = tokenizers.models.BPE({_byte_level(t): i for i, t in enumerate(tokens)}, [])
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens([EOS])
    return Tokenizer(backend, special_tokens={"eos_token": EOS}), [*tokens, EOS.encode()]


def _vocabulary(vocab: int) -> list[bytes]:
    """The 256 bytes, then the commonest pieces of the stdlib's sources (vocab - 1 in all)."""
    counts: Counter[bytes] = Counter()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pieces = re.compile(rb" ?[A-Za-z_]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]{1,3}|\s+")
    for path in sorted(stdlib.rglob("*.py")):
        with contextlib.suppress(OSError):
            counts.update(pieces.findall(path.read_bytes()))
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for w, _ in counts.most_common():
        if len(tokens) >= vocab - 1:
            break
        if w not in seen:
            seen.add(w)
            tokens.append(w)
    while len(tokens) < vocab - 1:  # a small corpus: pad with distinct rare byte strings
        tokens.append(b"\x00" + len(tokens).to_bytes(4, "little"))
    return tokens


def _walk(compiler: GrammarCompiler, grammar: Grammar, pieces: list[bytes], text: str, rounds: int):
    """Walk a matcher along `text` then EOS, each step taking the longest allowed vocabulary entry
    that continues the text (as a model writing it would; llguidance allows only the tokenizer's
    canonical split of forced text). Returns the ids and per-step seconds of (allowed-id
    computation, whole mask)."""
    data, eos, vocab = text.encode(), len(pieces) - 1, len(pieces)
    index = {piece: i for i, piece in enumerate(pieces[:-1])}
    logits = torch.randn(1, vocab)
    compute, whole = [], []
    for _ in range(rounds):
        matcher, at, ids = compiler.matcher(grammar), 0, []
        while True:
            t0 = time.perf_counter()
            allowed = matcher.allowed()
            t1 = time.perf_counter()
            matcher.mask(logits)
            t2 = time.perf_counter()
            compute.append(t1 - t0)
            whole.append(t2 - t1)
            if at == len(data):
                if not allowed[eos]:
                    raise AssertionError("the grammar does not allow the end of a valid document")
                break
            options = (index.get(data[at : at + n]) for n in range(min(16, len(data) - at), 0, -1))
            token = next((t for t in options if t is not None and allowed[t]), None)
            if token is None:
                raise AssertionError(f"the grammar forbids the valid document at byte {at}")
            matcher.advance(token)
            ids.append(token)
            at += len(pieces[token])
    return ids, compute, whole


def _xgrammar(pieces: list[bytes], schema: dict, ids: list[int], eos: int, rounds: int):
    """The same walk with xgrammar (fill the bitmask, apply it), when it is installed."""
    try:
        import xgrammar
    except ImportError:
        return None
    vocab = len(pieces)
    info = xgrammar.TokenizerInfo(pieces, xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=[eos])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
    )
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    logits = torch.randn(1, vocab)
    whole = []
    for _ in range(rounds):
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in [*ids, eos]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            masked = logits.clone()
            xgrammar.apply_token_bitmask_inplace(masked, bitmask)
            whole.append(time.perf_counter() - t0)
            if token != eos:
                matcher.accept_token(token)
    return whole


def _stats(seconds: list[float]) -> dict[str, float]:
    ms = np.array(seconds) * 1e3
    return {
        "mean_ms": float(ms.mean()),
        "p50_ms": float(np.median(ms)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def main(args) -> int:
    from hybridlm.bench.forward import load_bench_model, time_decode
    from hybridlm.presets import PRESETS

    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = PRESETS[args.preset]["vocab_size"]
    tok, pieces = synthetic_tokenizer(vocab)
    eos = tok.token_to_id(EOS)
    compiler = GrammarCompiler(tok, vocab)
    t0 = time.perf_counter()
    compiler.check(Grammar.json_schema({"type": "object"}))
    setup_s = time.perf_counter() - t0
    document = json.dumps(DOCUMENT, ensure_ascii=False)
    tool_call = (
        "<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
        + "\n</tool_call>"
    )
    from hybridlm.server.chat import marker_ids
    from hybridlm.server.tools import FORMATS

    hermes = FORMATS["hermes"]

    functions = {
        "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    }
    cases = {
        "json_schema": (Grammar.json_schema(SCHEMA), document),
        "forced_tool_call": (
            Grammar("lark", hermes.grammar(functions, False, marker_ids(tok, hermes.markers()))),
            tool_call,
        ),
    }
    report: dict = {
        "vocab": vocab,
        "threads": torch.get_num_threads(),
        "tokenizer_setup_s": setup_s,
        "cases": {},
    }
    for name, (grammar, text) in cases.items():
        ids, compute, whole = _walk(compiler, grammar, pieces, text, args.rounds)
        report["cases"][name] = {"tokens": len(ids) + 1, "allowed": _stats(compute), "mask": _stats(whole)}
        if name == "json_schema":
            xgr = _xgrammar(pieces, SCHEMA, ids, eos, args.rounds)
            if xgr is not None:
                report["xgrammar_json_schema_mask"] = _stats(xgr)
    if args.decode_ms is not None:
        step_ms = args.decode_ms
    else:
        args.model, args.device, args.quantize = None, None, None  # the preset as published (bf16)
        model, _, _ = load_bench_model(args)
        print("timing decode steps ...", flush=True)
        step_ms = time_decode(model, 16) * 1e3
    report["decode_step_ms"] = step_ms

    print(f"\nvocabulary {vocab} ids, {report['threads']} threads, decode step {step_ms:.1f} ms")
    print("per token: allowed = computing the allowed ids; mask = that plus masking [1, V] logits")
    header = (
        f"{'grammar':<22}{'tokens':>7}{'allowed p50':>13}{'mask p50':>10}{'mask mean':>11}{'mask p99':>10}"
    )
    print(header + f"{'p50 of step':>13}")
    for name, r in report["cases"].items():
        a, m = r["allowed"], r["mask"]
        print(
            f"{name:<22}{r['tokens']:>7}{a['p50_ms']:>11.3f}ms{m['p50_ms']:>8.3f}ms{m['mean_ms']:>9.3f}ms"
            f"{m['p99_ms']:>8.3f}ms{m['p50_ms'] / step_ms:>13.2%}"
        )
    if "xgrammar_json_schema_mask" in report:
        x = report["xgrammar_json_schema_mask"]
        print(
            f"{'xgrammar json_schema':<22}{'':>7}{'':>13}{x['p50_ms']:>8.3f}ms{x['mean_ms']:>9.3f}ms"
            f"{x['p99_ms']:>8.3f}ms{x['p50_ms'] / step_ms:>13.2%}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
