"""Next-token selection from logits: greedy, temperature, top-k, top-p, min-p."""

from __future__ import annotations

import torch


def filter_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """[..., V] float32 logits -> tempered logits with filtered entries set to -inf."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_p
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[B, V] logits -> [B] token ids; temperature 0 is greedy (argmax). `generator` lives on the
    logits' device."""
    if temperature <= 0.0:
        return logits.argmax(-1)
    probs = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).view(-1)
