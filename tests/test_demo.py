"""The demo checkpoint: deterministic, loadable by transformers, usable for generation, cached safely."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hybridlm.demo import demo_model_dir, write_demo_model
from hybridlm.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def file_hashes(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


def test_write_is_deterministic(demo_dir, tmp_path):
    again = write_demo_model(tmp_path / "again")
    assert file_hashes(again) == file_hashes(demo_dir)
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    expected |= {"tokenizer_config.json", "chat_template.jinja"}
    assert expected <= set(file_hashes(demo_dir))


def test_config_layout(demo_dir):
    config = transformers.AutoConfig.from_pretrained(demo_dir)
    assert type(config).__name__ == "Qwen3_5TextConfig"
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    tok = Tokenizer.from_dir(demo_dir)
    assert config.vocab_size % 64 == 0 and tok.vocab_size <= config.vocab_size < tok.vocab_size + 64
    assert config.tie_word_embeddings and config.head_dim == 64 and config.hidden_size == 256
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert config.eos_token_id in tok.eos_token_ids


@pytest.mark.usefixtures("single_thread")
def test_transformers_loads_and_generates(demo_dir):
    model, info = transformers.Qwen3_5ForCausalLM.from_pretrained(
        demo_dir, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    # tied embeddings: no separate lm_head tensor is stored, and the loaded head is the embedding
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    tok = Tokenizer.from_dir(demo_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a function that adds two numbers."}])
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.isfinite(logits).all() and logits.abs().max() < 30  # O(1) activations through the tied head
    generated = out[0, ids.shape[1] :].tolist()
    assert len(generated) == 16 and len(set(generated)) >= 3


def test_transformers_tokenizer_agrees(demo_dir):
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    tok = Tokenizer.from_dir(demo_dir)
    text = "def add(a, b):\n    return a + b  # ünïcode 🙂"
    assert hf.encode(text) == tok.encode(text, add_special_tokens=True)
    assert len(hf) == tok.vocab_size


def test_demo_model_dir_caches_and_refreshes(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "demo"
    monkeypatch.setenv("HYBRIDLM_DEMO_DIR", str(target))
    assert demo_model_dir() == target
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen3_5_text"
    weights = target / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert demo_model_dir() == target and weights.stat().st_mtime_ns == mtime  # reused, not rewritten

    stamp = next(target.glob("hybridlm_demo_version*"))
    stamp.write_text("0-older-generator\n")
    assert demo_model_dir() == target
    assert stamp.read_text() != "0-older-generator\n"
    assert [p.name for p in target.parent.iterdir()] == ["demo"]  # no temp or stale dirs left behind


def test_demo_model_dir_default_location(demo_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDLM_DEMO_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # a concurrent first use: both callers get the same complete directory
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: demo_model_dir(), range(2)))
    assert paths == [tmp_path / "hybridlm" / "demo-model"] * 2
    assert file_hashes(paths[0]) == file_hashes(demo_dir)
    assert sorted(p.name for p in (tmp_path / "hybridlm").iterdir()) == ["demo-model"]


def test_demo_model_dir_never_replaces_foreign_dirs(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setenv("HYBRIDLM_DEMO_DIR", str(tmp_path))
    with pytest.raises(FileExistsError, match="not a hybridlm demo model"):
        demo_model_dir()
    assert (tmp_path / "notes.txt").read_text() == "mine"
