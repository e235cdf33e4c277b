"""Model contract and the registry of families by `model_type` (their configuration view: `models.config`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from hybridlm.batch import Batch, Packed
from hybridlm.cache.base import LayerCache
from hybridlm.models.config import Config
from hybridlm.models.decode import decode_plan, forget_plan
from hybridlm.ops.linear import rowwise
from hybridlm.ops.native import FEW_TOKENS
from hybridlm.ops.threads import decode_team

FAMILIES: dict[str, type[CausalLM]] = {}


def register(*model_types: str) -> Callable[[type[CausalLM]], type[CausalLM]]:
    def deco(cls):
        for t in model_types:
            FAMILIES[t] = cls
        return cls

    return deco


class CausalLM(nn.Module):
    """A decoder-only LM: `model.embed_tokens`, `model.layers[i]`, `model.norm`, `lm_head`.

    Parameter names follow the Hugging Face checkpoint of the family (after `remap`), so a
    checkpoint loads with `load_state_dict`. Each layer has `make_cache(batch_size, dtype,
    device)` returning its cache (or None) and `forward(h, batch, cache) -> h`.
    """

    config: Config
    # Whether every layer runs a `Packed` batch (projections over all rows, token mixers per sequence
    # through `layers.per_segment`, every other op per-row math): a family opts in once its layers do.
    packs = False
    # Parameter-name endings loaded in float32 whatever the model's dtype (what transformers keeps in
    # float32 for the family: `_keep_in_fp32_modules_strict`), so bf16 models round where its do.
    keep_float32: tuple[str, ...] = ()

    @classmethod
    def text_config(cls, raw: dict) -> Config:
        """The config the text model is built from (multimodal layouts nest it)."""
        text = dict(raw.get("text_config") or raw)
        if "tie_word_embeddings" in raw:
            text.setdefault("tie_word_embeddings", raw["tie_word_embeddings"])
        return Config(text)

    @classmethod
    def remap(cls, name: str, config: Config) -> str | None:
        """Checkpoint tensor name -> parameter name; None ignores the tensor."""
        return name

    @classmethod
    def convert(cls, state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
        """Rewrite loaded tensors into this implementation's layout (fused projections...)."""
        return state

    @classmethod
    def published(cls, state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
        """This implementation's tensors in the layout the family's checkpoints are published in,
        where other programs (llama.cpp's converter) read nothing else: `remap` and `convert` undone.
        Families whose loader takes their own names back unchanged keep them."""
        return state

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def _apply(self, fn, recurse=True):
        forget_plan(self)  # a plan checks dtypes and devices when it is built
        return super()._apply(fn, recurse)

    def make_caches(self, batch_size: int = 1) -> list[LayerCache | None]:
        return [layer.make_cache(batch_size, self.dtype, self.device) for layer in self.model.layers]

    def embed(self, batch: Batch) -> torch.Tensor:
        return self.model.embed_tokens(batch.input_ids)

    def prepare(self, batch: Batch) -> None:
        """Per-forward shared tensors (rotary tables) go into `batch.memo` here."""

    def hidden_states(self, batch: Batch, caches: list[LayerCache | None]) -> torch.Tensor:
        """[B, L, d] final-normed hidden states; advances every cache by the batch. A decode or verify
        step (1 to `FEW_TOKENS` tokens of one sequence) runs as the model's `DecodePlan` (the same
        kernels on the same inputs, without the modules' per-call Python)."""
        plan = decode_plan(self, batch)
        if plan is not None:
            return plan(self, batch, caches)
        self.prepare(batch)
        h = self.embed(batch)
        for layer, cache in zip(self.model.layers, caches, strict=True):
            h = layer(h, batch, cache)
        return self.model.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()

    def decode_sized(self, tokens: int) -> bool:
        """Whether a segment of `tokens` runs on the cores other processes leave idle (`ops.threads`):
        up to FEW_TOKENS of a bf16 CPU model, whose every product then runs in the row-wise kernels,
        which give the same bits with any team (float32 linears take MKL, which may not)."""
        return tokens <= FEW_TOKENS and self.dtype is torch.bfloat16 and self.device.type == "cpu"

    def mtp_head(self) -> nn.Module | None:
        """The family's multi-token-prediction head, built without weights (they are the checkpoint's
        `mtp.*` tensors; see `models.mtp`), or None when the family has none."""
        return None

    @torch.no_grad()
    def forward(
        self,
        batch: Batch,
        caches: list[LayerCache | None],
        logits: str = "last",
        hidden: str | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the batch through the model, advancing the caches.

        logits: "last" -> [B, V] float32 at each row's last real token; "all" -> [B, L, V].
        hidden: also return final-normed hidden states (what a drafter reading the target's hidden
            states takes), as (logits, hidden): "all" -> [B, L, d]; "last" -> [B, 1, d] at each row's
            last real token (a family may then skip computing the others).
        """
        with decode_team() if self.decode_sized(batch.input_ids.numel()) else nullcontext():
            h = self.hidden_states(batch, caches)
            last = last_rows(batch, h) if "last" in (logits, hidden) else None
            out = self.head(h) if logits == "all" else self.head(last[:, 0])
        if hidden is None:
            return out
        return out, h if hidden == "all" else last


def renamed(name: str, renames: list[tuple[str, str]]) -> str:
    """`name` with the first of `renames`' ``(old, new)`` pairs whose ``old`` it contains applied, once."""
    for old, new in renames:
        if old in name:
            return name.replace(old, new, 1)
    return name


@torch.no_grad()
def forward_packed(
    model: CausalLM,
    segments: list[Batch],
    caches: list[list[LayerCache | None]],
    rows: list[str],
    hidden: bool = False,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One forward over several sequences (`model.packs` must hold): segment i (a B = 1 batch at its own
    offset) advances `caches[i]`; returns per segment float32 logits, [1, V] at its last token for
    `rows[i] == "last"`, [L_i, V] for "all" (with `hidden`, also the final-normed hidden states of
    the same rows, [1, d] / [L_i, d], as (logits, hidden)). Every linear computes each row as a
    one-row call would (`rowwise`), every mixer runs on the segment alone: each sequence's numbers
    are those of its own forward, whatever else is packed beside it."""
    packed = Packed(segments)
    per_layer = [list(layer) for layer in zip(*caches, strict=True)]
    few = all(model.decode_sized(hi - lo) for lo, hi in packed.bounds)
    with rowwise(), decode_team() if few else nullcontext():
        h = model.hidden_states(packed, per_layer)[0]
        picks = []
        for (lo, hi), which in zip(packed.bounds, rows, strict=True):
            picks.append((hi - 1, hi) if which == "last" else (lo, hi))
        index = torch.cat([torch.arange(a, b) for a, b in picks]).to(h.device)
        picked = h[index]
        logits = model.head(picked)
    sizes = [b - a for a, b in picks]
    if hidden:
        return list(logits.split(sizes)), list(picked.split(sizes))
    return list(logits.split(sizes))


def last_rows(batch: Batch, h: torch.Tensor) -> torch.Tensor:
    """[B, L, d] -> [B, 1, d]: each row's last real token (position 0 for a row without tokens)."""
    last = (torch.as_tensor(batch.query_lens, device=h.device) - 1).clamp(min=0)
    return h[torch.arange(h.shape[0], device=h.device), last][:, None]
