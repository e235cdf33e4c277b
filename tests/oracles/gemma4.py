"""Gemma 4 checkpoints:
- text untied: per-layer inputs, KV-shared layers (one producer per type), global layers with their
  own head dim and proportional rope, final logit soft-capping; the file also carries key/value
  weights for the shared layers, as published checkpoints do (nothing reads them);
- text tied, `attention_k_eq_v` with one global kv head, no per-layer inputs, rewritten to the flat
  `global_head_dim` / `num_global_key_value_heads` fields of published configs and a last layer
  listed as sliding (which transformers, and we, turn global);
- MoE beside the dense MLP, KV sharing with the double-wide MLP on the shared layers, linear rope
  on the sliding layers (transformers cannot run KV sharing without per-layer inputs: its
  prompt-slicing step indexes the absent per-layer inputs);
- the multimodal layout (tiny vision and audio towers), tied and untied.

Sliding windows are small (12 or 16) so the 90–330-token cache tests wrap them many times.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from tests.oracles.common import VOCAB, Checkpoint, randomize

S, F = "sliding_attention", "full_attention"
ROPE = {
    S: {"rope_type": "default", "rope_theta": 10000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


def text_config(tie: bool, layer_types: list[str], **kw):
    from transformers import Gemma4TextConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=16,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        tie_word_embeddings=tie,
        max_position_embeddings=4096,
        rope_parameters=ROPE,
    )
    base.update(kw)
    return Gemma4TextConfig(**base)


def save(model, out, name: str) -> Checkpoint:
    """`common.save`, then the scales a trained Gemma 4 has learned: attention runs at scale 1, so
    the q/k norm weights set its temperature (near 1 they would make q·k ~ ±head_dim and the random
    model chaotic in bf16: they get head_dim^-1/4 each); layer output scales (buffers transformers
    leaves at 1) are random around 1."""
    randomize(model, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if p_name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(p.shape[0] ** -0.25)
        for b_name, buf in model.named_buffers():
            if b_name.endswith("layer_scalar"):
                buf.copy_(1 + 0.2 * torch.rand(buf.shape, generator=g))
    model.save_pretrained(out)
    return Checkpoint(out, type(model), name)


def text(out):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    cfg = text_config(False, [S, S, F, S, F, S, S, F], num_kv_shared_layers=3, final_logit_softcapping=30.0)
    ckpt = save(Gemma4ForCausalLM(cfg), out, "gemma4_text")
    add_unused_shared_kv_weights(out, cfg)
    return ckpt


def add_unused_shared_kv_weights(out, cfg) -> None:
    """Key/value projections and norms for the KV-shared layers, as published files carry them."""
    path = out / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(3)
    d, kv = cfg.hidden_size, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers - cfg.num_kv_shared_layers, cfg.num_hidden_layers):
        dim = cfg.per_layer_config[i].head_dim
        p = f"model.layers.{i}.self_attn"
        tensors[f"{p}.k_proj.weight"] = torch.randn(kv * dim, d, generator=g)
        tensors[f"{p}.v_proj.weight"] = torch.randn(kv * dim, d, generator=g)
        tensors[f"{p}.k_norm.weight"] = torch.randn(dim, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})


def text_tied_legacy(out):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    cfg = text_config(
        True,
        [S, F, S, S, F],
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        sliding_window=12,
    )
    ckpt = save(Gemma4ForCausalLM(cfg), out, "gemma4_text_tied")
    path = out / "config.json"
    raw = json.loads(path.read_text())
    raw.pop("per_layer_config")
    raw["layer_types"][-1] = S
    raw.update(global_head_dim=32, num_global_key_value_heads=1)
    path.write_text(json.dumps(raw, indent=2))
    return ckpt


def moe(out):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    cfg = text_config(
        False,
        [S, F, S, F, S, F],
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        rope_parameters={S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, F: ROPE[F]},
    )
    return save(Gemma4ForCausalLM(cfg), out, "gemma4_moe")


def multimodal(tie: bool, name: str):
    def build(out):
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration

        torch.manual_seed(0)
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            patch_size=4,
            position_embedding_size=64,
            pooling_kernel_size=2,
        )
        audio = dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            subsampling_conv_channels=[8, 4],
            output_proj_dims=32,
            conv_kernel_size=3,
        )
        text = text_config(tie, [S, S, F, S, F], num_kv_shared_layers=2)
        cfg = Gemma4Config(
            text_config=text.to_dict(), vision_config=vision, audio_config=audio, tie_word_embeddings=tie
        )
        return save(Gemma4ForConditionalGeneration(cfg), out, name)

    return build


BUILDERS = {
    "gemma4_text": text,
    "gemma4_text_tied": text_tied_legacy,
    "gemma4_moe": moe,
    "gemma4_vl": multimodal(True, "gemma4_vl"),
    "gemma4_vl_untied": multimodal(False, "gemma4_vl_untied"),
}
REPRESENTATIVE = ["gemma4_text"]


def allow_all_shared_layers() -> None:
    """Let transformers build and load an assistant: its config property `kv_sharing_modes` insists
    on a producer per layer type, which an assistant (every layer shared) never has."""
    from transformers import Gemma4TextConfig

    modes = Gemma4TextConfig.kv_sharing_modes
    if getattr(modes, "allows_all_shared", False):
        return

    def kv_sharing_modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return modes.fget(self)

    kv_sharing_modes.allows_all_shared = True
    Gemma4TextConfig.kv_sharing_modes = property(kv_sharing_modes)


def assistant_pair(out, ordered: bool, vocab: int = VOCAB) -> tuple[Checkpoint, Checkpoint]:
    """A target whose KV-shared layers leave a producer of each type (window 8, so a 40-token prompt
    wraps it) and its assistant: 3 layers of another width over the target's KV; `ordered`: the
    ordered-embedding head (8 clusters, top 2) and an untied head, else a tied plain head. A small
    `vocab` lets the two models' distributions overlap (sampling tests)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    allow_all_shared_layers()
    torch.manual_seed(0)
    vocabs = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab)
    target_cfg = text_config(False, [S, F] * 3, num_kv_shared_layers=2, sliding_window=8, **vocabs)
    target = save(Gemma4ForCausalLM(target_cfg), out / "target", "gemma4_target")
    text = text_config(
        True,
        [S, S, F],
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        sliding_window=8,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        num_kv_shared_layers=3,
    )
    cfg = Gemma4AssistantConfig(
        text_config=text.to_dict(),
        backbone_hidden_size=target_cfg.hidden_size,
        use_ordered_embeddings=ordered,
        num_centroids=8,
        centroid_intermediate_top_k=2,
        tie_word_embeddings=not ordered,
    )
    model = Gemma4AssistantForCausalLM(cfg)
    if ordered:
        g = torch.Generator().manual_seed(4)
        model.masked_embedding.token_ordering.copy_(torch.randperm(vocab, generator=g))
    return target, save(model, out / "assistant", "gemma4_assistant")
