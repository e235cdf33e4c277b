"""The Gemma 4 assistant drafter (`gemma4_assistant`, transformers' Gemma4AssistantForCausalLM).

A few Gemma 4 decoder layers that own no keys or values: every layer attends, as a KV-shared
layer does, over the keys/values of the *target's* producer layer of its type (the last
non-shared sliding and global layers). One draft step at query position P (the position of the
newest token t, whose keys the target has not computed yet):

    x = pre_projection([target.embed(t) ‖ h])        h: the target's final-normed hidden state at
    x = layers(x) over the target's KV before P          P - 1, or the previous step's output
    logits = lm_head(norm(x)) (or the ordered-embedding head), h' = post_projection(norm(x))

Later steps of a round feed the drafted token and h' at the same position P over the same KV.
The sliding layers see the target's last window + 1 keys before P (transformers' bidirectional
sliding mask from a query past the last key); the global layers see every key before P.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hybridlm.batch import Batch
from hybridlm.cache import AttentionHistory
from hybridlm.models.base import Config
from hybridlm.models.checkpoint import CheckpointError, read_json
from hybridlm.models.gemma4 import (
    ASSISTANT_EXTRA_ROWS,
    REUSE,
    Gemma4,
    Gemma4RMSNorm,
    build_layers,
    remap_text,
    with_defaults,
)
from hybridlm.models.loader import load_weights
from hybridlm.ops.linear import Linear

# Gemma4AssistantConfig defaults
ASSISTANT_FIELDS = {
    "backbone_hidden_size": 1536,
    "use_ordered_embeddings": False,
    "num_centroids": 2048,
    "centroid_intermediate_top_k": 32,
}


class OrderedEmbeddingHead(nn.Module):
    """Logits for the tokens of the `top_k` best-scoring of `num_centroids` token clusters only
    (`token_ordering` lists the vocabulary cluster by cluster); every other token gets the row's
    lowest computed logit minus 1."""

    def __init__(self, hidden: int, vocab: int, num_centroids: int, top_k: int):
        super().__init__()
        if vocab % num_centroids:
            raise ValueError(f"vocab_size {vocab} is not a multiple of num_centroids {num_centroids}")
        self.top_k, self.num_centroids = top_k, num_centroids
        self.centroids = Linear(hidden, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab, dtype=torch.long))

    def forward(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """h [N, d], lm_head weight [V, d] -> [N, V] logits in h's dtype."""
        clusters = self.centroids(h).topk(self.top_k, dim=-1).indices  # [N, k]
        tokens = self.token_ordering.view(self.num_centroids, -1)[clusters].flatten(1)  # [N, k·V/C]
        picked = torch.einsum("nd,ntd->nt", h, lm_head[tokens])
        # transformers fills with the minimum over its (single-row) call; per row keeps rows independent
        out = (picked.amin(dim=-1, keepdim=True) - 1).expand(-1, lm_head.shape[0]).clone()
        return out.scatter_(1, tokens, picked)


class Gemma4Assistant(nn.Module):
    """Loading hooks as a `CausalLM` (`text_config`, `remap`, `convert`, `tied`), but not a
    language model of its own: see `forward` and `target_kv`."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = c = config
        for field in ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp"):
            if c[field]:
                raise ValueError(f"a Gemma 4 assistant with {field}={c[field]!r} is not supported")
        if c.num_kv_shared_layers not in (0, c.num_hidden_layers):
            raise ValueError(
                "a Gemma 4 assistant shares every layer's keys/values, "
                f"got num_kv_shared_layers={c.num_kv_shared_layers}"
            )
        self.model = nn.Module()
        # Unused by the forward (the target embeds the tokens): the tied head's weight.
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.model.layers = build_layers(c, [REUSE] * c.num_hidden_layers, window_extra=ASSISTANT_EXTRA_ROWS)
        self.model.norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        self.pre_projection = Linear(2 * c.backbone_hidden_size, c.hidden_size, bias=False)
        self.post_projection = Linear(c.hidden_size, c.backbone_hidden_size, bias=False)
        if c.use_ordered_embeddings:
            self.masked_embedding = OrderedEmbeddingHead(
                c.hidden_size, c.vocab_size, c.num_centroids, c.centroid_intermediate_top_k
            )

    @classmethod
    def text_config(cls, raw: dict) -> Config:
        """The assistant's text config with its own fields (backbone_hidden_size...) merged in."""
        text = dict(raw.get("text_config") or {})
        text["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
        for key, value in ASSISTANT_FIELDS.items():
            text[key] = raw.get(key, value)
        return with_defaults(text)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        return remap_text(name, set(range(config.num_hidden_layers)))

    @classmethod
    def convert(cls, state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
        return state

    @property
    def tied(self) -> bool:
        return bool(self.config.tie_word_embeddings)

    def check_target(self, target: Gemma4) -> None:
        """Raise ValueError unless this assistant can draft for `target` (hidden size, vocabulary,
        a producer of each layer type it reads with its head dim)."""
        c, t = self.config, target.config
        if c.backbone_hidden_size != t.hidden_size or c.vocab_size != t.vocab_size:
            raise ValueError(
                f"assistant for hidden size {c.backbone_hidden_size} / vocab {c.vocab_size}, "
                f"target has {t.hidden_size} / {t.vocab_size}"
            )
        if not target.kv_producers:
            raise ValueError(
                "the target shares no keys/values (num_kv_shared_layers = 0): nothing to draft from"
            )
        for layer in self.model.layers:
            attn = layer.self_attn
            if attn.kind not in target.kv_producers:
                raise ValueError(f"the target has no {attn.kind} layer to share keys/values from")
            producer = target.model.layers[target.kv_producers[attn.kind]].self_attn
            if producer.head_dim != attn.head_dim:
                raise ValueError(
                    f"{attn.kind}: assistant head dim {attn.head_dim}, target {producer.head_dim}"
                )

    @torch.no_grad()
    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, position: int, kv: dict[str, AttentionHistory]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for B rows at query `position`.

        embeds [B, D]: the target's input embedding (`Gemma4.embed_ids`) of the token at `position`;
        hidden [B, D]: the target's final-normed hidden state at `position - 1` on a round's first
        step, else the previous step's second output; kv: `target_kv(...)` at `position`.
        Returns float32 logits [B, V] for the token at `position + 1` and the projected state [B, D].
        """
        b = embeds.shape[0]
        # the layers read no ids: the batch only carries the query position
        batch = Batch(torch.zeros(b, 1, dtype=torch.long, device=embeds.device), [1] * b, [position] * b)
        h = self.pre_projection(torch.cat([embeds, hidden], dim=-1))[:, None]
        for layer in self.model.layers:
            h = layer(h, batch, None, None, kv)
        h = self.model.norm(h)[:, 0]
        if self.config.use_ordered_embeddings:
            logits = self.masked_embedding(h, self.lm_head.weight)
        else:
            logits = self.lm_head(h)
        return logits.float(), self.post_projection(h)


def target_kv(target: Gemma4, caches, position: int) -> dict[str, AttentionHistory]:
    """What the assistant attends over at query `position`: per layer type, the target producer's
    keys/values [B, H, T, D] that its cache holds for a rewind to `position`, i.e. positions
    [0, position) (global) or the last window + 1 before it (sliding: that producer's cache keeps
    ASSISTANT_EXTRA_ROWS more than its layer's window needs, through any forward, rewind or
    restore to `position`)."""
    if not target.kv_producers:
        raise ValueError("the target shares no keys/values (num_kv_shared_layers = 0): nothing to draft from")
    out = {}
    for kind, i in target.kv_producers.items():
        cache = caches[i]
        if not cache.can_rewind(position):
            raise ValueError(f"the target's {kind} producer cache does not hold the keys before {position}")
        lo = 0 if cache.window is None else max(0, position - cache.window + 1)
        keys, values = cache.rows(lo, position)
        out[kind] = AttentionHistory(keys, values, lo, cache.window)
    return out


def load_assistant(path: str | Path, dtype: torch.dtype | None = None, device=None) -> Gemma4Assistant:
    """Load a `gemma4_assistant` checkpoint directory (bf16 unless `dtype` says)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    raw = read_json(root / "config.json")
    if raw.get("model_type") != "gemma4_assistant":
        raise CheckpointError(
            f"{root / 'config.json'}: model_type {raw.get('model_type')!r}, not gemma4_assistant"
        )
    return load_weights(Gemma4Assistant, root, raw, dtype, device)
