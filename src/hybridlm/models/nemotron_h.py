"""Nemotron-H (`nemotron_h`: Nemotron-H 8B / 47B, Nemotron 3 Nano / Super): one block kind per layer,
each `h + mixer(norm(h))`, chosen by `hybrid_override_pattern` (published configs: one letter a
layer) or `layers_block_type` (transformers 5):

- ``M`` Mamba-2 (`models.mamba2`; Δ clamped below at `time_step_min`, as transformers does);
- ``*`` attention without positional encoding;
- ``-`` a non-gated MLP, ``down(relu(up(x))²)``;
- ``E`` a mixture of non-gated relu² experts: a sigmoid router whose choice adds
  `e_score_correction_bias`, grouped top-k (`n_group`, `topk_group`), weights renormalised and
  scaled by `routed_scaling_factor`, optional latent projections around the experts
  (`moe_latent_size`), plus an always-on shared expert.

Published checkpoints prefix tensors with `backbone.` and store experts one by one; `remap` and
`convert` bring them to `model.` and stacked `[E, out, in]` tensors. Multi-token-prediction weights
(`mtp.*`) are ignored. Norms scale in float32 and cast once (`Float32RMSNorm`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from hybridlm.batch import Batch
from hybridlm.models.base import CausalLM, Config, register
from hybridlm.models.checkpoint import CheckpointError
from hybridlm.models.layers import Attention, relu2
from hybridlm.models.mamba2 import Mamba2Mixer
from hybridlm.models.moe import SIGMOID, Experts, Router
from hybridlm.ops.elementwise import elementwise_rows
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import Float32RMSNorm
from hybridlm.ops.rope import Rotary

# Older field names that transformers' NemotronHConfig also accepts, and the names read here.
ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_min": "time_step_min",
}
LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def block_types(c: Config) -> list[str]:
    """The layers' kinds from `layers_block_type`, else from the pattern string; an unknown kind or
    letter is a CheckpointError naming it."""
    kinds = c.get("layers_block_type") or c.get("layer_types")
    if not kinds:
        pattern = c.get("hybrid_override_pattern")
        if not pattern:
            raise CheckpointError("nemotron_h config: neither layers_block_type nor hybrid_override_pattern")
        bad = sorted(set(pattern) - set(LETTERS))
        if bad:
            raise CheckpointError(f"hybrid_override_pattern {pattern!r}: unknown layer letter {bad[0]!r} "
                                  f"(known: {''.join(LETTERS)})")
        kinds = [LETTERS[ch] for ch in pattern]
    bad = sorted(set(kinds) - set(LETTERS.values()))
    if bad:
        raise CheckpointError(f"layers_block_type: unknown layer kind {bad[0]!r}")
    return list(kinds)


class Relu2MLP(nn.Module):
    """down(relu(up(x))²)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self._modules, x)

    def run(self, parts: Mapping[str, Callable], x: torch.Tensor) -> torch.Tensor:
        """`forward` over `parts` (see `DecoderLayer.run`)."""
        return parts["down_proj"](elementwise_rows(relu2, parts["up_proj"](x)))


class NemotronMoE(nn.Module):
    """Routed relu² experts (inside optional latent projections) plus the shared expert."""

    def __init__(self, c: Config):
        super().__init__()
        d, latent, bias = c.hidden_size, c.get("moe_latent_size"), c.get("mlp_bias", False)
        # Sigmoid scores in float32, `e_score_correction_bias` for the choice only, grouped top-k,
        # renormalised (+1e-20) and scaled weights: transformers' NemotronHTopkRouter.
        self.gate = Router(
            d, c.n_routed_experts, c.num_experts_per_tok, SIGMOID, normalize=c.get("norm_topk_prob", True),
            bias=True, n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1),
            scaling=c.get("routed_scaling_factor", 1.0), float32_logits=True,
        )
        self.experts = Experts(c.n_routed_experts, latent or d, c.moe_intermediate_size, "relu2", gated=False)
        self.shared_experts = Relu2MLP(d, c.moe_shared_expert_intermediate_size, bias)
        self.fc1_latent_proj = Linear(d, latent, bias=bias) if latent else None
        self.fc2_latent_proj = Linear(latent, d, bias=bias) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, d] -> [B, L, d]."""
        return self.run(self._modules, x)

    def run(self, parts: Mapping[str, Callable], x: torch.Tensor) -> torch.Tensor:
        """`forward` over `parts` (see `DecoderLayer.run`)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, index = parts["gate"](flat)
        fc1, fc2 = parts.get("fc1_latent_proj"), parts.get("fc2_latent_proj")
        h = parts["experts"](flat if fc1 is None else fc1(flat), index, weights)
        if fc2 is not None:
            h = fc2(h)
        return h.view(shape) + parts["shared_experts"](x)


class NemotronBlock(nn.Module):
    """h + mixer(norm(h)); the mixer is the layer's one block (Mamba-2, attention, MLP or MoE)."""

    def __init__(self, kind: str, mixer: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.kind = kind
        self.norm = Float32RMSNorm(hidden, eps)
        self.mixer = mixer

    @property
    def stateful(self) -> bool:
        return self.kind in ("linear_attention", "full_attention")

    def make_cache(self, batch_size: int, dtype, device):
        return self.mixer.make_cache(batch_size, dtype, device) if self.stateful else None

    def forward(self, h: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        """`cache`: this layer's cache (a packed batch: the segments' list), None for MLP / MoE."""
        return self.run(self._modules, h, batch, cache)

    def run(self, parts: Mapping[str, Callable], h: torch.Tensor, batch: Batch, cache) -> torch.Tensor:
        """`forward` over `parts` (see `DecoderLayer.run`)."""
        x, mixer = parts["norm"](h), parts["mixer"]
        return h + (mixer(x, batch, cache) if self.stateful else mixer(x))


@register("nemotron_h")
class NemotronH(CausalLM):
    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        d, eps = c.hidden_size, c.get("layer_norm_epsilon", 1e-5)
        head_dim = c.get("head_dim") or d // c.num_attention_heads
        nope = Rotary(torch.zeros(0, device="cpu"))  # attention without positional encoding
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.model.layers = nn.ModuleList()
        for kind in block_types(c):
            if kind == "linear_attention":
                mixer = Mamba2Mixer(
                    d, c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel,
                    eps=eps, dt_limit=(c.get("time_step_min", 0.001), float("inf")),
                    conv_bias=c.get("use_conv_bias", True), proj_bias=c.get("use_bias", False),
                )
            elif kind == "full_attention":
                mixer = Attention(d, c.num_attention_heads, c.num_key_value_heads, head_dim, nope,
                                  bias=c.get("attention_bias", False))
            elif kind == "mlp":
                mixer = Relu2MLP(d, c.intermediate_size, c.get("mlp_bias", False))
            else:
                mixer = NemotronMoE(c)
            self.model.layers.append(NemotronBlock(kind, mixer, d, eps))
        self.model.norm = Float32RMSNorm(d, eps)
        self.lm_head = Linear(d, c.vocab_size, bias=False)

    @classmethod
    def text_config(cls, raw: dict) -> Config:
        c = super().text_config(raw)
        block_types(c)  # refuse an unknown layer kind before anything is built
        for old, new in ALIASES.items():
            if old in c:
                c.setdefault(new, c[old])
        return c

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        if name.startswith("mtp."):
            return None
        if name.startswith("backbone."):
            name = "model." + name[len("backbone.") :]
        name = name.replace("model.embeddings.", "model.embed_tokens.", 1)
        return name.replace("model.norm_f.", "model.norm.", 1)

    @classmethod
    def convert(cls, state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
        """Stack published per-expert tensors `mixer.experts.{e}.{up,down}_proj.weight` into
        `mixer.experts.{up,down}_proj` [E, out, in]; a missing expert is a CheckpointError."""
        c = config
        for i, kind in enumerate(block_types(c)):
            e = f"model.layers.{i}.mixer.experts"
            if kind != "moe" or f"{e}.0.up_proj.weight" not in state:
                continue
            for proj in ("up_proj", "down_proj"):
                names = [f"{e}.{j}.{proj}.weight" for j in range(c.n_routed_experts)]
                missing = [n for n in names if n not in state]
                if missing:
                    raise CheckpointError(f"missing tensor {missing[0]!r}")
                state[f"{e}.{proj}"] = torch.stack([state.pop(n) for n in names])
        return state
