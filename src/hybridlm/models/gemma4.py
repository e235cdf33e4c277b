"""Gemma 4 (`gemma4_text`, and the multimodal `gemma4` layout whose text model we load).

Gemma 3's sliding + global attention with sandwich norms, plus:
- global layers with their own head dim / kv heads (`per_layer_config`, or the flat
  `global_head_dim` / `num_global_key_value_heads` of published configs) and proportional rope
  (only the first `partial_rotary_factor` of each rotate-half pair turns);
- q/k norm with attention scale 1, values RMS-normed without a weight, optional `attention_k_eq_v`
  (global layers use the key projection as values);
- per-layer inputs (PLE): a packed per-layer token embedding plus a projection of the input
  embeddings, fed to every layer through a gated residual branch;
- KV sharing: the last `num_kv_shared_layers` layers compute no keys/values and attend over those
  of the last earlier layer of their type (the *producer*) from the same forward, so the
  producer's cache is the only state; they get no cache of their own;
- optional MoE beside the dense MLP, a double-wide MLP on the shared layers, a learned per-layer
  output scale, `weight * norm` RMSNorm (not Gemma 3's `1 + weight`).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlm.batch import Batch, Packed
from hybridlm.cache import AttentionHistory, KVCache, SlidingKVCache
from hybridlm.models.base import CausalLM, Config, last_rows, register
from hybridlm.models.layers import ACTIVATIONS, GatedMLP, per_segment, rope_tables
from hybridlm.models.moe import Experts, softmax_topk
from hybridlm.ops.attention import attention
from hybridlm.ops.elementwise import elementwise_rows
from hybridlm.ops.linear import Linear
from hybridlm.ops.norms import rms_normalize
from hybridlm.ops.rope import Rotary, apply_rotary, default_inv_freq, inv_freq_from_params

SLIDING, FULL = "sliding_attention", "full_attention"
REUSE, STORE = "reuse", "store"

# Gemma4TextConfig defaults: published configs (the multimodal ones above all) leave these out.
DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
}
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
DEFAULT_GLOBAL_HEAD_DIM = 512
# per_layer_config fields this implementation applies per layer
PER_LAYER_FIELDS = {"head_dim", "num_key_value_heads"}

# The Gemma 4 assistant drafter masks the target's sliding KV as transformers builds it: |q - k| ≤ window
# from a query one position past the last key, i.e. the window + 1 keys before the query, two more
# than a sliding query of the target sees before itself. The producer it reads keeps them.
ASSISTANT_EXTRA_ROWS = 2

# checkpoint prefix -> parameter prefix (None: not part of the text model)
RENAMES = {
    "model.language_model.": "model.",
    "model.vision_tower.": None,
    "model.embed_vision.": None,
    "model.audio_tower.": None,
    "model.embed_audio.": None,
}
# Published checkpoints still carry key/value weights for the KV-shared layers; nothing reads them.
UNUSED_BY_SHARED_LAYERS = ("k_proj", "v_proj", "k_norm", "v_norm")


def layer_types(c: Config) -> list[str]:
    """`layer_types` (default: every 6th layer global); the last layer is always global, as
    transformers forces it."""
    if c.get("layer_types"):
        kinds = list(c.layer_types)
    else:
        kinds = [SLIDING if (i + 1) % 6 else FULL for i in range(c.num_hidden_layers)]
    unknown = set(kinds) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"Gemma 4 layer_types {sorted(unknown)} are not supported")
    kinds[-1] = FULL
    return kinds


def kv_sharing(c: Config, kinds: list[str]) -> list[str | None]:
    """Per layer: REUSE (attends over its producer's keys/values), STORE (the last non-shared layer
    of its type: the producer) or None, by transformers' rule."""
    n, shared = len(kinds), c.num_kv_shared_layers
    if not shared:
        return [None] * n
    first = n - shared
    modes: list[str | None] = [None] * first + [REUSE] * shared
    if set(kinds[:first]) != set(kinds):
        raise ValueError(
            f"num_kv_shared_layers={shared} leaves no earlier layer of some type to share keys/values from "
            f"(layer_types {kinds})"
        )
    for kind in set(kinds):
        modes[max(i for i in range(first) if kinds[i] == kind)] = STORE
    return modes


def layer_overrides(c: Config, kinds: list[str]) -> list[dict]:
    """Per layer: the fields its `per_layer_config` entry overrides (head_dim, num_key_value_heads).

    Configs written by transformers 5 carry `per_layer_config` (keys: layer indices, possibly
    zero-padded); published ones carry `global_head_dim` (default 512) and, with `attention_k_eq_v`,
    `num_global_key_value_heads` for the global layers, which transformers turns into the same.
    """
    if "per_layer_config" in c:
        table = {int(i): dict(o) for i, o in (c.per_layer_config or {}).items()}
    else:
        o = {"head_dim": c.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)}
        if c.attention_k_eq_v and c.get("num_global_key_value_heads") is not None:
            o["num_key_value_heads"] = c.num_global_key_value_heads
        table = {i: o for i, kind in enumerate(kinds) if kind == FULL}
    unknown = sorted({key for o in table.values() for key in o} - PER_LAYER_FIELDS)
    if unknown:
        raise ValueError(
            f"Gemma 4 per_layer_config overrides {unknown}: only {sorted(PER_LAYER_FIELDS)} are supported"
        )
    return [table.get(i, {}) for i in range(len(kinds))]


def rope_inv_freq(head_dim: int, params: dict) -> torch.Tensor:
    """[head_dim / 2 or rot_dim / 2] inverse frequencies of one layer type, as Gemma 4 derives them.

    "default" turns every dim (Gemma 4 ignores `partial_rotary_factor` there); "proportional" keeps
    `head_dim / 2` frequencies, `base^(-2i / head_dim)` for the first `factor · head_dim / 2` and 0
    (no rotation) for the rest, so the turning dims are spread over both rotate-half halves.
    """
    rope_type = params.get("rope_type", "default")
    theta = params["rope_theta"]
    if rope_type == "default":
        return default_inv_freq(head_dim, theta)
    if rope_type == "proportional":
        angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        turning = 1.0 / theta ** (
            torch.arange(0, 2 * angles, 2, dtype=torch.float32, device="cpu") / head_dim
        )
        still = torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device="cpu")
        return torch.cat([turning, still]) / params.get("factor", 1.0)
    if rope_type == "linear" and params.get("partial_rotary_factor", 1.0) == 1.0:
        return inv_freq_from_params(head_dim, params)[0]
    raise ValueError(
        f"Gemma 4 rope {params} is not supported (default, proportional, linear without partial rotary)"
    )


class Gemma4RMSNorm(nn.Module):
    """`weight * norm(x)`, the scale applied in float32 before the cast; `scale=False`: no weight."""

    def __init__(self, dim: int, eps: float = 1e-6, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = rms_normalize(x, self.eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)


class Gemma4Attention(nn.Module):
    """GQA attention with q/k/v norm (scale 1), rope on q and k, and KV sharing.

    `sharing`: None (own keys/values and cache), STORE (also publishes the history it attends over
    in `shared[kind]` for the REUSE layers after it) or REUSE (no key/value weights, no cache:
    attends over `shared[kind]`). `window` is the mask window (query included), None for global.
    """

    def __init__(self, c: Config, kind: str, head_dim: int, kv_heads: int, rotary: Rotary, sharing, window):
        super().__init__()
        self.kind, self.sharing, self.window, self.rotary = kind, sharing, window, rotary
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, kv_heads, head_dim
        d, bias, eps = c.hidden_size, c.attention_bias, c.rms_norm_eps
        self.q_proj = Linear(d, self.heads * head_dim, bias=bias)
        self.q_norm = Gemma4RMSNorm(head_dim, eps)
        if sharing != REUSE:
            self.k_proj = Linear(d, kv_heads * head_dim, bias=bias)
            # attention_k_eq_v: global layers take their values from the key projection
            shares_kv = c.attention_k_eq_v and kind == FULL
            self.v_proj = None if shares_kv else Linear(d, kv_heads * head_dim, bias=bias)
            self.k_norm = Gemma4RMSNorm(head_dim, eps)
            self.v_norm = Gemma4RMSNorm(head_dim, eps, scale=False)
        self.o_proj = Linear(self.heads * head_dim, d, bias=bias)

    def make_cache(self, batch_size: int, dtype, device):
        if self.sharing == REUSE:
            return None
        if self.window is None:
            return KVCache(batch_size)
        extra = ASSISTANT_EXTRA_ROWS if self.sharing == STORE else 0
        return SlidingKVCache(self.window + extra, batch_size)

    def forward(self, x: torch.Tensor, batch: Batch, cache, shared: dict) -> torch.Tensor:
        """x [B, L, d] -> [B, L, d]; advances the cache (if any) by the batch. A `Packed` batch runs the
        projections over all rows and the attention per segment (`cache`, and a producer's entry in
        `shared`, are then per-segment lists)."""
        b, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, length, self.heads, self.head_dim)).transpose(1, 2)
        cos, sin = rope_tables(batch, self.rotary, q.dtype)
        q = apply_rotary(q, cos, sin)
        if self.sharing == REUSE:
            o = per_segment(batch, shared[self.kind], self.attend, q, dim=2)
        else:
            k = self.k_proj(x).view(b, length, self.kv_heads, self.head_dim)
            v = k if self.v_proj is None else self.v_proj(x).view(b, length, self.kv_heads, self.head_dim)
            k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)
            v = self.v_norm(v).transpose(1, 2)
            histories: list[AttentionHistory] = []

            def store_and_attend(seg: Batch, seg_cache, q, k, v) -> torch.Tensor:
                hist = self.visible(seg_cache.update(seg, k, v), seg)
                histories.append(hist)
                return self.attend(seg, hist, q)

            o = per_segment(batch, cache, store_and_attend, q, k, v, dim=2)
            if self.sharing == STORE:
                shared[self.kind] = histories if isinstance(batch, Packed) else histories[0]
        return self.o_proj(o.transpose(1, 2).reshape(b, length, -1))

    def attend(self, batch: Batch, hist: AttentionHistory, q: torch.Tensor) -> torch.Tensor:
        """q [B, H, L, D] over the keys / values of `hist` -> [B, H, L, D]."""
        return attention(
            q,
            hist.keys,
            hist.values,
            batch,
            key_start=hist.key_start,
            scale=1.0,
            window=self.window,
            prefix=hist.prefix,
        )

    def visible(self, hist: AttentionHistory, batch: Batch) -> AttentionHistory:
        """Drop the rows a cache keeps beyond this layer's window (the producer's extra rows for the
        assistant), so the attention keeps its no-mask decode path."""
        if self.window is None:
            return hist
        return hist.after(min(batch.offsets) - self.window + 1)


class Router(nn.Module):
    """Top-k softmax router on the scaled, weight-free RMS norm of the residual stream, with a
    learned scale per expert on the renormalised weights."""

    def __init__(self, c: Config):
        super().__init__()
        self.top_k = c.top_k_experts
        self.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps, scale=False)
        self.proj = Linear(c.hidden_size, c.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(c.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(c.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> routing weights [N, k] float32, expert ids [N, k]."""
        x = self.norm(x) * self.scale * x.shape[-1] ** -0.5
        weights, index = softmax_topk(self.proj(x), self.top_k)
        return weights * self.per_expert_scale[index], index


class Gemma4Block(nn.Module):
    """Sandwich-norm attention and feed-forward (dense MLP, plus routed experts fed from the residual
    when `enable_moe_block`), then the per-layer-input branch, then the learned output scale."""

    def __init__(self, c: Config, attn: Gemma4Attention):
        super().__init__()
        d, eps = c.hidden_size, c.rms_norm_eps
        self.self_attn = attn
        wide = c.use_double_wide_mlp and attn.sharing == REUSE
        self.mlp = GatedMLP(d, c.intermediate_size * (2 if wide else 1), c.hidden_activation)
        norms = [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ]
        self.moe = bool(c.enable_moe_block)
        if self.moe:
            self.router = Router(c)
            self.experts = Experts(c.num_experts, d, c.moe_intermediate_size, c.hidden_activation)
            norms += [
                "post_feedforward_layernorm_1",
                "post_feedforward_layernorm_2",
                "pre_feedforward_layernorm_2",
            ]
        for name in norms:
            setattr(self, name, Gemma4RMSNorm(d, eps))
        self.per_layer = bool(c.hidden_size_per_layer_input)
        if self.per_layer:
            self.act = ACTIVATIONS[c.hidden_activation]
            self.per_layer_input_gate = Linear(d, c.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = Linear(c.hidden_size_per_layer_input, d, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(d, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def make_cache(self, batch_size: int, dtype, device):
        return self.self_attn.make_cache(batch_size, dtype, device)

    def forward(self, h, batch: Batch, cache, per_layer_input, shared) -> torch.Tensor:
        """h [B, L, d], per_layer_input [B, L, d_ple] (None without PLE) -> [B, L, d]."""
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), batch, cache, shared))
        y = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            flat = h.reshape(-1, h.shape[-1])
            weights, index = self.router(flat)
            # float32 routing weights: each expert's output is weighted in float32, as transformers does
            routed = self.experts(self.pre_feedforward_layernorm_2(flat), index, weights)
            y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(routed.view(h.shape))
        h = h + self.post_feedforward_layernorm(y)
        if self.per_layer:
            gate = elementwise_rows(self.act, self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


def build_layers(c: Config, sharing: list[str | None], window_extra: int = 0) -> nn.ModuleList:
    """The decoder blocks of config `c` with the given KV-sharing roles; sliding layers mask
    `sliding_window + window_extra` tokens."""
    kinds = layer_types(c)
    overrides = layer_overrides(c, kinds)
    params = c.get("rope_parameters") or DEFAULT_ROPE
    rotary: dict[tuple[str, int], Rotary] = {}
    layers = nn.ModuleList()
    for kind, o, role in zip(kinds, overrides, sharing, strict=True):
        head_dim = o.get("head_dim", c.head_dim)
        kv_heads = o.get("num_key_value_heads", c.num_key_value_heads)
        if kind not in params:
            raise ValueError(f"Gemma 4 rope_parameters need an entry per layer type, got {params}")
        if (kind, head_dim) not in rotary:
            # the loader builds under torch.device("meta"); the rotary tables must hold real values
            with torch.device("cpu"):
                rotary[kind, head_dim] = Rotary(rope_inv_freq(head_dim, params[kind]))
        window = c.sliding_window + window_extra if kind == SLIDING else None
        attn = Gemma4Attention(c, kind, head_dim, kv_heads, rotary[kind, head_dim], role, window)
        layers.append(Gemma4Block(c, attn))
    return layers


def with_defaults(text: dict) -> Config:
    for key, value in DEFAULTS.items():
        text.setdefault(key, value)
    return Config(text)


def remap_text(name: str, shared_layers: set[int]) -> str | None:
    """Checkpoint name -> parameter name for a Gemma 4 text model whose layers `shared_layers` share
    keys/values (None: ignored)."""
    for old, new in RENAMES.items():
        if name.startswith(old):
            if new is None:
                return None
            name = new + name[len(old) :]
            break
    parts = name.split(".")
    is_attn = parts[:2] == ["model", "layers"] and len(parts) > 4 and parts[3] == "self_attn"
    if is_attn and int(parts[2]) in shared_layers and parts[4] in UNUSED_BY_SHARED_LAYERS:
        return None
    return name


@register("gemma4_text", "gemma4")
class Gemma4(CausalLM):
    """Layers' forward takes `(h, batch, cache, per_layer_input, shared)`: `shared` carries each
    producer's attention history to the KV-shared layers within one forward (per segment for a
    `Packed` batch)."""

    packs = True

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        if c.use_bidirectional_attention == "all":
            raise ValueError("Gemma 4 with use_bidirectional_attention='all' (an encoder) is not causal")
        kinds = layer_types(c)
        sharing = kv_sharing(c, kinds)
        self.first_shared = len(kinds) - c.num_kv_shared_layers
        # the producer layer of each type (what the assistant drafter reads), when layers share KV
        self.kv_producers = {kinds[i]: i for i, role in enumerate(sharing) if role == STORE}
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = build_layers(c, sharing)
        self.model.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.per_layer_dim = c.hidden_size_per_layer_input
        if self.per_layer_dim:
            n = c.num_hidden_layers
            self.model.embed_tokens_per_layer = nn.Embedding(
                c.vocab_size_per_layer_input, n * self.per_layer_dim
            )
            self.model.per_layer_model_projection = Linear(c.hidden_size, n * self.per_layer_dim, bias=False)
            self.model.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer_dim, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    @classmethod
    def text_config(cls, raw: dict) -> Config:
        text = dict(raw.get("text_config") or raw)
        if "text_config" in raw:
            # the multimodal model ties its head by its own field (default True), not the text one
            text["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
        return with_defaults(text)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        roles = kv_sharing(config, layer_types(config))
        return remap_text(name, {i for i, role in enumerate(roles) if role == REUSE})

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., d] embeddings times sqrt(d), the scale rounded to the activation dtype
        first as the reference does."""
        e = self.model.embed_tokens(ids)
        return e * torch.tensor(self.config.hidden_size**0.5).to(e.dtype)

    def embed(self, batch: Batch) -> torch.Tensor:
        return self.embed_ids(batch.input_ids)

    def per_layer_inputs(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """[B, L, n_layers, d_ple]: (norm(proj(embeds) / sqrt(d)) + ple(ids) · sqrt(d_ple)) / sqrt(2)."""
        if not self.per_layer_dim:
            return None
        b, length = ids.shape
        shape = (b, length, self.config.num_hidden_layers, self.per_layer_dim)
        tokens = self.model.embed_tokens_per_layer(ids)
        tokens = tokens * torch.tensor(self.per_layer_dim**0.5).to(tokens.dtype)
        proj = self.model.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        proj = self.model.per_layer_projection_norm(proj.view(shape))
        return (proj + tokens.view(shape)) * 2**-0.5

    def run_layers(self, batch: Batch, caches, last_only: bool) -> torch.Tensor:
        """Final-normed hidden states: [B, L, d], or with `last_only` [B, 1, d] at each row's last
        real token. The KV-shared layers write no cache, so with `last_only` they run on the last
        tokens alone (as transformers does when it keeps only the last logits)."""
        h = self.embed(batch)
        per_layer = self.per_layer_inputs(batch.input_ids, h)
        shared: dict[str, AttentionHistory] = {}
        layers = self.model.layers
        for i, (layer, cache) in enumerate(zip(layers, caches, strict=True)):
            if last_only and i == self.first_shared:
                batch, h, per_layer = last_tokens(batch, h, per_layer)
            h = layer(h, batch, cache, None if per_layer is None else per_layer[:, :, i], shared)
        if last_only and self.first_shared == len(layers):
            batch, h, per_layer = last_tokens(batch, h, per_layer)
        return self.model.norm(h)

    def hidden_states(self, batch: Batch, caches) -> torch.Tensor:
        return self.run_layers(batch, caches, last_only=False)

    @torch.no_grad()
    def forward(self, batch: Batch, caches, logits: str = "last", hidden: str | None = None):
        """See `CausalLM.forward`. Unless every position's logits or hidden states are asked for, the
        KV-shared layers run on the last tokens only."""
        if "all" in (logits, hidden):
            h = self.hidden_states(batch, caches)
            last = last_rows(batch, h)
        else:
            h = last = self.run_layers(batch, caches, last_only=True)
        out = self.head(h) if logits == "all" else self.head(last[:, 0])
        if hidden is None:
            return out
        return out, h if hidden == "all" else last

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., V] float32 logits, soft-capped to ±cap when the config sets a cap."""
        logits = self.lm_head(h).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits = elementwise_rows(lambda t: torch.tanh(t / cap) * cap, logits)
        return logits


def last_tokens(batch: Batch, h: torch.Tensor, per_layer: torch.Tensor | None):
    """The batch, hidden states [B, 1, d] and per-layer inputs [B, 1, n, d_ple] of each row's last
    real token (a row without tokens keeps position 0 of the batch: its output is discarded)."""
    if batch.length == 1:
        return batch, h, per_layer
    last = torch.as_tensor([max(n - 1, 0) for n in batch.query_lens], device=h.device)
    rows = torch.arange(h.shape[0], device=h.device)
    tail = Batch(
        batch.input_ids[rows, last][:, None],
        [1] * batch.size,
        [o + max(n - 1, 0) for o, n in zip(batch.offsets, batch.query_lens, strict=True)],
    )
    return tail, h[rows, last][:, None], None if per_layer is None else per_layer[rows, last][:, None]
