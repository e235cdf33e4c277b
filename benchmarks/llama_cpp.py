"""llama.cpp and hybridlm side by side on the same random weights: single-stream speed and serving.

    python benchmarks/llama_cpp.py forward --llama-cpp SRC --llama-bin BIN
        [--preset NAME | --model DIR] [--weights bf16 int8 int4] [--rounds 2] [--threads 2]
        [--prompt 512] [--gen 64] [--busy-core] [--work DIR] [--json FILE]
    python benchmarks/llama_cpp.py serve --llama-cpp SRC --llama-bin BIN [...] [--weights bf16]
        [--clients 8] [--prompt 512] [--gen 128] [--rounds 2] [--also-no-prefix-cache] [--json FILE]
    python benchmarks/llama_cpp.py agent --llama-cpp SRC --llama-bin BIN [...] [--weights bf16]
        [--agents 2] [--requests 8] [--preamble 3000] [--gen 48] [--rounds 1] [--json FILE]

SRC is a llama.cpp source tree (its ``convert_hf_to_gguf.py`` and ``gguf-py/``), BIN the folder of its
built ``llama-bench``, ``llama-quantize`` and ``llama-server``.

The checkpoint (hybridlm's random one of the preset's shape, or ``--model DIR``) is converted once per
weights kind and cached in ``--work`` (default ``~/.cache/hybridlm/llama_cpp/<model name>/``): a bf16
GGUF by llama.cpp's converter, then ``llama-quantize`` to Q8_0 (against hybridlm's int8) and Q4_K_M
(against int4: the llama.cpp and ollama default). A preset ships no tokenizer, which the converter
needs: the script writes one, hybridlm's demo byte-level BPE (4096 ids) whose EOS is the config's
``eos_token_id`` (``<|endoftext|>`` moved there when that id is past the demo's); the converter pads the
ids it lacks up to ``vocab_size``. Both sides are fed token ids, so the tokenizer only has to load. The
converter runs in this process with ``transformers`` (hybridlm's ``test`` extra) and the tree's
``gguf-py``, reading config.json as written (not through the installed transformers' AutoConfig, whose
defaults can change what it converts to: see `convert`). Presets need no ``architectures`` in their
config: ``ARCHITECTURES`` names the converter's class for each family it converts.

``forward``: each round measures, per weights kind in turn (so both engines see the same minute of
the machine), ``llama-bench -p PROMPT -n GEN`` (prompt and generation tok/s) and ``hybridlm bench
forward --prefill PROMPT --decode 32`` (fresh prefill and decode-step tok/s), each after noting the
1-minute load average. Prints the median and every round, hybridlm ÷ llama.cpp, and the targets:
With ``--busy-core``, each round also measures both engines' decode while ``yes`` runs pinned to
core 0 (a desktop's browser, a build), and prints each engine's busy decode as a share of its quiet
one: target ≥ 40 % and ≥ llama.cpp's share. Targets of the quiet runs:
prefill ≥ 1.5× at every weights kind, decode ≥ 1.2× (bf16), ≥ 1.25× Q8_0 (int8) and ≥ 1.5× Q4_K_M
(int4).

``serve``: each round starts ``llama-server`` with CLIENTS slots and streams CLIENTS concurrent greedy
requests of distinct random PROMPT-token prompts (no prompt cache, ignoring EOS) from its
``/completion``, then runs ``hybridlm bench concurrency`` with the same shape (and, with
``--also-no-prefix-cache``, again without its prefix cache). Aggregate tok/s = all generated tokens ÷
wall time; TTFT and time per output token p50/p95 over requests. Target: hybridlm ≥ 1.3× llama-server
at 8 clients.

``agent``: a coding-agent session as token ids (`hybridlm.bench.agents`: AGENTS agents at once sharing
a PREAMBLE-token system prompt and tool definitions, REQUESTS requests each with growing tool
results, one compaction), replayed through ``llama-server -np AGENTS`` (its default prompt cache and
context checkpoints, ``/completion`` with ``cache_prompt``) and through ``hybridlm bench multiturn
--trace agents`` (the engine in process). Each engine answers greedily, GEN tokens a request, and its
own answers join the histories. Reports wall time and prompt tokens prefilled (llama-server's
``timings.prompt_n``) beside the oracle's fewest. Target: hybridlm's wall ≤ 0.5× llama-server's.

Building llama.cpp (the version measured: the one vendored by PyPI's llama-cpp-python 0.3.36)::

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF      # Release by default
    cmake --build build -j --target llama-bench llama-quantize llama-server
    # SRC = .../vendor/llama.cpp, BIN = .../vendor/llama.cpp/build/bin

On a CPU with AMX and GCC 12, add ``-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"`` and the
same ``-DCMAKE_CXX_FLAGS``: llama.cpp's AMX path built by that compiler crashes on quantized types.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib
import json
import logging
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from importlib import resources
from pathlib import Path

# weights kind -> (GGUF file, llama-quantize type or None for the converter's bf16, label)
GGUFS = {
    "bf16": ("bf16.gguf", None, "BF16"),
    "int8": ("q8_0.gguf", "Q8_0", "Q8_0"),
    "int4": ("q4_k_m.gguf", "Q4_K_M", "Q4_K_M"),
}
# the targets, hybridlm ÷ llama.cpp
FORWARD_TARGETS = {
    ("bf16", "prefill"): 1.5,
    ("int8", "prefill"): 1.5,
    ("int4", "prefill"): 1.5,
    ("bf16", "decode"): 1.2,
    ("int8", "decode"): 1.25,
    ("int4", "decode"): 1.5,
}
SERVE_TARGET, SERVE_TARGET_CLIENTS = 1.3, 8
AGENT_TARGET = 0.5  # hybridlm's wall ÷ llama-server's, at most
HYBRIDLM_DECODE_STEPS = 32
# `architectures` for configs written without one (hybridlm's presets): the class names llama.cpp's
# converter registers (`@ModelBase.register`) for each model_type hybridlm loads that it converts
ARCHITECTURES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "bamba": "BambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "bailing_hybrid": "BailingMoeV3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def fail(message: str) -> SystemExit:
    return SystemExit(f"llama_cpp.py: {message}")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(what: str):
    """Report a slow step and how long it took on stderr."""
    progress(f"{what} ...")
    start = time.perf_counter()
    yield
    progress(f"{what}: {time.perf_counter() - start:.0f} s")


def load_average() -> float:
    return os.getloadavg()[0]


# --- pure helpers ------------------------------------------------------------------------------------


def parse_llama_bench(text: str) -> dict:
    """`llama-bench -o json` output -> prompt and generation tok/s (the prompt test has n_gen 0, the
    generation test n_prompt 0) and the build it reports."""
    tests = json.loads(text)
    prompt = next((t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0), None)
    gen = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
    return {
        "prefill_tok_s": prompt["avg_ts"] if prompt else None,
        "decode_tok_s": gen["avg_ts"],
        "build": gen.get("build_commit"),
        "model_type": gen.get("model_type"),
    }


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation, as `hybridlm bench concurrency` computes its own."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarise_streams(streams: list[dict], wall: float) -> dict:
    """Aggregate tok/s, TTFT and time per output token (p50/p95 over requests, in ms) of one round;
    each stream has `start`, `arrivals` (time of each generated token) and `tokens`."""
    ttft = [(s["arrivals"][0] - s["start"]) * 1e3 for s in streams]
    tpot = [
        (s["arrivals"][-1] - s["arrivals"][0]) / (len(s["arrivals"]) - 1) * 1e3
        for s in streams
        if len(s["arrivals"]) > 1
    ]
    return {
        "clients": len(streams),
        "generated_tokens": sum(s["tokens"] for s in streams),
        "wall_s": wall,
        "aggregate_tok_s": sum(s["tokens"] for s in streams) / wall,
        "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p95": percentile(ttft, 0.95),
        "tpot_ms_p50": percentile(tpot, 0.5) if tpot else 0.0,
        "tpot_ms_p95": percentile(tpot, 0.95) if tpot else 0.0,
    }


def verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return "-"
    return f"≥{target:g}x {'met' if ratio >= target else 'NOT met'}"


def rounds_text(values: list[float]) -> str:
    """'median (round 1, round 2, ...)'."""
    return f"{statistics.median(values):7.1f} ({' '.join(f'{v:.1f}' for v in values)})"


def forward_table(summary: dict) -> str:
    """One row per weights kind and phase: both engines' tok/s, the ratio and the target."""
    rows = [
        f"{'weights':<16}{'phase':<9}{'llama.cpp tok/s (rounds)':<30}{'hybridlm tok/s (rounds)':<30}"
        f"{'ratio':>7}  target"
    ]
    for kind, phases in summary.items():
        for phase, s in phases.items():
            rows.append(
                f"{kind + ' / ' + GGUFS[kind][2]:<16}{phase:<9}{rounds_text(s['llama_cpp']):<30}"
                f"{rounds_text(s['hybridlm']):<30}{s['ratio']:>6.2f}x  {verdict(s['ratio'], s['target'])}"
            )
    return "\n".join(rows)


def serve_table(summary: dict) -> str:
    """One row per server and weights kind: medians over rounds (aggregate tok/s with every round),
    the ratio to llama-server and the target where one applies."""
    rows = [
        f"{'server':<34}{'agg tok/s (rounds)':<28}{'TTFT p50/p95 ms':>17}{'TPOT p50/p95 ms':>17}"
        f"{'ratio':>8}  target"
    ]
    for kind, sides in summary.items():
        for side, s in sides.items():
            ratio = f"{s['ratio']:>7.2f}x  {verdict(s['ratio'], s.get('target'))}" if "ratio" in s else ""
            rows.append(
                f"{side + ' ' + kind:<34}{rounds_text(s['aggregate_tok_s']):<28}"
                f"{s['ttft_ms_p50']:>8.0f}/{s['ttft_ms_p95']:<8.0f}"
                f"{s['tpot_ms_p50']:>8.1f}/{s['tpot_ms_p95']:<8.1f}{ratio}"
            )
    return "\n".join(rows)


def write_report(args, command: str, rounds: list, summary: dict) -> None:
    """With --json, every measurement and the summary to that file."""
    if args.json:
        report = {"command": command, "settings": vars(args), "rounds": rounds, "summary": summary}
        Path(args.json).write_text(json.dumps(report, indent=2))


# --- the model and its GGUFs ---------------------------------------------------------------------------


def model_source(args) -> tuple[str, Path]:
    """(name, checkpoint directory) of --preset or --model."""
    if args.model:
        path = Path(args.model).resolve()
        if not (path / "config.json").is_file():
            raise fail(f"--model {args.model}: no config.json there")
        return path.name, path
    from hybridlm.bench.forward import preset_dir  # imports torch: writes the checkpoint on first use

    return args.preset, preset_dir(args.preset)


def synthetic_tokenizer(config: dict) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) for a checkpoint that ships none: hybridlm's demo BPE,
    with the GGUF's EOS the id the model was given. An eos_token_id past the demo's ids (Qwen's
    248044) takes <|endoftext|>, named the EOS token; one among them (Nemotron-H's 2, a byte token)
    is left where it is and no EOS token named, so the converter reads the id from config.json."""
    tokenizer = json.loads(resources.files("hybridlm.demo").joinpath("tokenizer.json").read_text())
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    taken = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    if isinstance(eos, int) and eos not in taken and eos < config["vocab_size"]:
        for token in tokenizer["added_tokens"]:
            if token["content"] == "<|endoftext|>":
                token["id"] = eos
    end = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|endoftext|>")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if not isinstance(eos, int) or end == eos:
        tokenizer_config["eos_token"] = "<|endoftext|>"
    return tokenizer, tokenizer_config


def stage_checkpoint(source: Path, hf: Path) -> bool:
    """Lay out `source` as the converter wants it in `hf`: its files linked, config.json with
    `architectures` and `torch_dtype`, a tokenizer. True when the tokenizer is the synthetic one."""
    shutil.rmtree(hf, ignore_errors=True)
    hf.mkdir(parents=True)
    for f in source.iterdir():
        if f.name != "config.json":
            (hf / f.name).symlink_to(f.resolve())
    config = json.loads((source / "config.json").read_text())
    if "architectures" not in config:
        if config.get("model_type") not in ARCHITECTURES:
            raise fail(f"{source}/config.json names no architectures (model_type {config.get('model_type')})")
        config["architectures"] = [ARCHITECTURES[config["model_type"]]]
    config.setdefault("torch_dtype", "bfloat16")
    (hf / "config.json").write_text(json.dumps(config, indent=1))
    if (source / "tokenizer.json").exists() or (source / "tokenizer.model").exists():
        return False
    tokenizer, tokenizer_config = synthetic_tokenizer(config)
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer))
    (hf / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return True


class ConfigJsonOnly:
    """Stands in for transformers' AutoConfig in the converter (see `convert`)."""

    message = "config.json as written, not AutoConfig"

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise ValueError(ConfigJsonOnly.message)

    @staticmethod
    def filter(record: logging.LogRecord) -> bool:
        """Drop the converter's two warnings about that fallback, which is ours."""
        text = record.getMessage()
        return ConfigJsonOnly.message not in text and "Trying to load config.json instead" not in text


def convert(tree: Path, hf: Path, out: Path, synthetic: bool) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py on `hf` in this process, writing a bf16 GGUF to `out`.

    In process so that, for the synthetic tokenizer, `TextModel.get_vocab_base_pre` can answer
    "qwen2" (the demo tokenizer's Qwen-style pre-tokenizer): it identifies pre-tokenizers by hashing
    a test string's token ids and refuses unknown ones (ours is one). TextModel lives in
    conversion/base.py in recent trees and in convert_hf_to_gguf.py itself in older ones.

    And so that the converter reads config.json as written: it tries transformers' AutoConfig first,
    whose dict carries every field the installed transformers defines, defaults included, and the
    installed one (hybridlm's, 5.x) is newer than the converter's pin (4.57 for the tree measured).
    Its NemotronHConfig, for one, has MoE defaults (`num_experts_per_tok` ...), which turn a dense
    Nemotron-H into `nemotron_h_moe`: a GGUF that llama.cpp then fails to load. Without AutoConfig
    the converter takes its own fallback, config.json itself."""
    script = tree / "convert_hf_to_gguf.py"
    # hybridlm loads no multi-token-prediction head, and recent converters assert that a Qwen3.5 checkpoint
    # without `mtp_num_hidden_layers` in its config (ours) has one unless told --no-mtp; the converters
    # of families without MTP refuse the flag.
    qwen3_5 = json.loads((hf / "config.json").read_text()).get("model_type", "").startswith("qwen3_5")
    no_mtp = ["--no-mtp"] if qwen3_5 and '"--no-mtp"' in script.read_text() else []
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    argv = sys.argv
    sys.argv = [str(script), "--outtype", "bf16", *no_mtp, "--outfile", str(out), str(hf)]
    # The converter's logging.basicConfig(level=INFO) is then a no-op: a line per tensor is noise here.
    logging.basicConfig(level=logging.WARNING)
    try:
        converter = importlib.import_module("convert_hf_to_gguf")
        converter.ModelBase.load_hparams.__globals__["AutoConfig"] = ConfigJsonOnly
        logging.getLogger("hf-to-gguf").addFilter(ConfigJsonOnly.filter)
        if synthetic:
            text_model = (
                getattr(converter, "TextModel", None) or importlib.import_module("conversion").TextModel
            )
            text_model.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
        converter.main()
    except SystemExit as e:
        if e.code:
            raise fail(f"llama.cpp's converter failed on {hf} (exit {e.code}; see its log above)") from None
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]  # a bare assert says nothing by itself
        raise fail(
            f"llama.cpp's converter failed: {type(e).__name__} at {where.filename}:{where.lineno}: {e}"
        ) from e
    finally:
        sys.argv = argv


def run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` capturing its output; a failure exits with the tail of its stderr."""
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise fail(f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n{tail}")
    return done


def checkpoint_identity(source: Path) -> dict:
    """What tells one checkpoint from another under the same name: its config and the size and
    modification time of each weights file."""
    files = sorted(source.glob("*.safetensors"))
    return {
        "config": json.loads((source / "config.json").read_text()),
        "weights": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files},
    }


def prepare_ggufs(args, name: str, source: Path, kinds: list[str]) -> dict[str, Path]:
    """The GGUF of every weights kind in `kinds` of checkpoint `source`, converting and quantizing what
    --work lacks. Each step writes to a temporary name and renames when done, so an interrupted one
    is redone."""
    work = Path(
        args.work
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridlm" / "llama_cpp" / name
    )
    work.mkdir(parents=True, exist_ok=True)
    # GGUFs of an earlier checkpoint under this name (a preset edited or rewritten) are stale
    identity = json.dumps(checkpoint_identity(source), sort_keys=True)
    if (work / "source.json").exists() and (work / "source.json").read_text() != identity:
        progress(f"{source} changed since its GGUFs in {work} were made: converting again")
        for path, _, _ in GGUFS.values():
            (work / path).unlink(missing_ok=True)
    (work / "source.json").write_text(identity)
    bf16 = work / GGUFS["bf16"][0]
    if not bf16.exists():
        with step(f"converting {source} to a bf16 GGUF ({bf16})"):
            synthetic = stage_checkpoint(source, work / "hf")
            part = work / "bf16.part.gguf"
            convert(Path(args.llama_cpp), work / "hf", part, synthetic)
            part.rename(bf16)
    ggufs = {}
    for kind in kinds:
        path, qtype, _ = GGUFS[kind]
        ggufs[kind] = work / path
        if qtype and not ggufs[kind].exists():
            with step(f"llama-quantize to {qtype} ({ggufs[kind]})"):
                part = work / f"{kind}.part.gguf"
                quantize = str(Path(args.llama_bin) / "llama-quantize")
                run([quantize, str(bf16), str(part), qtype, str(args.threads)], f"llama-quantize to {qtype}")
                part.rename(ggufs[kind])
    return ggufs


def hybridlm_cmd(args, what: str, kind: str, json_file: Path) -> list[str]:
    """`hybridlm bench WHAT` on the same checkpoint and weights kind, through this interpreter."""
    cmd = [sys.executable, "-m", "hybridlm.cli", "bench", what, "--threads", str(args.threads)]
    cmd += ["--json", str(json_file)]
    cmd += ["--model", args.model] if args.model else ["--preset", args.preset]
    return cmd + (["--quantize", kind] if kind != "bf16" else [])


# --- forward ---------------------------------------------------------------------------------------------


def llama_bench(args, gguf: Path, prompt: int) -> dict:
    cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", str(gguf)]
    cmd += f"-p {prompt} -n {args.gen} -t {args.threads} -r 1 -o json".split()
    return parse_llama_bench(run(cmd, "llama-bench").stdout)


def hybridlm_forward(args, kind: str, json_file: Path, prompt: int) -> dict:
    """hybridlm bench forward; `prompt` 16 when only decode matters (a busy-core round)."""
    cmd = hybridlm_cmd(args, "forward", kind, json_file)
    cmd += f"--prefill {prompt} --decode {HYBRIDLM_DECODE_STEPS}".split()
    run(cmd, "hybridlm bench forward")
    report = json.loads(json_file.read_text())
    return {
        "prefill_tok_s": report["prefill"][str(prompt)]["tok_s"],
        "decode_tok_s": report["decode"]["tok_s"],
    }


@contextlib.contextmanager
def busy_core():
    """`yes` pinned to core 0 for the duration: another program taking one core."""
    hog = subprocess.Popen(["taskset", "-c", "0", "yes"], stdout=subprocess.DEVNULL)
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def cmd_forward(args) -> int:
    ggufs = prepare_ggufs(args, *model_source(args), args.weights)
    rounds = []
    for r in range(1, args.rounds + 1):
        for kind in args.weights:
            load = load_average()
            with step(f"round {r}: llama-bench {GGUFS[kind][2]} (load {load:.2f})"):
                llama = llama_bench(args, ggufs[kind], args.prompt) | {"load": load}
            load, json_file = load_average(), ggufs[kind].with_name(f"{kind}.forward.json")
            with step(f"round {r}: hybridlm bench forward {kind} (load {load:.2f})"):
                ours = hybridlm_forward(args, kind, json_file, args.prompt) | {"load": load}
            row = {"round": r, "weights": kind, "llama_cpp": llama, "hybridlm": ours}
            if args.busy_core:
                with busy_core(), step(f"round {r}: llama-bench {GGUFS[kind][2]}, core 0 busy"):
                    row["llama_cpp"]["busy_decode_tok_s"] = llama_bench(args, ggufs[kind], 0)["decode_tok_s"]
                with busy_core(), step(f"round {r}: hybridlm bench forward {kind}, core 0 busy"):
                    busy = hybridlm_forward(args, kind, json_file, 16)["decode_tok_s"]
                    row["hybridlm"]["busy_decode_tok_s"] = busy
            rounds.append(row)
    summary: dict = {}
    for kind in args.weights:
        mine = [x for x in rounds if x["weights"] == kind]
        summary[kind] = {}
        for phase in ("prefill", "decode"):
            llama = [x["llama_cpp"][f"{phase}_tok_s"] for x in mine]
            ours = [x["hybridlm"][f"{phase}_tok_s"] for x in mine]
            summary[kind][phase] = {
                "llama_cpp": llama,
                "hybridlm": ours,
                "ratio": statistics.median(ours) / statistics.median(llama),
                "target": FORWARD_TARGETS.get((kind, phase)),
            }
    loads = [x[side]["load"] for x in rounds for side in ("llama_cpp", "hybridlm")]
    print(
        f"\nprefill {args.prompt} tokens, decode (llama.cpp: {args.gen} tokens from empty; hybridlm: median "
        f"step after 128), {args.threads} threads; median of {args.rounds} round(s), each round in brackets; "
        f"load average {min(loads):.2f}..{max(loads):.2f}; llama.cpp build {rounds[0]['llama_cpp']['build']}"
    )
    print(forward_table(summary))
    if args.busy_core:
        print("\ndecode with core 0 busy (`taskset -c 0 yes`) as a share of quiet decode")
        print("(target: ≥ 40 % and ≥ llama.cpp's share)")
        for kind in args.weights:
            mine = [x for x in rounds if x["weights"] == kind]
            shares = {}
            for side in ("llama_cpp", "hybridlm"):
                busy = statistics.median(x[side]["busy_decode_tok_s"] for x in mine)
                quiet = statistics.median(x[side]["decode_tok_s"] for x in mine)
                shares[side] = busy / quiet
                summary[kind]["decode"][f"{side}_busy_share"] = shares[side]
                print(f"{kind + ' ' + side:<20}{busy:8.2f} busy, {quiet:8.2f} quiet {shares[side]:4.0%}")
            met = shares["hybridlm"] >= max(0.4, shares["llama_cpp"])
            print(f"{kind:<20}hybridlm's share {'meets' if met else 'does NOT meet'} the target")
    write_report(args, "forward", rounds, summary)
    return 0


# --- serve -----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])


def wait_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float = 300) -> None:
    """Poll /health until the model is loaded (503 while loading)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise fail(f"llama-server exited with {server.returncode} while starting:\n{log_tail(log)}")
        with contextlib.suppress(OSError):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        time.sleep(0.5)
    raise fail(f"llama-server not ready after {timeout:.0f} s:\n{log_tail(log)}")


def stream_completion(port: int, body: dict) -> dict:
    """One streaming /completion request: its start and the arrival time of every generated token."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    start, arrivals = time.perf_counter(), []
    c.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    response = c.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    predicted = None
    while line := response.readline():
        if not line.startswith(b"data: "):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("stop"):
            predicted = chunk.get("tokens_predicted")
            break
        # one chunk per token, even with empty text (most ids of the synthetic vocabulary are padding)
        arrivals.append(time.perf_counter())
    c.close()
    return {
        "start": start,
        "arrivals": arrivals,
        "tokens": predicted if predicted is not None else len(arrivals),
    }


def llama_server_round(args, gguf: Path, seed: int, vocab: int, log: Path) -> dict:
    """Start llama-server, stream --clients concurrent requests, stop it; the round's summary."""
    context = args.clients * (args.prompt + args.gen + 64)  # every slot holds its prompt and tokens
    server, port = start_llama_server(args, gguf, args.clients, context, log)
    try:

        def body(rng: random.Random, prompt: int, gen: int) -> dict:
            # greedy, every token generated, nothing reused: as hybridlm's cold rounds
            return {
                "prompt": [rng.randrange(vocab) for _ in range(prompt)],
                "n_predict": gen,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
                "samplers": ["top_k"],
                "top_k": 1,
                "cache_prompt": False,
            }

        # One short request first: hybridlm's side warms up too, and the first request pays page faults.
        stream_completion(port, body(random.Random(-1), 16, 4))
        results: list = [None] * args.clients

        def client(i: int) -> None:
            try:
                results[i] = stream_completion(
                    port, body(random.Random(seed * 1000 + i), args.prompt, args.gen)
                )
            except Exception as e:  # reported below, never hidden
                results[i] = e

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        errors = [str(r) for r in results if isinstance(r, Exception)]
        if errors:
            raise fail(f"llama-server request failed: {errors[0]}\n{log_tail(log)}")
        return summarise_streams(results, wall)
    finally:
        stop_server(server)


def hybridlm_concurrency(args, kind: str, seed: int, json_file: Path, prefix_cache: bool) -> dict:
    cmd = hybridlm_cmd(args, "concurrency", kind, json_file)
    cmd += f"--clients {args.clients} --prompt-tokens {args.prompt} --max-tokens {args.gen}".split()
    cmd += ["--seed", str(seed)] + ([] if prefix_cache else ["--no-prefix-cache"])
    run(cmd, "hybridlm bench concurrency")
    row = json.loads(json_file.read_text())["rounds"][0]
    keys = "clients generated_tokens wall_s aggregate_tok_s ttft_ms_p50 ttft_ms_p95 tpot_ms_p50 tpot_ms_p95"
    return {k: row[k] for k in keys.split()}


def cmd_serve(args) -> int:
    name, source = model_source(args)
    ggufs = prepare_ggufs(args, name, source, args.weights)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    sides = ["llama-server", "hybridlm"] + (["hybridlm no prefix cache"] if args.also_no_prefix_cache else [])
    rounds = []
    for r in range(1, args.rounds + 1):
        for kind in args.weights:
            row: dict = {"round": r, "weights": kind}
            for side in sides:
                load = load_average()
                out = ggufs[kind].with_name(f"{kind}.{side.replace(' ', '-')}.json")
                with step(f"round {r}: {side} {kind}, {args.clients} clients (load {load:.2f})"):
                    if side == "llama-server":
                        log = ggufs[kind].with_name(f"{kind}.llama-server.log")
                        result = llama_server_round(args, ggufs[kind], r, vocab, log)
                    else:
                        result = hybridlm_concurrency(args, kind, r, out, prefix_cache=side == "hybridlm")
                row[side] = result | {"load": load}
            rounds.append(row)
    summary: dict = {}
    for kind in args.weights:
        mine = [x for x in rounds if x["weights"] == kind]
        summary[kind] = {}
        for side in sides:
            s = {"aggregate_tok_s": [x[side]["aggregate_tok_s"] for x in mine]}
            for key in ("ttft_ms_p50", "ttft_ms_p95", "tpot_ms_p50", "tpot_ms_p95"):
                s[key] = statistics.median(x[side][key] for x in mine)
            summary[kind][side] = s
        llama = statistics.median(summary[kind]["llama-server"]["aggregate_tok_s"])
        for side in sides[1:]:
            s = summary[kind][side]
            s["ratio"] = statistics.median(s["aggregate_tok_s"]) / llama
            if args.clients == SERVE_TARGET_CLIENTS:
                s["target"] = SERVE_TARGET
    loads = [x[side]["load"] for x in rounds for side in sides]
    print(
        f"\n{args.clients} clients, {args.prompt}-token prompts, {args.gen} tokens each, "
        f"{args.threads} threads; median of {args.rounds} round(s), each round in brackets; "
        f"load average {min(loads):.2f}..{max(loads):.2f}"
    )
    if args.clients != SERVE_TARGET_CLIENTS:
        print(f"(the target, ≥{SERVE_TARGET:g}x, is for {SERVE_TARGET_CLIENTS} clients)")
    print(serve_table(summary))
    write_report(args, "serve", rounds, summary)
    return 0


# --- agent -----------------------------------------------------------------------------------------------


def start_llama_server(args, gguf: Path, slots: int, context: int, log: Path) -> tuple[subprocess.Popen, int]:
    """llama-server on a free port with `slots` slots of `context` tokens in all, once healthy."""
    port = free_port()
    cmd = [str(Path(args.llama_bin) / "llama-server"), "-m", str(gguf)]
    cmd += f"-t {args.threads} -np {slots} -c {context} --host 127.0.0.1 --port {port}".split()
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(server, port, log)
    except BaseException:
        stop_server(server)
        raise
    return server, port


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()  # SIGTERM: llama-server shuts down cleanly
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def llama_completion(port: int, prompt: list[int], gen: int) -> tuple[list[int], int]:
    """One greedy /completion that may reuse the slot's cache: (generated ids, prompt tokens prefilled)."""
    body = {
        "prompt": prompt,
        "n_predict": gen,
        "ignore_eos": True,
        "temperature": 0,
        "samplers": ["top_k"],
        "top_k": 1,
        "cache_prompt": True,
        "return_tokens": True,
    }
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    c.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    response = c.getresponse()
    data = response.read()
    c.close()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:300]!r}")
    reply = json.loads(data)
    return reply["tokens"], reply["timings"]["prompt_n"]


def llama_agent_round(args, gguf: Path, session, context: int, log: Path) -> dict:
    """The session through a fresh llama-server with a slot per agent: the replay's summary."""
    from hybridlm.bench.agents import replay

    server, port = start_llama_server(args, gguf, args.agents, context, log)
    try:
        llama_completion(port, [1, 2, 3], 2)  # warm-up, as hybridlm's engine warms up
        return replay(session, lambda prompt: llama_completion(port, prompt, args.gen)).summary()
    finally:
        stop_server(server)


def cmd_agent(args) -> int:
    from hybridlm.bench.agents import agent_session

    name, source = model_source(args)
    ggufs = prepare_ggufs(args, name, source, args.weights)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    rounds = []
    for r in range(1, args.rounds + 1):
        session = agent_session(r, vocab, args.agents, args.requests, args.preamble)
        longest = max(
            len(session.preamble) + sum(len(s.tokens) + args.gen for s in steps) for steps in session.agents
        )
        for kind in args.weights:
            row: dict = {"round": r, "weights": kind}
            load = load_average()
            with step(f"round {r}: llama-server {kind}, {session.requests} requests (load {load:.2f})"):
                log = ggufs[kind].with_name(f"{kind}.llama-server-agent.log")
                context = args.agents * (longest + 64)
                llama = llama_agent_round(args, ggufs[kind], session, context, log)
                row["llama-server"] = llama | {"load": load}
            load, json_file = load_average(), ggufs[kind].with_name(f"{kind}.agent.json")
            with step(f"round {r}: hybridlm {kind}, {session.requests} requests (load {load:.2f})"):
                cmd = hybridlm_cmd(args, "multiturn", kind, json_file)
                cmd += ["--trace", "agents", "--seed", str(r), "--conversations", str(args.agents)]
                cmd += ["--turns", str(args.requests), "--system-tokens", str(args.preamble)]
                cmd += ["--gen", str(args.gen)]
                run(cmd, "hybridlm bench multiturn --trace agents")
                row["hybridlm"] = json.loads(json_file.read_text()) | {"load": load}
            rounds.append(row)
    summary: dict = {}
    for kind in args.weights:
        mine = [x for x in rounds if x["weights"] == kind]
        walls = {side: [x[side]["wall_s"] for x in mine] for side in ("llama-server", "hybridlm")}
        summary[kind] = {
            side: {
                "wall_s": walls[side],
                "prefilled_tokens": [x[side]["prefilled_tokens"] for x in mine],
                "oracle_min_prefilled_tokens": [x[side]["oracle_min_prefilled_tokens"] for x in mine],
                "prompt_tokens": [x[side]["prompt_tokens"] for x in mine],
            }
            for side in walls
        }
        llama = statistics.median(walls["llama-server"])
        summary[kind]["ratio"] = statistics.median(walls["hybridlm"]) / llama
    loads = [x[side]["load"] for x in rounds for side in ("llama-server", "hybridlm")]
    print(
        f"\n{args.agents} agents x {args.requests} requests, {args.preamble}-token shared preamble, "
        f"{args.gen} tokens generated per request, {args.threads} threads; median of {args.rounds} "
        f"round(s), each round in brackets; load average {min(loads):.2f}..{max(loads):.2f}"
    )
    print(f"{'server':<22}{'wall s (rounds)':<26}{'prefilled':>11}{'oracle min':>11}{'prompt':>9}  ratio")
    for kind, s in summary.items():
        for side in ("llama-server", "hybridlm"):
            x = s[side]
            ratio = f"{s['ratio']:.2f}x (target ≤{AGENT_TARGET:g}x: " if side == "hybridlm" else ""
            if ratio:
                ratio += "met)" if s["ratio"] <= AGENT_TARGET else "NOT met)"
            counts = "".join(
                f"{statistics.median(x[key]):>{width}.0f}"
                for key, width in (
                    ("prefilled_tokens", 11),
                    ("oracle_min_prefilled_tokens", 11),
                    ("prompt_tokens", 9),
                )
            )
            print(f"{side + ' ' + kind:<22}{rounds_text(x['wall_s']):<26}{counts}  {ratio}")
    write_report(args, "agent", rounds, summary)
    return 0


# --- command line ----------------------------------------------------------------------------------------


def check_llama(args, binaries: list[str]) -> None:
    """Fail early, with one line, on a missing tree or binary (before minutes of conversion)."""
    tree = Path(args.llama_cpp)
    if not (tree / "convert_hf_to_gguf.py").is_file() or not (tree / "gguf-py").is_dir():
        raise fail(f"--llama-cpp {tree}: not a llama.cpp source tree (no convert_hf_to_gguf.py and gguf-py/)")
    for name in binaries:
        path = Path(args.llama_bin) / name
        if not os.access(path, os.X_OK):
            raise fail(
                f"--llama-bin {args.llama_bin}: no executable {name} (build it: see this script's docstring)"
            )


def main() -> int:
    from hybridlm.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (
        ("forward", "llama-bench vs hybridlm bench forward"),
        ("serve", "llama-server vs hybridlm bench concurrency"),
        ("agent", "a two-agent coding session: llama-server vs hybridlm bench multiturn --trace agents"),
    ):
        s = sub.add_parser(name, help=helptext)
        s.add_argument(
            "--llama-cpp", required=True, metavar="SRC", help="llama.cpp source tree (the converter)"
        )
        s.add_argument(
            "--llama-bin", required=True, metavar="BIN", help="folder of llama.cpp's built binaries"
        )
        model = s.add_mutually_exclusive_group()
        model.add_argument(
            "--preset",
            choices=sorted(PRESETS),
            default="qwen3.5-0.8b",
            help="hybridlm's random checkpoint of this shape (default)",
        )
        model.add_argument("--model", metavar="DIR", help="a checkpoint directory instead")
        s.add_argument(
            "--weights",
            nargs="+",
            choices=list(GGUFS),
            default=list(GGUFS) if name == "forward" else ["bf16"],
            help="weights kinds: int8 = Q8_0, int4 = Q4_K_M (default: "
            + ("all)" if name == "forward" else "bf16)"),
        )
        s.add_argument(
            "--rounds",
            type=int,
            default=1 if name == "agent" else 2,
            help="rounds, interleaving the two engines (default %(default)s)",
        )
        s.add_argument("--threads", type=int, default=2, help="threads of both engines (default 2)")
        if name != "agent":
            s.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
        s.add_argument(
            "--gen",
            type=int,
            default={"forward": 64, "serve": 128, "agent": 48}[name],
            help="generated tokens (default %(default)s)",
        )
        s.add_argument(
            "--work",
            metavar="DIR",
            help="where the GGUFs are cached (default ~/.cache/hybridlm/llama_cpp/<model name>)",
        )
        s.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")
    sub.choices["serve"].add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    sub.choices["serve"].add_argument(
        "--also-no-prefix-cache", action="store_true", help="also run hybridlm without its prefix cache"
    )
    sub.choices["forward"].add_argument(
        "--busy-core",
        action="store_true",
        help="also measure decode with `yes` pinned to core 0 (needs taskset), as a share of quiet decode",
    )
    agent = sub.choices["agent"]
    agent.add_argument("--agents", type=int, default=2, help="agents at once (default 2)")
    agent.add_argument("--requests", type=int, default=8, help="requests per agent (default 8)")
    agent.add_argument("--preamble", type=int, default=3000, help="shared preamble tokens (default 3000)")
    args = p.parse_args()
    quantize = ["llama-quantize"] if set(args.weights) - {"bf16"} else []
    check_llama(args, quantize + (["llama-bench"] if args.command == "forward" else ["llama-server"]))
    return {"forward": cmd_forward, "serve": cmd_serve, "agent": cmd_agent}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
