"""The Gemma 4 assistant drafter (`models.gemma4_assistant`): a few layers that attend over the
target's own keys/values and start from the target's last hidden state.

A round at target offset P (the caches hold the committed run [0, P); t, the newest token, sits at
P and is not fed yet): the first step reads the target's final-normed hidden state at P - 1 (the
last row of the last report) and the target's embedding of t; each further step reads the previous
step's projected state and the embedding of the token it drafted, at the same query position P
over the same keys/values (`target_kv`: every key before P from the global producer, the last
window + 1 from the sliding one).

State: none of the assistant's own, so nothing to roll back. The keys/values are views of the
target's live buffers; a proposal runs between two target forwards, when those hold exactly the
committed run. Only the last hidden state of each report is read, so the target computes only
that row (its KV-shared layers then run on the last token alone during prefill).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from hybridlm.cache.base import LayerCache
from hybridlm.models.base import CausalLM
from hybridlm.models.checkpoint import read_json
from hybridlm.models.gemma4 import Gemma4
from hybridlm.models.gemma4_assistant import Gemma4Assistant, load_assistant, target_kv
from hybridlm.ops.quant import QUANTIZATIONS, quantize_
from hybridlm.speculative.base import Draft, TargetCacheDrafter, TargetPolicy, draw

MODEL_TYPE = "gemma4_assistant"


def is_assistant(path: str | Path) -> bool:
    """Whether checkpoint directory `path` holds a Gemma 4 assistant (by config.json's model_type)."""
    config = Path(path) / "config.json"
    return config.is_file() and read_json(config).get("model_type") == MODEL_TYPE


class Assistant:
    """A Gemma 4 assistant checked against its target, shared by every request; calling it makes one
    request's drafter. Raises ValueError unless `target` is a Gemma 4 it can draft for (hidden size,
    vocabulary, a KV producer of each layer type with the assistant's head dims)."""

    def __init__(self, target: CausalLM, model: Gemma4Assistant):
        if not isinstance(target, Gemma4):
            raise ValueError(
                f"a Gemma 4 assistant drafts only for a Gemma 4 target, not {type(target).__name__}"
            )
        model.check_target(target)
        self.target = target
        self.model = model

    @classmethod
    def load(cls, path: str | Path, target: CausalLM, quantize: str | None = None) -> Assistant:
        """Load checkpoint directory `path` in the target's dtype, on its device; `quantize` ("int8" /
        "int4") makes its linear layers weight-only quantized (but the LM head when ordered embeddings
        read its weight as a table)."""
        if quantize not in (None, *QUANTIZATIONS):
            raise ValueError(f"unknown draft quantization {quantize!r}; known: {', '.join(QUANTIZATIONS)}")
        model = load_assistant(path, dtype=target.dtype, device=target.device)
        if quantize is not None:
            quantize_(model, quantize, skip=("lm_head",) if model.config.use_ordered_embeddings else ())
        return cls(target, model)

    def __call__(self) -> AssistantDrafter:
        return AssistantDrafter(self.target, self.model)


class AssistantDrafter(TargetCacheDrafter):
    """One request's view of the target: its live caches and the hidden state of the last reported
    position (`end` - 1)."""

    hidden_rows = "last"

    def __init__(self, target: Gemma4, model: Gemma4Assistant):
        self.target = target
        self.model = model
        self.caches: Sequence[LayerCache | None] | None = None
        self.end: int | None = None  # end (exclusive) of the positions reported so far
        self.last: torch.Tensor | None = None  # [1, d] the target's hidden state at end - 1

    def attach(self, caches: Sequence[LayerCache | None]) -> None:
        self.caches = caches

    def observe(self, offset: int, tokens: list[int], hidden: torch.Tensor) -> None:
        self.end, self.last = offset + len(tokens), hidden[-1:]

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int, policy: TargetPolicy) -> Draft:
        """k tokens: greedy (no q) under a greedy policy, else drawn from the assistant's distribution
        under the policy's temperature and filters (q returned)."""
        position = len(tokens) - 1  # the target holds tokens[:position]; the last one is not fed yet
        if self.caches is None or self.end != position:
            raise RuntimeError(
                f"the assistant drafter was told of target positions up to {self.end}, but the run needs "
                f"{position} (are the caches attached and every committed target forward observed?)"
            )
        kv = target_kv(self.target, self.caches, position)
        token, hidden = tokens[-1], self.last
        drafts, rows = [], []
        for _ in range(k):
            embeds = self.target.embed_ids(torch.tensor([token], device=self.target.device))
            logits, hidden = self.model(embeds, hidden, position, kv)
            token, q = draw(logits[0], policy)
            drafts.append(token)
            rows.append(q)
        return Draft(drafts, None if policy.greedy else torch.stack(rows))

    def close(self) -> None:
        self.caches = self.end = self.last = None
