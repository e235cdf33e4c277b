"""Gemma 3 checkpoints: text untied (linear rope scaling on the global layers, final logit
soft-capping), text tied with the older flat config fields published on the Hub, and the
multimodal layout (tiny SigLIP tower) tied and untied.

Every sliding window is small (16 or 24) so the 90–330-token cache tests wrap it many times.
"""

from __future__ import annotations

import json

import torch

from tests.oracles.common import VOCAB, save

S, F = "sliding_attention", "full_attention"


def text_config(tie: bool, layer_types: list[str], **kw):
    from transformers import Gemma3TextConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=16,
        query_pre_attn_scalar=24,
        tie_word_embeddings=tie,
        max_position_embeddings=4096,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 10000.0},
            F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    )
    base.update(kw)
    return Gemma3TextConfig(**base)


def text(out):
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    cfg = text_config(False, [S, S, F, S, F], final_logit_softcapping=30.0)
    return save(Gemma3ForCausalLM(cfg), out, "gemma3_text")


def text_tied_legacy(out):
    """Tied, saved and then rewritten to the flat fields of the published configs (rope_theta,
    rope_local_base_freq, rope_scaling, sliding_window_pattern; defaults left out), which
    transformers still reads: both sides must derive the same model from them."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    cfg = text_config(True, [S, S, F, S], num_key_value_heads=1, head_dim=16, sliding_window=24)
    ckpt = save(Gemma3ForCausalLM(cfg), out, "gemma3_text_tied")
    path = out / "config.json"
    raw = json.loads(path.read_text())
    for key in (
        "layer_types",
        "rope_parameters",
        "_sliding_window_pattern",
        "query_pre_attn_scalar",
        "hidden_activation",
        "rms_norm_eps",
        "tie_word_embeddings",
    ):
        raw.pop(key)
    raw.update(
        sliding_window_pattern=3,
        rope_theta=500000.0,
        rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )
    path.write_text(json.dumps(raw, indent=2))
    return ckpt


def vision_language(tie: bool, name: str):
    def build(out):
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        torch.manual_seed(0)
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
        cfg = Gemma3Config(
            text_config=text_config(tie, [F, S, S]).to_dict(),
            vision_config=vision,
            mm_tokens_per_image=4,
            tie_word_embeddings=tie,
        )
        return save(Gemma3ForConditionalGeneration(cfg), out, name)

    return build


BUILDERS = {
    "gemma3_text": text,
    "gemma3_text_tied": text_tied_legacy,
    "gemma3_vl": vision_language(True, "gemma3_vl"),
    "gemma3_vl_untied": vision_language(False, "gemma3_vl_untied"),
}
REPRESENTATIVE = ["gemma3_text"]
