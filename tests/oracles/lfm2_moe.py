"""LFM2-MoE checkpoints: a dense first layer then sparse ones, with odd sizes (4 attention heads over
1 KV head, 5 experts, top-2; LFM2's head width is hidden / heads, and int4 needs widths of 64), a
random `expert_bias` (a buffer, which `randomize` leaves at zero) and a routed scaling factor; and a
variant without the bias, without renormalisation, tied."""

from __future__ import annotations

import torch

from tests.oracles.common import VOCAB, save


def config(layer_types: list[str], **kw):
    from transformers import Lfm2MoeConfig

    base = dict(
        vocab_size=VOCAB,
        # widths of 64: int4 (groups of 64) applies to the experts and the projections
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=64,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_dense_layers=1,
        num_experts=5,
        num_experts_per_tok=2,
        routed_scaling_factor=1.5,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return Lfm2MoeConfig(**base)


def with_random_expert_bias(model, seed: int):
    """Selection biases large enough to change which experts many tokens pick."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=g) * 0.15)
    return model


def biased(out):
    from transformers import Lfm2MoeForCausalLM

    torch.manual_seed(0)
    model = Lfm2MoeForCausalLM(config(["conv", "full_attention", "conv", "full_attention"]))
    ckpt = save(model, out, "lfm2_moe")
    with_random_expert_bias(model, seed=5).save_pretrained(out)
    return ckpt


def plain(out):
    from transformers import Lfm2MoeForCausalLM

    torch.manual_seed(0)
    cfg = config(
        ["full_attention", "conv", "conv"], use_expert_bias=False, norm_topk_prob=False,
        routed_scaling_factor=1.0, tie_word_embeddings=True, conv_bias=True,
    )
    return save(Lfm2MoeForCausalLM(cfg), out, "lfm2_moe_plain")


BUILDERS = {"lfm2_moe": biased, "lfm2_moe_plain": plain}
REPRESENTATIVE = ["lfm2_moe"]
