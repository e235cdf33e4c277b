"""A tiny, randomly initialised Qwen3.5-style hybrid checkpoint for demos, tests and benchmarks.

``write_demo_model(dir)`` writes a complete Hugging Face checkpoint directory (``config.json`` for
``Qwen3_5TextConfig``, bf16 ``model.safetensors`` named the way ``Qwen3_5ForCausalLM`` expects, tokenizer
files, chat template, generation config), byte-identical on every call. ``demo_model_dir()`` keeps one copy in
the user cache and regenerates it when this generator changes.

Architecture: hidden 256, 8 layers as 3 Gated DeltaNet ("linear_attention") layers then 1 gated full-attention
layer, twice; GDN with 4 key / 4 value heads of 64 and a width-4 causal conv; attention with 4 query / 2 KV
heads of 64 and 25% partial RoPE; SwiGLU MLP of 768; tied embeddings; 8.3M parameters (15.8 MiB in bf16).

The tokenizer (package data ``tokenizer.json``, 4096 ids) is a Qwen-style byte-level BPE trained once on the
Python standard library sources by ``hybridlm.demo.train_tokenizer``; ``chat_template.jinja`` is a ChatML
template with Qwen3's semantics for tools, tool calls, tool responses and ``<think>`` reasoning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = ["DEMO_VERSION", "demo_model_dir", "write_demo_model"]

# Bump whenever the generated weights or config change; package-data changes are picked up by the stamp hash.
DEMO_VERSION = 1
_SEED = 20240611
_STAMP_FILE = "hybridlm_demo_version.txt"
_RENAME_ATTEMPTS = 5  # bounded so a persistent rename failure surfaces instead of spinning

HIDDEN = 256
NUM_LAYERS = 8
FULL_ATTENTION_INTERVAL = 4  # every 4th layer is full attention, the Qwen3.5 mix
INTERMEDIATE = 768
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_HEAD_DIM = 4, 4, 64
ATTN_HEADS, ATTN_KV_HEADS, ATTN_HEAD_DIM = 4, 2, 64
CONV_KERNEL = 4
INIT_STD = 0.02

_SPECIAL = {"endoftext": "<|endoftext|>", "im_end": "<|im_end|>"}  # the ids configs refer to


def _package_file(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def _vocab_size(tokenizer_json: dict[str, Any]) -> int:
    """Tokenizer ids (base vocabulary plus added tokens) rounded up to a multiple of 64, as embeddings are."""
    ids = list(tokenizer_json["model"]["vocab"].values()) + [t["id"] for t in tokenizer_json["added_tokens"]]
    return -(-(max(ids) + 1) // 64) * 64


def _token_id(tokenizer_json: dict[str, Any], content: str) -> int:
    return next(t["id"] for t in tokenizer_json["added_tokens"] if t["content"] == content)


def _layer_types() -> list[str]:
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(NUM_LAYERS)
    ]


def _config(vocab_size: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    """``config.json`` with the field names and layout of transformers' ``Qwen3_5TextConfig``."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "dtype": "bfloat16",
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "layer_types": _layer_types(),
        "full_attention_interval": FULL_ATTENTION_INTERVAL,
        "num_attention_heads": ATTN_HEADS,
        "num_key_value_heads": ATTN_KV_HEADS,
        "head_dim": ATTN_HEAD_DIM,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_num_key_heads": GDN_KEY_HEADS,
        "linear_num_value_heads": GDN_VALUE_HEADS,
        "linear_key_head_dim": GDN_HEAD_DIM,
        "linear_value_head_dim": GDN_HEAD_DIM,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            # 8 rotary frequencies (64 * 0.25 / 2) split over the temporal/height/width sections; for text all
            # three positions are equal, so this only has to be a valid split.
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
        "initializer_range": INIT_STD,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
    }


def _weights(vocab_size: int) -> dict[str, torch.Tensor]:
    """All parameters, in bf16, drawn in a fixed order from one seeded CPU generator.

    Matrices are N(0, 0.02); the residual-stream RMSNorms (input/post-attention/final, q_norm/k_norm) are
    stored zero-centred, i.e. 0 means identity; the GDN output norm is a plain gated RMSNorm with weight 1;
    A_log = log(U(1, 16)) and dt_bias = 1 as in Qwen3-Next/Qwen3.5 initialisation; the depthwise conv uses
    std 1/sqrt(kernel) so it preserves the variance of its input.
    """
    gen = torch.Generator(device="cpu").manual_seed(_SEED)

    def normal(*shape: int, std: float = INIT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    gdn_key_dim = GDN_KEY_HEADS * GDN_HEAD_DIM
    gdn_value_dim = GDN_VALUE_HEADS * GDN_HEAD_DIM
    gdn_conv_dim = 2 * gdn_key_dim + gdn_value_dim
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN)}
    for i, kind in enumerate(_layer_types()):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.zeros(HIDDEN)
        if kind == "linear_attention":
            w[p + "linear_attn.in_proj_qkv.weight"] = normal(gdn_conv_dim, HIDDEN)
            w[p + "linear_attn.in_proj_z.weight"] = normal(gdn_value_dim, HIDDEN)
            w[p + "linear_attn.in_proj_b.weight"] = normal(GDN_VALUE_HEADS, HIDDEN)
            w[p + "linear_attn.in_proj_a.weight"] = normal(GDN_VALUE_HEADS, HIDDEN)
            w[p + "linear_attn.conv1d.weight"] = normal(gdn_conv_dim, 1, CONV_KERNEL, std=CONV_KERNEL**-0.5)
            w[p + "linear_attn.dt_bias"] = torch.ones(GDN_VALUE_HEADS)
            w[p + "linear_attn.A_log"] = torch.empty(GDN_VALUE_HEADS).uniform_(1.0, 16.0, generator=gen).log()
            w[p + "linear_attn.norm.weight"] = torch.ones(GDN_HEAD_DIM)
            w[p + "linear_attn.out_proj.weight"] = normal(HIDDEN, gdn_value_dim)
        else:
            # q_proj emits the query and the per-channel output gate side by side, hence 2x.
            w[p + "self_attn.q_proj.weight"] = normal(2 * ATTN_HEADS * ATTN_HEAD_DIM, HIDDEN)
            w[p + "self_attn.k_proj.weight"] = normal(ATTN_KV_HEADS * ATTN_HEAD_DIM, HIDDEN)
            w[p + "self_attn.v_proj.weight"] = normal(ATTN_KV_HEADS * ATTN_HEAD_DIM, HIDDEN)
            w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, ATTN_HEADS * ATTN_HEAD_DIM)
            w[p + "self_attn.q_norm.weight"] = torch.zeros(ATTN_HEAD_DIM)
            w[p + "self_attn.k_norm.weight"] = torch.zeros(ATTN_HEAD_DIM)
        w[p + "post_attention_layernorm.weight"] = torch.zeros(HIDDEN)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    w["model.norm.weight"] = torch.zeros(HIDDEN)
    return {name: t.to(torch.bfloat16).contiguous() for name, t in w.items()}


def _dump_json(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _stamp() -> str:
    """Identifies this generator: the version plus a hash of the package data it copies."""
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "chat_template.jinja"):
        digest.update(_package_file(name))
    return f"{DEMO_VERSION}-{digest.hexdigest()[:16]}\n"


def write_demo_model(out_dir: str | Path) -> Path:
    """Write the demo checkpoint into ``out_dir`` (created if needed) and return its path.

    The output is deterministic: the same files with the same bytes on every call.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_bytes = _package_file("tokenizer.json")
    tokenizer_json = json.loads(tokenizer_bytes)
    vocab_size = _vocab_size(tokenizer_json)
    ids = {key: _token_id(tokenizer_json, text) for key, text in _SPECIAL.items()}

    files = {
        "config.json": _dump_json(_config(vocab_size, bos_id=ids["endoftext"], eos_id=ids["im_end"])),
        "generation_config.json": _dump_json(
            {
                "bos_token_id": ids["endoftext"],
                "eos_token_id": [ids["im_end"], ids["endoftext"]],
                "pad_token_id": ids["endoftext"],
                "do_sample": True,
                "temperature": 0.6,
                "top_k": 20,
                "top_p": 0.95,
            }
        ),
        "tokenizer.json": tokenizer_bytes,
        "tokenizer_config.json": _dump_json(
            {
                # Use tokenizer.json as is; Qwen2Tokenizer would swap in its own pre-tokenizer regex.
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": False,
                "add_prefix_space": False,
                "bos_token": None,
                "eos_token": _SPECIAL["im_end"],
                "pad_token": _SPECIAL["endoftext"],
                "unk_token": None,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 32768,
                "split_special_tokens": False,
            }
        ),
        "chat_template.jinja": _package_file("chat_template.jinja"),
        _STAMP_FILE: _stamp().encode(),
    }
    for name, data in files.items():
        (out / name).write_bytes(data)
    # Fixed metadata keeps the safetensors header, and so the file, byte-identical across calls.
    save_file(_weights(vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _is_current(path: Path) -> bool:
    try:
        return (path / _STAMP_FILE).read_text() == _stamp()
    except OSError:
        return False


def _check_replaceable(target: Path) -> None:
    """Refuse to replace anything but a missing path, an empty directory or an (outdated) demo model."""
    if target.is_dir() and not any(target.iterdir()):
        return
    if target.exists() and not (target / _STAMP_FILE).is_file():
        raise FileExistsError(f"{target} exists and is not a hybridlm demo model; not replacing it")


def demo_model_dir() -> Path:
    """Path of the cached demo checkpoint, generated on first use.

    The location is ``$HYBRIDLM_DEMO_DIR`` if set, else ``$XDG_CACHE_HOME/hybridlm/demo-model`` (default
    ``~/.cache/hybridlm/demo-model``). A copy made by an older generator is replaced. The model is written to
    a temporary sibling directory and renamed into place, so concurrent callers never see a half-written
    directory. An existing non-empty directory that is not a demo model is never touched.
    """
    if env_dir := os.environ.get("HYBRIDLM_DEMO_DIR"):
        target = Path(env_dir).expanduser()
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        target = cache / "hybridlm" / "demo-model"
    if _is_current(target):
        return target
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write_demo_model(tmp)
        for _ in range(_RENAME_ATTEMPTS):
            try:
                tmp.rename(target)  # atomic; also replaces an empty directory
                return target
            except OSError as e:
                error = e
            if _is_current(target):  # another process won the race with the same model
                return target
            if not target.exists():  # moved aside by a concurrent caller between our two checks
                continue
            _check_replaceable(target)
            # A stale demo model: move it aside atomically, then delete it.
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            with contextlib.suppress(FileNotFoundError):  # another caller moved it first
                target.rename(stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        raise OSError(f"could not move the demo model into {target}") from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
